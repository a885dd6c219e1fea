"""Forward passes: tokens in, logits out, one function per transformer block.

A forward step takes the pending tokens of one or more sequences as one batch:
every matmul runs on all their tokens at once (that is where BLAS earns its
keep), and attention runs per sequence over that sequence's own KV cache,
causal within the new chunk. Shapes in comments: n = tokens in the batch,
d = n_embd, T = tokens of one sequence in this step, L = its cached length
after the step, hd = head dimension, V = vocabulary.

The architectures differ in small, named ways (see `Hyperparameters`):
- llama (SmolLM2, Llama 3, Mistral, TinyLlama): RMSNorm, RoPE "NORM" style
  (llama.cpp's converter permutes the Q/K rows so rotated pairs are adjacent),
  SwiGLU feed-forward.
- qwen2: llama plus Q/K/V biases, RoPE "NEOX" style (pairs i, i + hd/2).
- qwen3: llama with an RMSNorm of each Q and K head, NEOX RoPE.
  A NEOX model's Q/K rows are reordered at load (`neox_pairs_order`) so that its
  pairs are adjacent too: every architecture runs the same `rope_pairs`.
- gemma3: embeddings scaled by sqrt(d); four norms per block (the GGUF stores
  gemma's 1 + w, so they are plain RMSNorms); QK-norm; GELU-tanh gated
  feed-forward; five sliding-window layers with RoPE base 10k then one global
  layer; attention scale 1/sqrt(key_length); output tied to the embeddings.

Two encoders, which have no LM head and only embed (engine/embed.py):
- bert (bge, all-MiniLM, ...): token + learned position (+ token type 0)
  embeddings, LayerNorm (with bias); post-norm blocks (each sub-layer's sum with
  its input is normalized), biases everywhere, a GELU feed-forward; attention
  over all of a sequence's tokens, no causal mask, so no KV cache: every sequence
  of a batch runs whole (`bert_hidden_states`).
- nomic-bert (nomic-embed-text): bert without learned positions, which rotates
  its queries and keys instead (NEOX RoPE, reordered at load like a decoder's);
  Q, K, V fused in the file, no biases, a SwiGLU feed-forward (`nomic_bert_block`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from . import tuning
from .kv_cache import Sequence


@dataclass(frozen=True)
class Hyperparameters:
    architecture: str
    n_vocab: int
    n_embd: int
    n_layer: int
    n_head: int
    n_head_kv: int
    head_dim: int            # of queries and keys
    head_dim_v: int          # of values
    n_ff: int
    norm_eps: float
    context_length: int      # trained window
    rope_dim: int            # leading dimensions of each head that RoPE rotates
    rope_base: float
    rope_base_local: float   # sliding-window layers (gemma3)
    rope_neox: bool          # the file pairs (i, i + rope_dim/2), not (2i, 2i+1): reordered at load
    rope_scale: float        # linear RoPE scaling of the global layers: positions × 1/factor
    rope_freq_factors: tuple[float, ...] | None  # (rope_dim/2,) divisors of the frequencies (Llama 3.1+)
    sliding_window: int      # 0: none
    local_layers: tuple[bool, ...]  # per layer: uses the sliding window
    attention_scale: float
    embedding_scale: float
    logit_softcap: float = 0.0  # logits = cap * tanh(logits / cap) when > 0
    causal: bool = True         # False: an encoder (bert, nomic-bert), which attends both ways and only embeds
    pooling: str | None = None  # `<arch>.pooling_type` as engine/embed.py names it ("mean", "cls", "last"), if any


@dataclass
class Block:
    """The weights of one transformer block. Matrices are engine.quants Weights (quantized)."""

    attn_norm: np.ndarray            # (d,)
    qkv: Any                         # Weight (n_head*hd + 2*n_head_kv*hd, d): Q, K, V merged
                                     # (NEOX models: Q, K and their biases and norms reordered at load)
    qkv_bias: np.ndarray | None      # (n_head*hd + 2*n_head_kv*hd,) qwen2
    qk_norm: np.ndarray | None       # (n_head + n_head_kv, hd) qwen3, gemma3: the file's q_norm
                                     # repeated for each query head, then its k_norm for each key head
    attn_output: Any                 # Weight (d, n_head*hd_v)
    post_attention_norm: np.ndarray | None  # (d,) gemma3
    ffn_norm: np.ndarray             # (d,)
    gate_up: Any                     # Weight (2*n_ff, d): gate then up, merged
    ffn_down: Any                    # Weight (d, n_ff)
    post_ffw_norm: np.ndarray | None  # (d,) gemma3


@dataclass
class Weights:
    token_embd: Any                  # Weight (V, d)
    blocks: list[Block]
    output_norm: np.ndarray          # (d,)
    output: Any                      # Weight (V, d), token_embd itself when tied


@dataclass
class BertBlock:
    """The weights of one BERT block. LayerNorms are (weight, bias) pairs of (d,) each."""

    qkv: Any                         # Weight (3d, d): Q, K, V merged
    qkv_bias: np.ndarray             # (3d,)
    attn_output: Any                 # Weight (d, d)
    attn_output_bias: np.ndarray     # (d,)
    attn_output_norm: tuple[np.ndarray, np.ndarray]
    ffn_up: Any                      # Weight (n_ff, d)
    ffn_up_bias: np.ndarray          # (n_ff,)
    ffn_down: Any                    # Weight (d, n_ff)
    ffn_down_bias: np.ndarray        # (d,)
    layer_output_norm: tuple[np.ndarray, np.ndarray]


@dataclass
class NomicBertBlock:
    """The weights of one nomic-bert block: no biases (llama.cpp's converter asserts none)."""

    qkv: Any                         # Weight (3d, d): Q, K, V, fused in the file; Q and K rows reordered
                                     # at load (`neox_pairs_order`)
    attn_output: Any                 # Weight (d, d)
    attn_output_norm: tuple[np.ndarray, np.ndarray]
    gate_up: Any                     # Weight (2*n_ff, d): gate then up, merged
    ffn_down: Any                    # Weight (d, n_ff)
    layer_output_norm: tuple[np.ndarray, np.ndarray]


@dataclass
class BertWeights:
    """An encoder's weights: bert's, or nomic-bert's (no position table, its own blocks)."""

    token_embd: Any                  # Weight (V, d)
    position_embd: np.ndarray | None  # (trained context, d) float32; None: nomic-bert, which rotates instead
    token_type: np.ndarray | None    # (d,) the embedding of token type 0, which every token is
    token_embd_norm: tuple[np.ndarray, np.ndarray]
    blocks: list[BertBlock] | list[NomicBertBlock]


@dataclass
class Batch:
    """The tokens one forward step feeds: sequences[i] contributes rows spans[i] of the batch."""

    sequences: list[Sequence]
    starts: list[int]                # first new position of each sequence (its cached length)
    spans: list[slice]               # rows of each sequence in the batch
    tokens: np.ndarray               # (n,) token ids
    positions: np.ndarray            # (n,) position of each token in its sequence
    wanted: list[int] | None = None  # logit rows of each sequence: its last k tokens' (None: 1 each)
    rope_cache: dict = field(default_factory=dict)  # local/global -> turns, shared by the layers

    @property
    def output_spans(self) -> list[slice]:
        """The rows of each sequence whose logits are wanted: its last one, or its last k."""
        wanted = self.wanted or [1] * len(self.spans)
        return [slice(span.stop - k, span.stop) for span, k in zip(self.spans, wanted)]

    @property
    def output_rows(self) -> list[int]:
        """The rows of `output_spans`, in order."""
        return [row for span in self.output_spans for row in range(span.start, span.stop)]

    def subset(self, indices: list[int]) -> Batch:
        """The batch of the sequences at `indices` alone, in that order."""
        rows = np.concatenate([np.arange(self.spans[i].start, self.spans[i].stop) for i in indices])
        bounds = np.cumsum([0] + [self.spans[i].stop - self.spans[i].start for i in indices])
        return Batch([self.sequences[i] for i in indices], [self.starts[i] for i in indices],
                     [slice(int(a), int(b)) for a, b in zip(bounds, bounds[1:])],
                     self.tokens[rows], self.positions[rows],
                     None if self.wanted is None else [self.wanted[i] for i in indices])

    def rope_turns(self, hp: Hyperparameters, local: bool) -> np.ndarray:
        """e^(i angle) (n, rope_dim/2) complex64 of this batch's positions, computed once per step."""
        if local not in self.rope_cache:
            if local:  # sliding-window layers: their own base, no scaling
                cos, sin = rope_angles(self.positions, hp.rope_dim, hp.rope_base_local)
            else:
                cos, sin = rope_angles(self.positions, hp.rope_dim, hp.rope_base, hp.rope_scale,
                                       hp.rope_freq_factors)
            turns = np.empty(cos.shape, np.complex64)
            turns.real, turns.imag = cos, sin
            self.rope_cache[local] = turns
        return self.rope_cache[local]


def make_batch(sequences: list[Sequence], max_tokens_each: int, wanted: list[int] | None = None) -> Batch:
    """Take up to max_tokens_each pending tokens of every sequence; `wanted`: how many of
    each one's last tokens need logits (None: its last one)."""
    starts, spans, tokens, positions, row = [], [], [], [], 0
    for seq in sequences:
        start = seq.cache.length
        new = seq.tokens[start: start + max_tokens_each]
        if not new:
            raise ValueError("a sequence in the batch has no pending token")
        starts.append(start)
        spans.append(slice(row, row + len(new)))
        tokens.extend(new)
        positions.extend(range(start, start + len(new)))
        row += len(new)
    if wanted is not None:
        wanted = [max(1, min(k, span.stop - span.start)) for k, span in zip(wanted, spans)]
    return Batch(sequences, starts, spans, np.asarray(tokens, np.int64), np.asarray(positions, np.int64),
                 wanted)


class StepAbandoned(Exception):
    """A forward step stopped between two layers: nobody wants its logits any more."""


def forward(hp: Hyperparameters, w: Weights, batch: Batch, all_logits: bool = False,
            abandon: Callable[[], bool] | None = None) -> list[np.ndarray]:
    """Run the batch through the model and advance every sequence's cache.

    Returns, per sequence, the logits (T, V) of all its new tokens when
    `all_logits`, else (k, V) of its last k new tokens (`batch.wanted`; by default
    k = 1, what sampling needs; a speculative draft's verification wants them all).
    `abandon()`, asked before each layer after the first, true: the step raises
    StepAbandoned there, every cache as it was (the keys and values the layers run
    so far stored lie past its length, which only a finished step advances).
    """
    x = hidden_states(hp, w, batch, all_rows=all_logits, abandon=abandon)  # (n or m, d)
    return per_sequence(batch, lm_head(hp, w, x), all_logits)


def per_sequence(batch: Batch, rows: np.ndarray, all_rows: bool = False) -> list[np.ndarray]:
    """Rows (n or m, ...) of a batch cut per sequence: every token's with all_rows, else
    (m rows) those of `batch.output_spans`."""
    if all_rows:
        return [rows[span] for span in batch.spans]
    out, row = [], 0
    for span in batch.output_spans:
        out.append(rows[row: row + span.stop - span.start])
        row += span.stop - span.start
    return out


def lm_head(hp: Hyperparameters, w: Weights, x: np.ndarray) -> np.ndarray:
    """The logits (n, V) of final hidden states x (n, d)."""
    logits = w.output.matmul(x)                                # (n, V)
    if hp.logit_softcap:
        logits = np.tanh(logits / np.float32(hp.logit_softcap)) * np.float32(hp.logit_softcap)
    return logits


def hidden_states(hp: Hyperparameters, w: Weights, batch: Batch, all_rows: bool = True,
                  abandon: Callable[[], bool] | None = None) -> np.ndarray:
    """The batch's final hidden states, after the output norm (what the LM head reads and
    what embeddings pool, llama.cpp's `t_embd`), and every sequence's cache advanced.

    (n, d): a row per token with `all_rows`, else (m, d) the rows of `batch.output_rows`.
    """
    for seq, span, start in zip(batch.sequences, batch.spans, batch.starts):
        seq.cache.reserve(start + span.stop - span.start)
    block = BLOCKS[hp.architecture]
    x = w.token_embd.rows(batch.tokens)                        # (n, d)
    if hp.embedding_scale != 1.0:
        x = x * np.float32(hp.embedding_scale)                 # (n, d)
    for layer, blk in enumerate(w.blocks[:-1]):
        x = block(x, blk, hp, batch, layer)                    # (n, d)
        if abandon is not None and abandon():
            raise StepAbandoned()
    # Of the last block's output only the rows of the wanted logits are read, so (as in
    # llama.cpp) it computes every token's keys and values, which the cache keeps, and
    # the rest for those rows only: one block's attention and feed-forward less, bar a row.
    x = block(x, w.blocks[-1], hp, batch, hp.n_layer - 1, all_rows=all_rows)  # (n or m, d)
    for seq, span in zip(batch.sequences, batch.spans):
        seq.cache.length += span.stop - span.start
    return rms_norm(x, w.output_norm, hp.norm_eps)             # (n or m, d)


def llama_block(x: np.ndarray, blk: Block, hp: Hyperparameters, batch: Batch, layer: int,
                all_rows: bool = True) -> np.ndarray:
    """Pre-norm attention and SwiGLU feed-forward, each added to the residual (llama, qwen2, qwen3).

    With `all_rows` False, the output has only the rows whose logits are wanted (m of them).
    """
    h = rms_norm(x, blk.attn_norm, hp.norm_eps)                # (n, d)
    if not all_rows:
        x = x[batch.output_rows]                               # (m, d): the wanted rows from here
    x = x + attention(h, blk, hp, batch, layer, all_rows)      # (m, d)
    h = rms_norm(x, blk.ffn_norm, hp.norm_eps)                 # (m, d)
    gate, up = split_gate_up(blk.gate_up.matmul(h))           # (m, n_ff) each
    h = swiglu(gate, up)                                       # (m, n_ff)
    return x + blk.ffn_down.matmul(h)                          # (m, d)


def gemma3_block(x: np.ndarray, blk: Block, hp: Hyperparameters, batch: Batch, layer: int,
                 all_rows: bool = True) -> np.ndarray:
    """Sandwich norms: each sub-layer's input and output are normalized before the residual add.

    With `all_rows` False, the output has only the rows whose logits are wanted (m of them).
    """
    h = rms_norm(x, blk.attn_norm, hp.norm_eps)                # (n, d)
    h = attention(h, blk, hp, batch, layer, all_rows)          # (m, d): m = n, or the wanted rows
    if not all_rows:
        x = x[batch.output_rows]                               # (m, d)
    x = x + rms_norm(h, blk.post_attention_norm, hp.norm_eps)  # (m, d)
    h = rms_norm(x, blk.ffn_norm, hp.norm_eps)                 # (m, d)
    gate, up = split_gate_up(blk.gate_up.matmul(h))           # (m, n_ff) each
    h = geglu(gate, up)                                        # (m, n_ff)
    h = blk.ffn_down.matmul(h)                                 # (m, d)
    return x + rms_norm(h, blk.post_ffw_norm, hp.norm_eps)     # (m, d)


BLOCKS = {"llama": llama_block, "qwen2": llama_block, "qwen3": llama_block, "gemma3": gemma3_block}


def whole_sequences(token_lists: list[list[int]]) -> Batch:
    """A batch of whole sequences from position 0, with no cache (an encoder's)."""
    spans, row = [], 0
    for ids in token_lists:
        spans.append(slice(row, row + len(ids)))
        row += len(ids)
    return Batch([], [0] * len(token_lists), spans, np.asarray([i for ids in token_lists for i in ids], np.int64),
                 np.asarray([p for ids in token_lists for p in range(len(ids))], np.int64))


def bert_hidden_states(hp: Hyperparameters, w: BertWeights, batch: Batch) -> np.ndarray:
    """An encoder's final hidden states (n, d) of a `whole_sequences` batch (llama.cpp's
    build_bert, which runs bert and nomic-bert): the last block's output, which its own
    LayerNorm ends."""
    x = w.token_embd.rows(batch.tokens)                        # (n, d)
    if w.position_embd is not None:
        x += w.position_embd[batch.positions]
    if w.token_type is not None:
        x += w.token_type
    x = layer_norm(x, *w.token_embd_norm, hp.norm_eps)         # (n, d)
    block = ENCODER_BLOCKS[hp.architecture]
    for blk in w.blocks:
        x = block(x, blk, hp, batch)                           # (n, d)
    return x


def bert_block(x: np.ndarray, blk: BertBlock, hp: Hyperparameters, batch: Batch) -> np.ndarray:
    """Attention, added to the input and normalized; then a GELU feed-forward, the same."""
    n, d, hd = x.shape[0], hp.n_embd, hp.head_dim
    qkv = blk.qkv.matmul(x)                                    # (n, 3d)
    qkv += blk.qkv_bias
    q, k, v = (qkv[:, i * d: (i + 1) * d].reshape(n, hp.n_head, hd) for i in range(3))  # (n, n_head, hd) each
    h = blk.attn_output.matmul(attend_each_sequence(q, k, v, hp, batch))  # (n, d)
    h += blk.attn_output_bias
    h += x
    x = layer_norm(h, *blk.attn_output_norm, hp.norm_eps)      # (n, d)
    h = blk.ffn_up.matmul(x)                                   # (n, n_ff)
    h += blk.ffn_up_bias
    h = blk.ffn_down.matmul(gelu(h))                           # (n, d)
    h += blk.ffn_down_bias
    h += x
    return layer_norm(h, *blk.layer_output_norm, hp.norm_eps)  # (n, d)


def nomic_bert_block(x: np.ndarray, blk: NomicBertBlock, hp: Hyperparameters, batch: Batch) -> np.ndarray:
    """bert_block with rotated queries and keys, no biases and a SwiGLU feed-forward."""
    n, d = x.shape[0], hp.n_embd
    qkv = blk.qkv.matmul(x)                                    # (n, 3d)
    qk = qkv[:, : 2 * d].reshape(n, 2 * hp.n_head, hp.head_dim)  # (n, 2*n_head, hd): queries, then keys
    qk = rope_pairs(qk, batch.rope_turns(hp, local=False))     # both rotated in one call
    q, k = qk[:, : hp.n_head], qk[:, hp.n_head:]               # (n, n_head, hd) each
    v = qkv[:, 2 * d:].reshape(n, hp.n_head, hp.head_dim)      # (n, n_head, hd)
    h = blk.attn_output.matmul(attend_each_sequence(q, k, v, hp, batch))  # (n, d)
    h += x
    x = layer_norm(h, *blk.attn_output_norm, hp.norm_eps)      # (n, d)
    gate, up = split_gate_up(blk.gate_up.matmul(x))           # (n, n_ff) each
    h = blk.ffn_down.matmul(swiglu(gate, up))                  # (n, d)
    h += x
    return layer_norm(h, *blk.layer_output_norm, hp.norm_eps)  # (n, d)


ENCODER_BLOCKS = {"bert": bert_block, "nomic-bert": nomic_bert_block}


def attend_each_sequence(q: np.ndarray, k: np.ndarray, v: np.ndarray, hp: Hyperparameters,
                         batch: Batch) -> np.ndarray:
    """An encoder's attention, each sequence of the batch over all of its own tokens:
    q, k, v (n, n_head, hd) -> (n, n_head*hd)."""
    return np.concatenate([attend_both_ways(q[span], k[span], v[span], hp.attention_scale)
                           for span in batch.spans])


def attend_both_ways(q: np.ndarray, k: np.ndarray, v: np.ndarray, scale: float) -> np.ndarray:
    """Softmax attention of one sequence's queries over all of its keys (no mask):
    q, k, v (T, n_head, hd) -> (T, n_head*hd)."""
    T, n_head, hd = q.shape
    q = (q * np.float32(scale)).transpose(1, 0, 2)             # (n_head, T, hd)
    scores = q @ k.transpose(1, 2, 0)                          # (n_head, T, T)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores, out=scores)
    weights /= weights.sum(axis=-1, keepdims=True)
    return (weights @ v.transpose(1, 0, 2)).transpose(1, 0, 2).reshape(T, n_head * hd)  # (T, n_head*hd)


def attention(h: np.ndarray, blk: Block, hp: Hyperparameters, batch: Batch, layer: int,
              all_rows: bool = True) -> np.ndarray:
    """Multi-head (grouped-query) self-attention of the batch; stores the new K/V in each cache.

    Every token's keys and values are stored; the output has a row per token, or with
    `all_rows` False only the wanted ones, each sequence's last k (its other queries are
    not computed).
    """
    n = h.shape[0]
    n_q, n_k = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim
    qkv = blk.qkv.matmul(h)                                    # (n, n_q + n_k + n_kv*hd_v)
    if blk.qkv_bias is not None:
        qkv += blk.qkv_bias
    # queries and keys are normalized and rotated together: one call each instead of two
    qk = qkv[:, : n_q + n_k].reshape(n, hp.n_head + hp.n_head_kv, hp.head_dim)  # (n, n_head + n_head_kv, hd)
    v = qkv[:, n_q + n_k:].reshape(n, hp.n_head_kv, hp.head_dim_v)        # (n, n_head_kv, hd_v)
    if blk.qk_norm is not None:
        qk = rms_norm(qk, blk.qk_norm, hp.norm_eps)            # (n, n_head + n_head_kv, hd)
    local = hp.local_layers[layer]
    qk = rope_pairs(qk, batch.rope_turns(hp, local))          # (n, n_head + n_head_kv, hd)
    q, k = qk[:, : hp.n_head], qk[:, hp.n_head:]               # (n, n_head, hd), (n, n_head_kv, hd)
    window = hp.sliding_window if local else 0

    # the queries attended: every token's, or each sequence's last k
    queries = batch.spans if all_rows else batch.output_spans
    caches = []
    for seq, span, start in zip(batch.sequences, batch.spans, batch.starts):
        seq.cache.store(layer, start, k[span], v[span])
        caches.append(seq.cache.view(layer, span.stop - span.start + start))  # (n_head_kv, L, hd) each
    if len(queries) > 1 and all(rows.stop - rows.start == 1 for rows in queries):  # decoding a batch
        rows = [rows.start for rows in queries]
        out = attend_one_each(q[rows], caches, batch.positions[rows], window, hp.attention_scale)
    else:
        out = np.concatenate([attend(q[rows], keys, values, batch.positions[rows], window, hp.attention_scale)
                              for rows, (keys, values) in zip(queries, caches)])  # (m, n_head*hd_v)
    return blk.attn_output.matmul(out)                         # (m, d)


# The work between the matmuls: attention's query blocks and the position-wise ops of a
# long chunk cut theirs into ranges and run them as `parallel_for(fn, n_items, n_values)`,
# fn(i0, i1) over ranges covering [0, n_items) that stand for n_values values of work.
# The plain engine runs it all on the calling thread; the acceleration layer on top, when
# it gives a model threads, shares it out over them instead (engine/accel `install`).


def on_this_thread(fn: Callable[[int, int], None], n_items: int, n_values: int) -> None:
    """The plain engine's parallel_for: all the work at once, on the calling thread."""
    fn(0, n_items)


parallel_for = on_this_thread


def share_work_with(runner: Callable[[Callable[[int, int], None], int, int], None]) -> None:
    """Run the work between the matmuls with `runner` (a parallel_for) from now on."""
    global parallel_for
    parallel_for = runner


@functools.lru_cache(maxsize=tuning.CAUSAL_MASKS)
def causal_mask(T: int) -> np.ndarray:
    """(T, T) float32: 0 where key j <= query i, -inf above the diagonal (shared: read-only)."""
    mask = np.triu(np.full((T, T), -np.inf, np.float32), k=1)
    mask.flags.writeable = False
    return mask


def attend(q: np.ndarray, keys: np.ndarray, values: np.ndarray, positions: np.ndarray,
           window: int, scale: float) -> np.ndarray:
    """Softmax attention of one sequence's new queries over its cached keys/values.

    Query head h reads key/value head h // (n_head / n_head_kv), as in llama.cpp.
    A query at position p sees keys at positions j <= p, and with a sliding
    window only those with p - j < window. `positions` ascend by one (a chunk of
    one sequence), so a block of queries needs only the keys from its first
    visible position to its last query: long chunks go block by block (the blocks
    shared out over the threads), which skips most of the masked half of a causal
    prefill, and only a block's last T keys, its own positions, need the causal mask.
    """
    T, n_head, hd = q.shape                                    # q: (T, n_head, hd)
    n_kv, _, hd_v = values.shape                               # keys: (n_kv, L, hd), values: (n_kv, L, hd_v)
    block = tuning.ATTENTION_BLOCK                             # queries per block of a long chunk
    if T > block:  # blocks of queries, shared out over the threads
        out = np.empty((T, n_head * hd_v), np.float32)         # (T, n_head*hd_v)
        n_blocks = -(-T // block)

        def blocks(b0: int, b1: int) -> None:
            for b in range(b0, b1):  # last block first: the later the queries, the more keys they read
                i = (n_blocks - 1 - b) * block
                j = min(i + block, T)
                out[i:j] = attend(q[i:j], keys, values, positions[i:j], window, scale)

        parallel_for(blocks, n_blocks, T * keys.shape[1] * n_head * hd)
        return out
    group = n_head // n_kv
    first = max(0, int(positions[0]) - window + 1) if window else 0  # no query sees keys before this
    last = int(positions[-1]) + 1                                    # nor keys after the last query
    keys, values = keys[:, first:last], values[:, first:last]  # (n_kv, L', hd), (n_kv, L', hd_v)
    q = (q * np.float32(scale)).transpose(1, 0, 2).reshape(n_kv, group * T, hd)  # (n_kv, group*T, hd)
    if T == 1:
        scores = np.ascontiguousarray(one_query_scores(q, keys)).reshape(n_kv, group, 1, -1)  # (n_kv, group, 1, L')
    else:
        scores = (q @ keys.transpose(0, 2, 1)).reshape(n_kv, group, T, -1)  # (n_kv, group, T, L')
    # one query (decoding) sees every key from `first` to itself: nothing to mask
    if T > 1 and window and int(positions[-1]) - window + 1 > first:  # the window hides keys too
        key_pos = np.arange(first, last)                       # (L',)
        hidden = key_pos[None, :] > positions[:, None]         # (T, L')
        hidden |= positions[:, None] - key_pos[None, :] >= window
        scores += np.where(hidden, np.float32(-np.inf), np.float32(0))  # broadcast over heads
    elif T > 1:  # the last T keys are the queries' own positions: hide the ones after each query
        scores[..., -T:] += causal_mask(T)                     # (T, T) broadcast over heads
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores, out=scores)                       # unnormalized softmax
    total = weights.sum(axis=-1, keepdims=True).reshape(n_kv, group * T, 1)
    out = weights.reshape(n_kv, group * T, -1) @ values        # (n_kv, group*T, hd_v)
    out /= total
    return out.reshape(n_head, T, hd_v).transpose(1, 0, 2).reshape(T, n_head * hd_v)  # (T, n_head*hd_v)


def one_query_scores(q: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """One query's scaled scores (n_kv, group, L) from q (n_kv, group, hd), keys (n_kv, L, hd):
    from KEYS_FIRST_MIN_KEYS keys on (engine/tuning.py) as keys @ q.T, which OpenBLAS computes faster then."""
    if keys.shape[1] >= tuning.KEYS_FIRST_MIN_KEYS:
        return (keys @ np.ascontiguousarray(q.transpose(0, 2, 1))).transpose(0, 2, 1)
    return q @ keys.transpose(0, 2, 1)


def attend_one_each(q: np.ndarray, caches: list[tuple[np.ndarray, np.ndarray]], positions: np.ndarray,
                    window: int, scale: float) -> np.ndarray:
    """Softmax attention of one query per sequence (a decode step of a batch), each over its own cache.

    The same floats as `attend` one sequence at a time, in fewer numpy calls: only the
    two products and the sum run per sequence; the softmax runs once over all the
    scores, padded with -inf to the longest (exp(-inf) = 0 and max ignores it).
    q: (S, n_head, hd); caches[i]: keys (n_kv, L_i, hd), values (n_kv, L_i, hd_v).
    """
    S, n_head, hd = q.shape
    n_kv, _, hd_v = caches[0][1].shape
    group = n_head // n_kv
    seen = []  # per sequence, its keys and values from the first position its query sees
    for (keys, values), p in zip(caches, positions):
        first = max(0, int(p) - window + 1) if window else 0
        seen.append((keys[:, first: int(p) + 1], values[:, first: int(p) + 1]))  # (n_kv, L', hd)
    scores = np.full((S, n_kv, group, max(keys.shape[1] for keys, _ in seen)), -np.inf, np.float32)
    q = q * np.float32(scale)                                  # (S, n_head, hd)
    for i, (keys, _) in enumerate(seen):
        scores[i, :, :, : keys.shape[1]] = one_query_scores(q[i].reshape(n_kv, group, hd), keys)
    scores -= scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores, out=scores)                       # (S, n_kv, group, L_max), unnormalized
    out = np.empty((S, n_kv, group, hd_v), np.float32)
    totals = np.empty((S, n_kv, group, 1), np.float32)
    for i, (_, values) in enumerate(seen):
        w = weights[i, :, :, : values.shape[1]]                # (n_kv, group, L')
        totals[i] = w.sum(axis=-1, keepdims=True)
        np.matmul(w, values, out=out[i])                       # (n_kv, group, hd_v)
    out /= totals
    return out.reshape(S, n_head * hd_v)                       # (S, n_head*hd_v)


def position_wise(n_row_args: int = 0):
    """Decorate an op that treats each position (row) on its own, so that a big batch
    (a prefill chunk) is cut into row blocks shared out over the threads (engine/accel).

    The op's first argument, and the n_row_args positional ones after it, are per-row
    arrays (rows on axis 0); the op writes its result, of the first argument's shape,
    into `out` (a new array when None), so each thread writes its rows in place.
    """
    def decorate(op):
        @functools.wraps(op)
        def run(x: np.ndarray, *args, **kwargs):
            if x.size < tuning.POSITION_WISE_MIN_VALUES:  # decode: not worth the threads
                return op(x, *args, out=None, **kwargs)
            out = np.empty(x.shape, np.float32)

            def rows(i0: int, i1: int) -> None:
                row_args = [a[i0:i1] for a in args[:n_row_args]]
                op(x[i0:i1], *row_args, *args[n_row_args:], out=out[i0:i1], **kwargs)

            parallel_for(rows, x.shape[0], x.size)
            return out
        return run
    return decorate


@position_wise()
def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray | None) -> np.ndarray:
    """x / rms(x) * weight over the last axis. x: (..., k), weight: (k,) or broadcastable."""
    ms = np.einsum("...i,...i->...", x, x)                    # (...): sums of squares
    if ms.size == 1:  # one row (decoding): its scale as a float32 scalar, the same float in fewer calls
        inv = np.float32(1.0) / np.sqrt(ms.flat[0] / np.float32(x.shape[-1]) + np.float32(eps))
    else:
        inv = (np.float32(1.0) / np.sqrt(ms / np.float32(x.shape[-1]) + np.float32(eps)))[..., None]  # (..., 1)
    out = np.multiply(x, inv, out=out)                         # (..., k)
    out *= weight
    return out


@position_wise()
def layer_norm(x: np.ndarray, weight: np.ndarray, bias: np.ndarray, eps: float,
               out: np.ndarray | None) -> np.ndarray:
    """(x - mean(x)) / sqrt(var(x) + eps) * weight + bias over the last axis (ggml_norm, then
    the weight and bias). x: (..., k), weight and bias: (k,)."""
    out = np.subtract(x, x.mean(axis=-1, keepdims=True), out=out)  # (..., k)
    var = np.einsum("...i,...i->...", out, out)[..., None] / np.float32(x.shape[-1])  # (..., 1)
    out *= np.float32(1.0) / np.sqrt(var + np.float32(eps))
    out *= weight
    out += bias
    return out


def rope_angles(positions: np.ndarray, rope_dim: int, base: float, scale: float = 1.0,
                freq_factors: tuple[float, ...] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """cos and sin (n, rope_dim/2) float32 of scale * position * base^(-2i/rope_dim) / factor_i
    (the angles computed in float64)."""
    inv_freq = base ** (-np.arange(0, rope_dim, 2, dtype=np.float64) / rope_dim)  # (rope_dim/2,)
    if freq_factors is not None:
        inv_freq = inv_freq / np.asarray(freq_factors, np.float64)
    angles = (scale * positions[:, None].astype(np.float64)) * inv_freq[None, :]  # (n, rope_dim/2)
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)


@position_wise(n_row_args=1)
def rope_pairs(x: np.ndarray, turns: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """Rotate adjacent pairs (2i, 2i+1) of each head's first rope_dim dimensions (RoPE).

    Read as a complex number x_2i + i x_2i+1, a pair turned by an angle is that number
    times e^(i angle): one complex multiply instead of six real ones.
    x: (n, heads, hd), turns: (n, rope_dim/2) complex64 (Batch.rope_turns).
    """
    d = 2 * turns.shape[1]
    out = np.empty_like(x) if out is None else out
    if d < x.shape[-1]:
        out[..., d:] = x[..., d:]                              # dimensions past rope_dim pass through
    np.multiply(x[..., :d].view(np.complex64), turns[:, None, :], out=out[..., :d].view(np.complex64))
    return out


def neox_pairs_order(head_dim: int, rope_dim: int) -> np.ndarray:
    """The order of a head's dimensions that puts NEOX's rotated pairs (i, i + rope_dim/2)
    side by side, at (2i, 2i + 1); the dimensions past rope_dim keep their places.

    Reordering a model's Q and K rows (and their biases and norms) this way changes no
    attention score, since q . k sums over a head's dimensions in any order, and lets
    every architecture rotate adjacent pairs (`rope_pairs`).
    """
    half = rope_dim // 2
    order = np.arange(head_dim)
    order[0:rope_dim:2] = np.arange(half)
    order[1:rope_dim:2] = np.arange(half, rope_dim)
    return order


def split_gate_up(gate_up: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(n, 2*n_ff) -> gate (n, n_ff), up (n, n_ff)."""
    n_ff = gate_up.shape[1] // 2
    return gate_up[:, :n_ff], gate_up[:, n_ff:]


@position_wise(n_row_args=1)
def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """silu(gate) * up = gate / (1 + exp(-gate)) * up, the llama feed-forward's gating.

    Where exp overflows to inf, silu is the right 0.
    """
    t = np.negative(gate, out=out)
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += 1.0
    np.divide(gate, t, out=t)
    t *= up
    return t


@position_wise(n_row_args=1)
def geglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """gelu(gate) * up, the gemma feed-forward's gating, in one buffer (see `gelu`)."""
    t = _gelu(gate, out)
    t *= up
    return t


def _gelu(x: np.ndarray, out: np.ndarray | None) -> np.ndarray:
    """GELU in its tanh approximation (what gemma, BERT's GGUFs and ggml_gelu use),
    0.5 x (1 + tanh(z)) with z = sqrt(2/pi) (x + 0.044715 x^3), computed as the same
    function x / (1 + exp(-2 z)): two passes fewer, an exp instead of a tanh (numpy's
    float32 exp is the faster), and no cancellation in 1 + tanh(z) for negative x
    (relative error 1e-6 against float64, where the tanh form reached 3e-4). Where
    exp overflows to inf, the quotient is the right -0.
    """
    t = np.multiply(x, x, out=out)
    t *= np.float32(-2 * 0.7978845608028654 * 0.044715)
    t += np.float32(-2 * 0.7978845608028654)
    t *= x                                                     # -2 z
    with np.errstate(over="ignore"):
        np.exp(t, out=t)
    t += 1
    np.divide(x, t, out=t)                                     # gelu(x)
    return t


gelu = position_wise()(_gelu)
