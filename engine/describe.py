"""What a model is, told from its GGUF header: the name of its quantization and what it can do.

Two places describe a model: the model listing (lmsp_min/registry.py), which must
not load a model, and a loaded model's `ModelInfo` (engine/model.py). Both use the
table and the rules here, so a model is described the same before and after its
load; the one fact loading adds is whether constrained decoding can work in the
vocabulary (`engine.constrain.can_constrain`), which the listing predicts from the
tokenizer's kind until then. Standard library only: lmsp_min never imports numpy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from engine.gguf_header import GGUFHeader

# llama.cpp's `llama_ftype`, the `general.file_type` key: what most of the weights are
# quantized to, as named in model ids ("..-q4_k_m") and in model objects. (4-6 were
# file types llama.cpp has since removed; 1024, "guessed", is never written to a file.)
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1",
    10: "Q2_K", 11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M",
    16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S",
    22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M",
    28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0",
    38: "MXFP4_MOE", 39: "NVFP4", 40: "Q1_0",
}

# ggml's tensor types, the `type` of a tensor record (gguf-py's GGMLQuantizationType).
TENSOR_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K",
    16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S",
    22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64",
    29: "IQ1_M", 30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}

# A chat template that writes <think> blocks makes a reasoning model: engine/chat.py
# routes the text inside them to ReasoningDelta.
THINK_OPEN = "<think>"
# Constrained decoding (tools, structured output) needs every printable ASCII byte as
# a token of its own (see can_constrain). The tokenizers that have them: byte-level
# BPE ("gpt2") and SentencePiece with byte fallback ("llama").
BYTE_COMPLETE_TOKENIZERS = ("gpt2", "llama")
# Architectures that embed and do not generate: encoders, which have no LM head
# (engine/architectures.py's bert and nomic-bert; engine/embed.py)
ENCODERS = ("bert", "nomic-bert")


def generates(architecture: str) -> bool:
    """Whether a model of this architecture generates text (every one we run embeds)."""
    return architecture not in ENCODERS


def quantization(header: GGUFHeader) -> str:
    """The quantization's name: the file type, or else the most common type of the matrices.

    A file without a file type we know (an old or hand-written one) is named after the
    type most of its 2-D tensors have, the first found on a tie; "unknown" without any.
    """
    file_type = header.metadata.get("general.file_type")
    if isinstance(file_type, int) and not isinstance(file_type, bool) and file_type in FILE_TYPES:
        return FILE_TYPES[file_type]
    types = Counter(TENSOR_TYPES[t.type] for t in header.tensors
                    if len(t.shape) == 2 and t.type in TENSOR_TYPES)
    return types.most_common(1)[0][0] if types else "unknown"


def capabilities(chat_template: Any, constrainable: bool) -> tuple[str, ...]:
    """The capabilities a model offers, among "reasoning", "tools", "structured_output".

    `chat_template` is the file's `tokenizer.chat_template` (None or anything that is
    not a string: no template); `constrainable` whether constrained decoding works in
    the vocabulary: `can_constrain(tokenizer)` once loaded, `predict_constrainable`
    from the header before.
    """
    found = ("reasoning",) if isinstance(chat_template, str) and THINK_OPEN in chat_template else ()
    if constrainable:
        found += ("tools", "structured_output")
    return found


def predict_constrainable(metadata: Mapping[str, Any]) -> bool:
    """What `can_constrain` will say of the vocabulary, told from its tokenizer's kind alone
    (reading the vocabulary itself is what a listing must not do)."""
    return metadata.get("tokenizer.ggml.model") in BYTE_COMPLETE_TOKENIZERS
