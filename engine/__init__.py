"""A numpy inference engine for GGUF models.

It knows nothing of HTTP: it reads a GGUF file, keeps the weights quantized in
memory, turns text into tokens and tokens into logits, and exposes generation
as an async generator.
"""

from .chat import ChatRequest, Finished, PreparedChat, ReasoningDelta, TextDelta, ToolCall
from .errors import (ChatTemplateError, ContextLengthExceeded, EngineError, ModelFileError,
                     QueueFull, SchemaError, UnsupportedModelError)
from .generate import Generation, Token
from .model import Model, ModelInfo, load_model
from .sampling import Constraint, SamplingParams

__all__ = [
    "load_model", "Model", "ModelInfo", "SamplingParams", "Constraint", "Token", "Generation",
    "ChatRequest", "PreparedChat", "TextDelta", "ReasoningDelta", "ToolCall",
    "Finished", "EngineError", "ModelFileError", "UnsupportedModelError",
    "ContextLengthExceeded", "SchemaError", "QueueFull", "ChatTemplateError",
]
