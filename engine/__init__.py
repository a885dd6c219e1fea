"""A numpy inference engine for GGUF models.

It knows nothing of HTTP: it reads a GGUF file, keeps the weights quantized in
memory, turns text into tokens and tokens into logits, and exposes generation
as an async generator.

The names below are imported on first use (PEP 562), not by `import engine`: the
protocol package reads model headers with `engine.gguf_header` and
`engine.describe`, and exchanges the plain values of `engine.api` and the errors of
`engine.errors`, which need only the standard library; it must not pull numpy in by
importing this package on the way. (`blas_kernel`, `blas_kernel_below_cpu` and
`num_threads`, which a server prints at start-up, bring numpy with them, when they are
first used.)

Next: README.md's reading order (engine/reference.py first); engine/api.py is the
contract with the server.
"""

import importlib
from typing import TYPE_CHECKING

# public name -> the module of this package that defines it
_DEFINED_IN = {
    "ChatRequest": "api", "PreparedChat": "api", "TokenCounts": "api", "TextDelta": "api",
    "ReasoningDelta": "api", "ToolCall": "api", "Finished": "api", "SamplingParams": "api",
    "EngineError": "errors", "ModelFileError": "errors", "UnsupportedModelError": "errors",
    "ContextLengthExceeded": "errors", "SchemaError": "errors", "QueueFull": "errors",
    "ChatTemplateError": "errors",
    "Generation": "generate", "Token": "generate",
    "Model": "model", "ModelInfo": "model", "load_model": "model",
    "Constraint": "sampling",
    "blas_kernel": "accel", "blas_kernel_below_cpu": "accel", "num_threads": "accel",
}

__all__ = [
    "load_model", "Model", "ModelInfo", "SamplingParams", "Constraint", "Token", "Generation",
    "ChatRequest", "PreparedChat", "TokenCounts", "TextDelta", "ReasoningDelta", "ToolCall",
    "Finished", "EngineError", "ModelFileError", "UnsupportedModelError",
    "ContextLengthExceeded", "SchemaError", "QueueFull", "ChatTemplateError",
    "blas_kernel", "blas_kernel_below_cpu", "num_threads",
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
    from .accel import blas_kernel, blas_kernel_below_cpu, num_threads
    from .api import (ChatRequest, Finished, PreparedChat, ReasoningDelta, SamplingParams, TextDelta,
                      TokenCounts, ToolCall)
    from .errors import (ChatTemplateError, ContextLengthExceeded, EngineError, ModelFileError,
                         QueueFull, SchemaError, UnsupportedModelError)
    from .generate import Generation, Token
    from .model import Model, ModelInfo, load_model
    from .sampling import Constraint
