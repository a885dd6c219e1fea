"""A numpy inference engine for GGUF models.

It knows nothing of HTTP: it reads a GGUF file, keeps the weights quantized in
memory, turns text into tokens and tokens into logits, and exposes generation
as an async generator.

The names below are imported on first use (PEP 562), not by `import engine`: the
protocol package reads model headers with `engine.gguf_header` and
`engine.describe`, which need only the standard library, and must not pull numpy
in by importing this package on the way.
"""

import importlib
from typing import TYPE_CHECKING

# public name -> the module of this package that defines it
_DEFINED_IN = {
    "ChatRequest": "chat", "PreparedChat": "chat", "TextDelta": "chat", "ReasoningDelta": "chat",
    "ToolCall": "chat", "Finished": "chat",
    "EngineError": "errors", "ModelFileError": "errors", "UnsupportedModelError": "errors",
    "ContextLengthExceeded": "errors", "SchemaError": "errors", "QueueFull": "errors",
    "ChatTemplateError": "errors",
    "Generation": "generate", "Token": "generate",
    "Model": "model", "ModelInfo": "model", "load_model": "model",
    "Constraint": "sampling", "SamplingParams": "sampling",
}

__all__ = [
    "load_model", "Model", "ModelInfo", "SamplingParams", "Constraint", "Token", "Generation",
    "ChatRequest", "PreparedChat", "TextDelta", "ReasoningDelta", "ToolCall",
    "Finished", "EngineError", "ModelFileError", "UnsupportedModelError",
    "ContextLengthExceeded", "SchemaError", "QueueFull", "ChatTemplateError",
]


def __getattr__(name: str):
    module = _DEFINED_IN.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value  # looked up once: later uses find it here
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see: the same names, imported eagerly
    from .chat import ChatRequest, Finished, PreparedChat, ReasoningDelta, TextDelta, ToolCall
    from .errors import (ChatTemplateError, ContextLengthExceeded, EngineError, ModelFileError,
                         QueueFull, SchemaError, UnsupportedModelError)
    from .generate import Generation, Token
    from .model import Model, ModelInfo, load_model
    from .sampling import Constraint, SamplingParams
