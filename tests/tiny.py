"""Tiny random-weight GGUF models, one per architecture, for fast tests.

A tiny model has the real file layout (tensor names, metadata keys, tokenizer)
of its architecture but a few layers of width 64, so a test can load it, run
prefill and decode, and compare code paths in milliseconds. Its weights are
stored in several formats (F32, F16, Q8_0, Q4_0) so the kernels are exercised
along the way. Text it generates is noise, but deterministic noise.
`write_tiny_bert` writes an encoder the same way (BERT's layout, or nomic-bert's, and
a small WordPiece vocabulary), which embeds and does not generate.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter, LlamaFileType, PoolingType, RopeScalingType
from gguf.quants import quantize

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")

SMOLLM2_TOKENIZER = Path(__file__).parent / "data" / "tokenizer-meta.smollm2.json.gz"


def load_tokenizer_meta(path: str | Path) -> dict:
    """Every `tokenizer.*` key of a GGUF file, as saved in a .json or .json.gz file."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        return json.load(f)


def write_tiny_model(
    path: str | Path,
    architecture: str = "llama",
    tokenizer_meta: dict | None = None,
    seed: int = 0,
    n_layer: int | None = None,
    n_embd: int = 64,
    n_head: int = 4,
    n_head_kv: int = 2,
    n_ff: int = 128,
    context_length: int = 512,
    sliding_window: int = 8,
    rope_scaling_factor: float | None = None,
    rope_freq_factors: tuple[float, ...] | None = None,
) -> Path:
    """Write a tiny random-weight GGUF of `architecture` to `path` and return the path.

    `tokenizer_meta` is the `tokenizer.*` metadata to embed (default: SmolLM2's).
    gemma3 gets six layers (five sliding-window layers, then one global) unless
    `n_layer` says otherwise, and a short `sliding_window` so the window matters.
    `rope_scaling_factor` adds linear RoPE scaling, `rope_freq_factors` a
    `rope_freqs.weight` tensor (Llama 3.1 style) of head_dim/2 divisors. Files with the default tokenizer are kept in memory and written again as they
    are when asked for again: packing 49k tokens of metadata takes seconds, and
    test suites ask for the same tiny model many times.
    """
    if architecture not in ARCHITECTURES:
        raise ValueError(f"no tiny model for architecture {architecture!r}")
    key = (architecture, seed, n_layer, n_embd, n_head, n_head_kv, n_ff, context_length, sliding_window,
           rope_scaling_factor, rope_freq_factors)
    if tokenizer_meta is None:
        if key not in _WRITTEN:
            _write(path, architecture, load_tokenizer_meta(SMOLLM2_TOKENIZER), *key[1:])
            while len(_WRITTEN) >= 8:
                del _WRITTEN[next(iter(_WRITTEN))]
            _WRITTEN[key] = Path(path).read_bytes()
        else:
            Path(path).write_bytes(_WRITTEN[key])
        return Path(path)
    return _write(path, architecture, tokenizer_meta, *key[1:])


_WRITTEN: dict[tuple, bytes] = {}  # default-tokenizer tiny files already made in this process


def _write(path, architecture, tokenizer_meta, seed, n_layer, n_embd, n_head, n_head_kv, n_ff,
           context_length, sliding_window, rope_scaling_factor, rope_freq_factors) -> Path:
    gemma = architecture == "gemma3"
    n_layer = n_layer or (6 if gemma else 2)
    head_dim = 32 if gemma else n_embd // n_head  # gemma3: key_length is not n_embd / n_head
    n_vocab = len(tokenizer_meta["tokenizer.ggml.tokens"])
    rng = np.random.default_rng(seed)

    w = GGUFWriter(str(path), architecture)
    w.add_name(f"tiny-{architecture}")
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head_kv)
    w.add_layer_norm_rms_eps(1e-6 if gemma else 1e-5)
    w.add_rope_freq_base(1_000_000.0 if gemma else 10_000.0)
    if gemma:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(sliding_window)
    else:
        w.add_vocab_size(n_vocab)
        w.add_rope_dimension_count(head_dim)
    if rope_scaling_factor is not None:
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(rope_scaling_factor)
    _add_tokenizer_meta(w, tokenizer_meta)

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        # (n_out, n_in): scaled so activations keep a unit-ish size through the layers
        return rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)

    def norm(n: int) -> np.ndarray:
        # (n,): near 1, as a trained norm weight (gemma's 1 + w is stored already added)
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    def add(name: str, array: np.ndarray, qtype: Q) -> None:
        if qtype == Q.F32:
            w.add_tensor(name, array.astype(np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, quantize(array, qtype), raw_dtype=qtype)

    add("token_embd.weight", rng.standard_normal((n_vocab, n_embd), dtype=np.float32), Q.Q8_0)
    add("output_norm.weight", norm(n_embd), Q.F32)
    if not gemma:
        add("output.weight", matrix(n_vocab, n_embd), Q.F16)
    for i in range(n_layer):
        b = f"blk.{i}."
        add(b + "attn_norm.weight", norm(n_embd), Q.F32)
        add(b + "attn_q.weight", matrix(n_head * head_dim, n_embd), Q.Q8_0)
        add(b + "attn_k.weight", matrix(n_head_kv * head_dim, n_embd), Q.Q4_0)
        add(b + "attn_v.weight", matrix(n_head_kv * head_dim, n_embd), Q.Q8_0)
        add(b + "attn_output.weight", matrix(n_embd, n_head * head_dim), Q.F16)
        if architecture == "qwen2":
            add(b + "attn_q.bias", 0.1 * rng.standard_normal(n_head * head_dim), Q.F32)
            add(b + "attn_k.bias", 0.1 * rng.standard_normal(n_head_kv * head_dim), Q.F32)
            add(b + "attn_v.bias", 0.1 * rng.standard_normal(n_head_kv * head_dim), Q.F32)
        if architecture in ("qwen3", "gemma3"):
            add(b + "attn_q_norm.weight", norm(head_dim), Q.F32)
            add(b + "attn_k_norm.weight", norm(head_dim), Q.F32)
        if gemma:
            add(b + "post_attention_norm.weight", norm(n_embd), Q.F32)
            add(b + "post_ffw_norm.weight", norm(n_embd), Q.F32)
        add(b + "ffn_norm.weight", norm(n_embd), Q.F32)
        add(b + "ffn_gate.weight", matrix(n_ff, n_embd), Q.Q4_0)
        add(b + "ffn_up.weight", matrix(n_ff, n_embd), Q.Q8_0)
        add(b + "ffn_down.weight", matrix(n_embd, n_ff), Q.F32)
    if rope_freq_factors is not None:
        add("rope_freqs.weight", np.asarray(rope_freq_factors, np.float32), Q.F32)

    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_architecture_only(path: str | Path, architecture: str) -> Path:
    """A GGUF that names `architecture` and holds one block count, nothing else: what a loader
    must refuse by its architecture."""
    w = GGUFWriter(str(path), architecture)
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def write_tiny_chat_model(path: str | Path, seed: int = 0) -> Path:
    """A tiny llama with SmolLM2's tokenizer and ChatML template: a fast stand-in for a chat model."""
    return write_tiny_model(path, "llama", seed=seed)


# A small WordPiece vocabulary in llama.cpp's GGUF spelling: a word-initial piece behind
# U+2581, a "##" continuation bare. Every letter both ways, so any lowercase ASCII word
# is spelled; a few whole words and suffixes, so that greedy longest-match matters.
BERT_SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BERT_WORDS = ("the", "cat", "sat", "on", "mat", "hello", "world", "embed", "dog", "run")
BERT_SUFFIXES = ("ing", "ed", "dings", "ding")


def bert_vocabulary() -> list[str]:
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)] + list("0123456789")
    return [*BERT_SPECIALS, *("\u2581" + c for c in letters + list(".,!?'-")), *letters,
            *("\u2581" + w for w in BERT_WORDS), *BERT_SUFFIXES]


def write_tiny_bert(path: str | Path, seed: int = 0, n_layer: int = 2, n_embd: int = 64, n_head: int = 4,
                    n_ff: int = 128, context_length: int = 64, pooling: int | None = 1,
                    architecture: str = "bert") -> Path:
    """A tiny random-weight BERT (llama.cpp's "bert" layout, a WordPiece vocabulary of
    `bert_vocabulary`) at `path`; `pooling` is its `<arch>.pooling_type` (1 mean, 2 cls, 3
    last; None: the key left out). `architecture` "nomic-bert" writes nomic-embed-text's
    layout instead, as llama.cpp's converter does: no position table but RoPE of base
    1000, Q/K/V fused, no biases, a SwiGLU feed-forward."""
    tokens = bert_vocabulary()
    rng = np.random.default_rng(seed)
    w = GGUFWriter(str(path), architecture)
    w.add_name(f"tiny-{architecture}")
    w.add_file_type(LlamaFileType.MOSTLY_Q8_0)
    w.add_context_length(context_length)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_layer_norm_eps(1e-12)
    w.add_causal_attention(False)
    if architecture == "nomic-bert":
        w.add_rope_freq_base(1000.0)  # nomic-embed-text's rotary_emb_base
    if pooling is not None:
        w.add_pooling_type(PoolingType(pooling))
    w.add_tokenizer_model("bert")
    w.add_token_list(tokens)
    w.add_token_types([3 if t in BERT_SPECIALS else 1 for t in tokens])
    w.add_token_type_count(2)
    w.add_unk_token_id(tokens.index("[UNK]"))
    w.add_bos_token_id(tokens.index("[CLS]"))  # (as llama.cpp's converter writes them)
    w.add_eos_token_id(tokens.index("[SEP]"))
    w.add_sep_token_id(tokens.index("[SEP]"))
    w.add_add_bos_token(True)
    w.add_add_sep_token(True)
    w.add_pad_token_id(tokens.index("[PAD]"))
    w.add_mask_token_id(tokens.index("[MASK]"))

    def add(name: str, array: np.ndarray, qtype: Q = Q.F32) -> None:
        if qtype == Q.F32:
            w.add_tensor(name, np.asarray(array, np.float32))
        elif qtype == Q.F16:
            w.add_tensor(name, array.astype(np.float16))
        else:
            w.add_tensor(name, quantize(array.astype(np.float32), qtype), raw_dtype=qtype)

    def matrix(n_out: int, n_in: int) -> np.ndarray:
        return rng.standard_normal((n_out, n_in), dtype=np.float32) / np.sqrt(n_in)

    def norm(name: str, n: int) -> None:
        add(name + ".weight", 1.0 + 0.1 * rng.standard_normal(n))
        add(name + ".bias", 0.1 * rng.standard_normal(n))

    def bert_block(b: str) -> None:
        for x, qtype in (("q", Q.Q8_0), ("k", Q.Q4_0), ("v", Q.Q8_0)):
            add(b + f"attn_{x}.weight", matrix(n_embd, n_embd), qtype)
            add(b + f"attn_{x}.bias", 0.1 * rng.standard_normal(n_embd))
        add(b + "attn_output.weight", matrix(n_embd, n_embd), Q.F16)
        add(b + "attn_output.bias", 0.1 * rng.standard_normal(n_embd))
        norm(b + "attn_output_norm", n_embd)
        add(b + "ffn_up.weight", matrix(n_ff, n_embd), Q.Q8_0)
        add(b + "ffn_up.bias", 0.1 * rng.standard_normal(n_ff))
        add(b + "ffn_down.weight", matrix(n_embd, n_ff), Q.Q4_0)
        add(b + "ffn_down.bias", 0.1 * rng.standard_normal(n_embd))
        norm(b + "layer_output_norm", n_embd)

    def nomic_bert_block(b: str) -> None:
        add(b + "attn_qkv.weight", matrix(3 * n_embd, n_embd), Q.Q8_0)
        add(b + "attn_output.weight", matrix(n_embd, n_embd), Q.F16)
        norm(b + "attn_output_norm", n_embd)
        add(b + "ffn_gate.weight", matrix(n_ff, n_embd), Q.Q4_0)
        add(b + "ffn_up.weight", matrix(n_ff, n_embd), Q.Q8_0)
        add(b + "ffn_down.weight", matrix(n_embd, n_ff), Q.Q4_0)
        norm(b + "layer_output_norm", n_embd)

    add("token_embd.weight", rng.standard_normal((len(tokens), n_embd), dtype=np.float32), Q.Q8_0)
    if architecture == "bert":
        add("position_embd.weight", 0.5 * rng.standard_normal((context_length, n_embd)), Q.F16)
    add("token_types.weight", 0.5 * rng.standard_normal((2, n_embd)))
    norm("token_embd_norm", n_embd)
    for i in range(n_layer):
        (bert_block if architecture == "bert" else nomic_bert_block)(f"blk.{i}.")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def _add_tokenizer_meta(w: GGUFWriter, meta: dict) -> None:
    """Copy `tokenizer.*` keys with the value types llama.cpp's converter uses."""
    for key, value in meta.items():
        if isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        elif isinstance(value, float):
            w.add_float32(key, value)
        elif isinstance(value, str):
            w.add_string(key, value)
        else:  # lists: strings, int32 token types, float32 scores (typed by their first element)
            w.add_array(key, list(value))
