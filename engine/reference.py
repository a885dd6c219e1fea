"""The model, written to be read: a plain float64 forward pass over a GGUF file.

This is the first engine file to read. It computes what the fast path
(engine/architectures.py, engine/quants.py) computes, the way a textbook would:
every weight dequantized by gguf-py (`gguf.quants.dequantize`, not the engine's
own unpacking) to float64, the whole sequence at once, attention as an explicit
masked softmax, one function per block. No tiles, threads, KV caches or batching,
so it is slow and memory-hungry, and obviously right: the tests hold the fast
path to it, and it settles who is off when the engine and llama.cpp disagree.

    reference_logits(model, ids) -> (len(ids), n_vocab) float64
    reference_hidden_states(model, ids) -> (len(ids), n_embd) float64: what embeddings pool

Shapes in comments: n = tokens, d = n_embd, hd = head dimension (of queries and
keys; hd_v of values), V = vocabulary. The architectures differ in small ways:

- llama: RMSNorm before attention and feed-forward, SwiGLU feed-forward, RoPE
  turning adjacent pairs of dimensions (2i, 2i+1): llama.cpp's converter permuted
  the Q/K rows of the Hugging Face checkpoint so that this is the right pairing.
- qwen2: llama plus biases on Q, K and V; RoPE "NEOX" pairs (i, i + rope_dim/2).
- qwen3: llama plus an RMSNorm of every query and key head; NEOX pairs.
- gemma3: embeddings scaled by sqrt(d); every sub-layer's output normalized too
  before it is added (four norms per block); QK-norm; GELU (tanh form) gating;
  five sliding-window layers (RoPE base 10k) then one global one; output tied to
  the embeddings. Gemma's norms compute x * (1 + w), and the GGUF stores 1 + w,
  so here they are plain RMSNorms.
- bert (an encoder: no LM head, its hidden states are the output): token,
  position and token-type-0 embeddings added and LayerNorm-ed; each block adds
  attention to its input and LayerNorms the sum, then the same with a GELU
  feed-forward; attention sees the whole sequence, both ways.
- nomic-bert (an encoder too): bert without the position embeddings, NEOX RoPE
  turning its queries and keys instead; one fused Q/K/V matrix, no biases, a
  SwiGLU feed-forward.
"""

from __future__ import annotations

import math

import numpy as np
from gguf.quants import dequantize


def reference_logits(model, ids) -> np.ndarray:
    """The logits (len(ids), n_vocab) float64 of every position of `ids`, in a fresh context.

    `model` is an `engine.load_model` model: its hyperparameters (`model.hp`, as read
    from the file's metadata) and its GGUF file (`model.file`) are all that is used.
    Each call dequantizes the weights again: no float64 copy outlives it (Gemma 3's
    would take 2 GB).
    """
    hp, tensors = model.hp, Tensors(model.file)
    x = reference_hidden_states(model, ids)                    # (n, d)
    embeddings = tensors("token_embd.weight")                  # (V, d)
    output = tensors("output.weight") if "output.weight" in tensors else embeddings  # (V, d): tied
    logits = x @ output.T                                      # (n, V)
    if hp.logit_softcap:
        logits = hp.logit_softcap * np.tanh(logits / hp.logit_softcap)
    return logits


def reference_hidden_states(model, ids) -> np.ndarray:
    """The final hidden states (len(ids), n_embd) float64 of `ids` in a fresh context: a
    decoder's after its output norm (what its LM head reads), an encoder's last block's output."""
    hp, tensors = model.hp, Tensors(model.file)
    if hp.architecture in ENCODER_BLOCKS:
        return encoder_hidden_states(np.asarray(ids, np.int64), tensors, hp)
    if hp.architecture not in BLOCKS:
        raise ValueError(f"no reference forward for architecture {hp.architecture!r}")
    ids = np.asarray(ids, np.int64)                            # (n,)
    x = tensors("token_embd.weight")[ids]                      # (n, d)
    if hp.architecture == "gemma3":
        x = x * math.sqrt(hp.n_embd)
    for layer in range(hp.n_layer):
        x = BLOCKS[hp.architecture](x, Tensors(model.file, f"blk.{layer}."), hp, layer)  # (n, d)
    return rms_norm(x, tensors("output_norm.weight"), hp.norm_eps)  # (n, d)


class Tensors:
    """The tensors of a GGUF file named `prefix` + name, dequantized to float64 when asked for."""

    def __init__(self, file, prefix: str = ""):
        self.file, self.prefix = file, prefix

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.file.tensors

    def __call__(self, name: str) -> np.ndarray:
        t = self.file.tensors[self.prefix + name]
        return dequantize(t.data, t.type).astype(np.float64).reshape(t.shape)  # (out, in) or (k,)


def llama_block(x: np.ndarray, w: Tensors, hp, layer: int) -> np.ndarray:
    """x + attention(norm(x)), then + feed_forward(norm(x)): llama, qwen2, qwen3."""
    x = x + attention(rms_norm(x, w("attn_norm.weight"), hp.norm_eps), w, hp, layer)  # (n, d)
    h = rms_norm(x, w("ffn_norm.weight"), hp.norm_eps)                               # (n, d)
    gate, up = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T                  # (n, n_ff) each
    return x + (silu(gate) * up) @ w("ffn_down.weight").T                            # (n, d)


def gemma3_block(x: np.ndarray, w: Tensors, hp, layer: int) -> np.ndarray:
    """As llama's, but each sub-layer's output is normalized too, and the gate is GELU."""
    h = attention(rms_norm(x, w("attn_norm.weight"), hp.norm_eps), w, hp, layer)     # (n, d)
    x = x + rms_norm(h, w("post_attention_norm.weight"), hp.norm_eps)                # (n, d)
    h = rms_norm(x, w("ffn_norm.weight"), hp.norm_eps)                               # (n, d)
    gate, up = h @ w("ffn_gate.weight").T, h @ w("ffn_up.weight").T                  # (n, n_ff) each
    h = (gelu_tanh(gate) * up) @ w("ffn_down.weight").T                              # (n, d)
    return x + rms_norm(h, w("post_ffw_norm.weight"), hp.norm_eps)                   # (n, d)


BLOCKS = {"llama": llama_block, "qwen2": llama_block, "qwen3": llama_block, "gemma3": gemma3_block}


def encoder_hidden_states(ids: np.ndarray, tensors: Tensors, hp) -> np.ndarray:
    """An encoder's output (n, d) for token ids (n,) from position 0, every token of type 0."""
    x = tensors("token_embd.weight")[ids]                      # (n, d)
    if hp.architecture == "bert":                              # (nomic-bert rotates Q and K instead)
        x = x + tensors("position_embd.weight")[np.arange(len(ids))]
    if "token_types.weight" in tensors:
        x = x + tensors("token_types.weight")[0]
    x = layer_norm(x, tensors("token_embd_norm.weight"), tensors("token_embd_norm.bias"), hp.norm_eps)
    for layer in range(hp.n_layer):
        x = ENCODER_BLOCKS[hp.architecture](x, Tensors(tensors.file, f"blk.{layer}."), hp)  # (n, d)
    return x


def bert_block(x: np.ndarray, w: Tensors, hp) -> np.ndarray:
    """norm(x + attention(x)), then norm(x + feed_forward(x)), GELU, biases everywhere."""
    n = x.shape[0]
    q, k, v = ((x @ w(f"attn_{c}.weight").T + w(f"attn_{c}.bias")).reshape(n, hp.n_head, -1) for c in "qkv")
    h = both_ways_attention(q, k, v) @ w("attn_output.weight").T + w("attn_output.bias")  # (n, d)
    x = layer_norm(x + h, w("attn_output_norm.weight"), w("attn_output_norm.bias"), hp.norm_eps)
    h = gelu_tanh(x @ w("ffn_up.weight").T + w("ffn_up.bias")) @ w("ffn_down.weight").T + w("ffn_down.bias")
    return layer_norm(x + h, w("layer_output_norm.weight"), w("layer_output_norm.bias"), hp.norm_eps)


def nomic_bert_block(x: np.ndarray, w: Tensors, hp) -> np.ndarray:
    """As bert's, but Q and K rotated (NEOX), no biases, and a SwiGLU feed-forward."""
    n = x.shape[0]
    q, k, v = np.split(x @ w("attn_qkv.weight").T, 3, axis=1)  # (n, d) each
    q, k = (rope(t.reshape(n, hp.n_head, -1), hp, local=False) for t in (q, k))  # (n, n_head, hd) each
    h = both_ways_attention(q, k, v.reshape(n, hp.n_head, -1)) @ w("attn_output.weight").T  # (n, d)
    x = layer_norm(x + h, w("attn_output_norm.weight"), w("attn_output_norm.bias"), hp.norm_eps)
    h = (silu(x @ w("ffn_gate.weight").T) * (x @ w("ffn_up.weight").T)) @ w("ffn_down.weight").T  # (n, d)
    return layer_norm(x + h, w("layer_output_norm.weight"), w("layer_output_norm.bias"), hp.norm_eps)


ENCODER_BLOCKS = {"bert": bert_block, "nomic-bert": nomic_bert_block}


def both_ways_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
    """Multi-head attention of the whole sequence, every query seeing every key:
    q, k, v (n, n_head, hd) -> (n, n_head*hd)."""
    n, _, hd = q.shape
    scores = np.einsum("ihc,jhc->hij", q, k) / math.sqrt(hd)   # (n_head, n, n): query i, key j
    return np.einsum("hij,jhc->ihc", softmax(scores), v).reshape(n, -1)  # (n, n_head*hd)


def attention(h: np.ndarray, w: Tensors, hp, layer: int) -> np.ndarray:
    """Causal grouped-query self-attention of the whole sequence h (n, d) -> (n, d)."""
    n, hd = h.shape[0], hp.head_dim
    q = h @ w("attn_q.weight").T                               # (n, n_head*hd)
    k = h @ w("attn_k.weight").T                               # (n, n_head_kv*hd)
    v = h @ w("attn_v.weight").T                               # (n, n_head_kv*hd_v)
    if "attn_q.bias" in w:                                     # qwen2
        q, k, v = q + w("attn_q.bias"), k + w("attn_k.bias"), v + w("attn_v.bias")
    q = q.reshape(n, hp.n_head, hd)                            # (n, n_head, hd)
    k = k.reshape(n, hp.n_head_kv, hd)                         # (n, n_head_kv, hd)
    v = v.reshape(n, hp.n_head_kv, hp.head_dim_v)              # (n, n_head_kv, hd_v)
    if "attn_q_norm.weight" in w:                              # qwen3, gemma3: each head normalized
        q = rms_norm(q, w("attn_q_norm.weight"), hp.norm_eps)
        k = rms_norm(k, w("attn_k_norm.weight"), hp.norm_eps)
    local = hp.architecture == "gemma3" and hp.sliding_window > 0 and layer % 6 < 5
    q, k = rope(q, hp, local), rope(k, hp, local)
    out = causal_attention(q, k, v, hp.sliding_window if local else 0)  # (n, n_head, hd_v)
    return out.reshape(n, -1) @ w("attn_output.weight").T      # (n, d)


def causal_attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, window: int = 0) -> np.ndarray:
    """softmax(q k^T / sqrt(hd) + mask) v, head by head, of a sequence's positions 0..n-1.

    q (n, n_head, hd), k (n, n_head_kv, hd), v (n, n_head_kv, hd_v) -> (n, n_head, hd_v).
    Query head i reads key/value head i // (n_head / n_head_kv) (grouped-query
    attention). The query at position i sees the keys at j <= i, and with a sliding
    `window` only those with i - j < window.
    """
    n, n_head, hd = q.shape
    group = n_head // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)  # (n, n_head, hd), (n, n_head, hd_v)
    scores = np.einsum("ihc,jhc->hij", q, k) / math.sqrt(hd)   # (n_head, n, n): query i, key j
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    hidden = j > i                                             # (n, n): no query sees a later key
    if window:
        hidden |= i - j >= window
    scores[:, hidden] = -np.inf
    return np.einsum("hij,jhc->ihc", softmax(scores), v)       # (n, n_head, hd_v)


def rope(x: np.ndarray, hp, local: bool) -> np.ndarray:
    """Rotary position embedding of x (n, heads, hd): the token at position p turns
    each pair of dimensions (a, b) of the first rope_dim by the angle p * theta_i,
    theta_i = base^(-2i/rope_dim). The other dimensions pass through.

    The pairs are (2i, 2i+1) for llama, (i, i + rope_dim/2) for NEOX-style models.
    Global layers may scale positions (linear RoPE scaling) and divide theta_i by
    per-frequency factors (Llama 3.1's rope_freqs); sliding-window layers (gemma3)
    use their own base and neither.
    """
    half = hp.rope_dim // 2
    base = hp.rope_base_local if local else hp.rope_base
    theta = base ** (-2.0 * np.arange(half) / hp.rope_dim)    # (half,)
    scale = 1.0
    if not local:
        scale = hp.rope_scale
        if hp.rope_freq_factors is not None:
            theta = theta / np.asarray(hp.rope_freq_factors)
    angles = scale * np.arange(x.shape[0])[:, None] * theta   # (n, half)
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]  # (n, 1, half)
    if hp.architecture == "llama":
        first, second = np.arange(0, hp.rope_dim, 2), np.arange(1, hp.rope_dim, 2)  # (half,) each
    else:
        first, second = np.arange(half), np.arange(half, hp.rope_dim)
    a, b = x[..., first], x[..., second]                       # (n, heads, half) each
    out = x.copy()
    out[..., first] = a * cos - b * sin
    out[..., second] = a * sin + b * cos
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float) -> np.ndarray:
    """x / sqrt(mean(x^2) + eps) * weight over the last axis; x (..., k), weight (k,)."""
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * weight


def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float) -> np.ndarray:
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last axis."""
    centered = x - x.mean(axis=-1, keepdims=True)
    return centered / np.sqrt((centered * centered).mean(axis=-1, keepdims=True) + eps) * weight + bias


def softmax(x: np.ndarray) -> np.ndarray:
    """Over the last axis; -inf entries get weight 0."""
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def silu(x: np.ndarray) -> np.ndarray:
    """x * sigmoid(x), with sigmoid(x) = (1 + tanh(x/2)) / 2 (no exp to overflow)."""
    return 0.5 * x * (1.0 + np.tanh(0.5 * x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU in its tanh approximation, as gemma and llama.cpp compute it."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))
