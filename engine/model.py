"""A loaded model: hyperparameters, quantized weights, tokenizer, chat template.

`load_model(path)` memory-maps the GGUF file, reads the hyperparameters of its
architecture from the metadata and wraps each weight matrix in a quantized
`Weight` (engine/quants.py) without a float32 copy. The `Model` it returns is
what the rest of the program talks to: tokenize, detokenize, logits, chat
template, and (engine/generate.py, engine/chat.py) generation.

`load_model` is also where the acceleration layer (engine/accel) is put on: the one
place of the engine that imports it. It swaps the weights for wrappers that share
their matmuls out over threads and a helper process; the rest of the engine never
knows whether it is there.

A model owns a worker thread (its scheduler's, while it generates) and, when
acceleration is on, what `accel` holds: `close()` ends both, and a model used as
`with load_model(path) as model:` is closed when the block ends.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
from gguf.quants import dequantize

from . import accel, architectures, describe, embed, tuning
from .api import TokenLogprob
from .architectures import BertBlock, BertWeights, Block, Hyperparameters, NomicBertBlock, Weights
from .chat_template import ChatTemplate
from .constrain import can_constrain
from .errors import ContextLengthExceeded, ModelFileError, UnsupportedModelError
from .gguf_file import GGUFFile
from .kv_cache import KVCache, Sequence, private_zeros
from .quants import concat_weights, load_weight, reorder_rows
from .sampling import report, token_logprob
from .scheduler import Scheduler
from .tokenizer import Tokenizer

# rows of a prompt's logits made at once for its log probabilities: 64 x Gemma 3's
# 262,144 float32 logits are 64 MiB, where the whole of a 2,000-token prompt's would be 2 GiB
PROMPT_LOGIT_ROWS = 64


@dataclass(frozen=True)
class ModelInfo:
    path: str
    name: str
    architecture: str
    quantization: str          # e.g. "Q4_1", "Q4_K_M" (engine/describe.py: the file type, else the matrices')
    context_length: int        # the window we run: trained length, capped by n_ctx
    n_params: int
    size_bytes: int
    n_vocab: int
    n_layer: int
    n_embd: int
    has_chat_template: bool
    capabilities: tuple[str, ...]  # among "tools", "structured_output", "reasoning" (engine/describe.py)


def load_model(path: str | Path, n_ctx: int | None = None, kv_cache_bytes: int | None = None,
               speculate: bool = True, max_batch: int = tuning.MAX_BATCH) -> Model:
    """Open a GGUF model. `n_ctx` caps the context window (default: the trained length);
    `kv_cache_bytes` bounds the KV caches of its scheduler's running requests together
    (see engine.scheduler; default: no bound); `speculate` False turns off drafts from
    the context and forced text (engine/speculate.py), which never change the output;
    `max_batch` is how many requests its scheduler steps together."""
    file = GGUFFile(path)
    hp = read_hyperparameters(file)
    weights = load_weights(file, hp)
    accel.single_threaded_blas()  # the accelerator's threads split the work, not BLAS (engine/accel/threads.py)
    accelerator = accel.install(hp, weights, accel.num_threads())  # its helper process starts ...
    try:
        tokenizer = Tokenizer.from_metadata(file.metadata)  # ... while this runs
        model = Model(file, hp, weights, tokenizer, n_ctx)
    except BaseException:
        if accelerator is not None:
            accelerator.close()
        raise
    model.scheduler.kv_budget.max_bytes = kv_cache_bytes
    model.scheduler.speculate = speculate
    model.scheduler.max_batch = max_batch
    # (its queue holds at least a batch: requests the KV budget keeps waiting, or preempted ones)
    model.scheduler.max_queue = max(model.scheduler.max_queue, max_batch)
    model.accel = accelerator
    accel.release_freed_memory()  # the unpacking's temporaries, and the weights' copies before the helper's memfd
    return model


class Model:
    def __init__(self, file: GGUFFile, hp: Hyperparameters, weights: Weights,
                 tokenizer: Tokenizer, n_ctx: int | None = None):
        self.file = file
        self.hp = hp
        self.weights = weights
        self.tokenizer = tokenizer
        self.n_ctx = min(n_ctx or hp.context_length, hp.context_length)
        self.template_source: str | None = file.get("tokenizer.chat_template")
        vocab = file.get("tokenizer.ggml.tokens") or ()
        # the template drops the BOS / EOS text that the tokenizer adds itself: the
        # tokenizer's own reading of the file decides both
        self.chat_template = ChatTemplate(
            self.template_source,
            bos_token=_token_text(vocab, tokenizer.bos_id),
            eos_token=_token_text(vocab, tokenizer.eos_id),
            vocab=frozenset(vocab),
            add_bos=tokenizer.add_bos,
            add_eos=tokenizer.add_eos,
        )
        self.accel: accel.Accelerator | None = None  # shares the matmuls out: threads, helper (engine/accel)
        self.steps = 0                       # forward steps run so far (tests watch it)
        self._forward_lock = threading.Lock()  # one forward at a time over the shared weights
        self.scheduler = Scheduler(self)       # batches the forward steps of concurrent generations
        self.info = self._make_info()

    # --- the public API ---------------------------------------------------------------

    def close(self) -> None:
        """Stop generating: the requests still running end (ModelClosed), the scheduler's
        thread is joined, the acceleration's resources are released. Idempotent. It
        blocks for up to one forward step: async code calls it in a worker thread."""
        self.scheduler.close()
        if self.accel is not None:
            self.accel.close()

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = False) -> list[int]:
        return self.tokenizer.encode(text, add_special=add_special, parse_special=parse_special)

    def detokenize(self, ids) -> str:
        return self.tokenizer.decode(list(ids))

    def logits(self, ids) -> np.ndarray:
        """Logits (len(ids), n_vocab) float32 of every position, in a fresh context."""
        ids = [int(i) for i in ids]
        if not ids:
            return np.zeros((0, self.hp.n_vocab), np.float32)
        if len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the context window of {self.n_ctx}")
        seq = self.new_sequence(ids)
        out = np.empty((len(ids), self.hp.n_vocab), np.float32)  # (len, V), filled chunk by chunk
        while seq.n_pending:
            start = seq.cache.length
            chunk = self.step([seq], all_logits=True)[0]          # (T, V)
            out[start: start + len(chunk)] = chunk
        return out

    def final_states(self, token_lists: list[list[int]], chunk: int = tuning.PREFILL_CHUNK) -> list[np.ndarray]:
        """The final hidden states (len(ids), d) float32 of each token list, each in a fresh
        context, all of them stepped together (blocking): what engine/embed.py pools.

        A decoder runs them as a prefill, up to `chunk` tokens of each per step; an
        encoder (bert, nomic-bert) in one step, each sequence whole.
        """
        too_long = [len(ids) for ids in token_lists if len(ids) > self.n_ctx]
        if too_long:
            raise ContextLengthExceeded(too_long[0], 0, self.n_ctx)
        if not self.hp.causal:
            batch = architectures.whole_sequences(token_lists)
            with self._forward_lock:
                states = architectures.bert_hidden_states(self.hp, self.weights, batch)  # (n, d)
                self.steps += 1
            return [states[span] for span in batch.spans]
        sequences = [self.new_sequence(ids, capacity=len(ids)) for ids in token_lists]  # (never longer)
        rows: list[list[np.ndarray]] = [[] for _ in sequences]
        while pending := [i for i, seq in enumerate(sequences) if seq.n_pending]:
            batch = architectures.make_batch([sequences[i] for i in pending], chunk)
            with self._forward_lock:
                states = architectures.hidden_states(self.hp, self.weights, batch)  # (n, d)
                self.steps += 1
            for i, span in zip(pending, batch.spans):
                rows[i].append(states[span])
        return [np.concatenate(parts) for parts in rows]

    @property
    def pooling(self) -> str:
        """How `embed` pools by default: the file's pooling type, else mean (engine/embed.py)."""
        return embed.default_pooling(self)

    def embed(self, token_lists: list[list[int]], pooling: str | None = None,
              dimensions: int | None = None) -> list[bytes]:
        """Unit-length float32 embeddings of the token lists, pooled by `pooling` (default:
        `self.pooling`), as little-endian bytes; blocking (engine/embed.py)."""
        return embed.embed(self, token_lists, pooling or self.pooling, dimensions)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None) -> str:
        return self.chat_template.render(messages, add_generation_prompt=add_generation_prompt, tools=tools)

    # --- what generation builds on -------------------------------------------------------

    def new_sequence(self, tokens: list[int], capacity: int = tuning.INITIAL_CAPACITY) -> Sequence:
        """A sequence with an empty cache; its tokens are pending until stepped."""
        hp = self.hp
        cache = KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v, self.n_ctx,
                        capacity=max(capacity, min(len(tokens), self.n_ctx)),
                        allocate=self.accel.allocate_kv if self.accel is not None else private_zeros)
        return Sequence(tokens, cache)

    @property
    def kv_bytes_per_position(self) -> int:
        """The bytes of keys and values a sequence's cache holds for each position (float32)."""
        hp = self.hp
        return hp.n_layer * hp.n_head_kv * (hp.head_dim + hp.head_dim_v) * 4

    def step(self, sequences: list[Sequence], all_logits: bool = False,
             chunk: int = tuning.PREFILL_CHUNK, logit_rows: list[int] | None = None,
             abandon: Callable[[], bool] | None = None) -> list[np.ndarray]:
        """One forward step over up to `chunk` pending tokens of each sequence (blocking).

        Returns per sequence the logits of its last fed token (1, V), of its last k
        fed tokens (k, V) with `logit_rows` (k per sequence: a draft to verify), or
        of all fed tokens (T, V) with `all_logits`. When `abandon()` turns true the
        step stops between two layers and raises StepAbandoned, the caches unchanged.
        """
        self._require_generating()
        batch = architectures.make_batch(sequences, chunk, logit_rows)
        forward = self.accel.forward if self.accel is not None else architectures.forward
        with self._forward_lock:
            out = forward(self.hp, self.weights, batch, all_logits, abandon)
            self.steps += 1
        return out

    def prompt_logprobs(self, ids: list[int], n_top: int) -> list:
        """Each token of a prompt: its log probability after those before it, and the
        `n_top` likeliest there (TokenLogprob; the first token's are None and none), as a
        completion's `echo` with `logprobs` reports them. The prompt runs in a fresh
        context (blocking)."""
        self._require_generating()
        states = self.final_states([ids])[0][:-1]                # (T-1, d): row t predicts token t+1
        entries = [TokenLogprob(ids[0], self.tokenizer.piece(ids[0]), None, ())]
        for start in range(0, len(states), PROMPT_LOGIT_ROWS):
            logits = architectures.lm_head(self.hp, self.weights, states[start:start + PROMPT_LOGIT_ROWS])  # (r, V)
            for row, token in zip(logits, ids[start + 1:]):
                entries.append(token_logprob(self.tokenizer, token, report(row, token, n_top)))
        return entries

    def generate(self, prompt_ids, *, max_tokens, sampling=None, stop=(), constraint=None, continuation=None):
        self._require_generating()
        from .generate import generate
        return generate(self, prompt_ids, max_tokens=max_tokens, sampling=sampling,
                        stop=stop, constraint=constraint, continuation=continuation)

    def prepare_chat(self, request):
        self._require_generating()
        from .chat import prepare_chat
        return prepare_chat(self, request)

    def prepare_text(self, prompt, request):
        self._require_generating()
        from .chat import prepare_text
        return prepare_text(self, prompt, request)

    def generate_chat(self, prepared):
        from .chat import generate_chat
        return generate_chat(self, prepared)

    # --- helpers ------------------------------------------------------------------------

    def _require_generating(self) -> None:
        """An encoder (bert, nomic-bert) has no LM head: asked to generate, it says so."""
        if not self.hp.causal:
            raise UnsupportedModelError(f"{self.info.name} is an embedding model ({self.hp.architecture}): "
                                        "it embeds text and does not generate it")

    def _make_info(self) -> ModelInfo:
        """The model's description, by the rules the model listing uses too (engine/describe.py);
        whether constrained decoding works is checked on the vocabulary itself."""
        file, hp = self.file, self.hp
        return ModelInfo(
            path=str(file.path),
            name=file.get("general.name") or file.path.stem,
            architecture=hp.architecture,
            quantization=describe.quantization(file.header),
            context_length=self.n_ctx,
            n_params=file.header.n_parameters,
            size_bytes=file.path.stat().st_size,
            n_vocab=hp.n_vocab,
            n_layer=hp.n_layer,
            n_embd=hp.n_embd,
            has_chat_template=bool(self.template_source),
            capabilities=describe.capabilities(self.template_source, can_constrain(self.tokenizer)),
        )

    def __repr__(self) -> str:
        return f"Model({self.info.name!r}, {self.info.architecture}, {self.info.quantization})"


def _token_text(vocab, token_id: int | None) -> str:
    return vocab[token_id] if token_id is not None and 0 <= token_id < len(vocab) else ""


def read_hyperparameters(file: GGUFFile) -> Hyperparameters:
    """The architecture's hyperparameters from the GGUF metadata (llama.cpp's keys and defaults)."""
    arch = file.architecture
    supported = [*architectures.BLOCKS, *architectures.ENCODER_BLOCKS]
    if arch not in supported:
        raise UnsupportedModelError(
            f"{file.path}: architecture {arch!r} is not supported (supported: {', '.join(sorted(supported))})")

    def key(name: str, default: Any = ...) -> Any:
        value = file.get(f"{arch}.{name}", default)
        if value is ...:
            raise ModelFileError(f"{file.path}: metadata key '{arch}.{name}' is missing")
        return value

    if arch in architectures.ENCODER_BLOCKS:
        return bert_hyperparameters(file, key)
    n_embd = int(key("embedding_length"))
    n_layer = int(key("block_count"))
    n_head = int(key("attention.head_count"))
    n_head_kv = int(key("attention.head_count_kv", n_head))
    head_dim = int(key("attention.key_length", n_embd // n_head))
    head_dim_v = int(key("attention.value_length", head_dim))
    embd = file.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFileError(f"{file.path}: tensor 'token_embd.weight' is missing")
    gemma = arch == "gemma3"
    window = int(key("attention.sliding_window", 0)) if gemma else 0
    rope_dim = int(key("rope.dimension_count", head_dim))
    factors = file.tensors.get("rope_freqs.weight")  # Llama 3.1+: per-frequency divisors
    if factors is not None and tuple(factors.shape) != (rope_dim // 2,):
        raise ModelFileError(f"{file.path}: tensor 'rope_freqs.weight' has shape {factors.shape}, "
                             f"expected ({rope_dim // 2},)")
    return Hyperparameters(
        architecture=arch,
        n_vocab=embd.shape[0],
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        n_ff=int(key("feed_forward_length")),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(key("context_length")),
        rope_dim=rope_dim,
        rope_base=float(key("rope.freq_base", 10000.0)),
        # llama.cpp hard-codes gemma3's local base; newer files may carry it
        rope_base_local=float(key("rope.freq_base_swa", 10000.0)) if gemma else 0.0,
        rope_neox=arch != "llama",
        rope_scale=rope_scale(file, key),
        rope_freq_factors=None if factors is None else
        tuple(float(f) for f in dequantize(factors.data, factors.type).reshape(-1)),
        sliding_window=window,
        # gemma3: five sliding-window layers, then one global (llama.cpp's swa pattern 6)
        local_layers=tuple(bool(window) and i % 6 < 5 for i in range(n_layer)),
        attention_scale=1.0 / math.sqrt(head_dim),
        embedding_scale=math.sqrt(n_embd) if gemma else 1.0,
        logit_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
        pooling=POOLING_TYPES.get(key("pooling_type", None)),
    )


def rope_scale(file: GGUFFile, key) -> float:
    """The factor RoPE scales positions by: 1 / `rope.scaling.factor` when linear, else 1."""
    scaling = key("rope.scaling.type", "none")
    if scaling not in ("none", "linear"):
        raise UnsupportedModelError(f"{file.path}: RoPE scaling {scaling!r} is not supported (only linear)")
    return 1.0 / float(key("rope.scaling.factor", 1.0) or 1.0) if scaling == "linear" else 1.0


# llama.cpp's llama_pooling_type, the `<arch>.pooling_type` key, by the names engine/embed.py
# pools by; none (per-token vectors) and rank (a reranker's classifier head) are not among them
POOLING_TYPES = {1: "mean", 2: "cls", 3: "last"}


def bert_hyperparameters(file: GGUFFile, key) -> Hyperparameters:
    """An encoder's: multi-head attention, LayerNorm's epsilon, both-ways attention; bert
    without RoPE, nomic-bert with NEOX RoPE (llama.cpp's defaults: base 10k, whole heads)."""
    arch = file.architecture
    n_embd, n_head = int(key("embedding_length")), int(key("attention.head_count"))
    embd = file.tensors.get("token_embd.weight")
    if embd is None:
        raise ModelFileError(f"{file.path}: tensor 'token_embd.weight' is missing")
    n_layer, head_dim = int(key("block_count")), n_embd // n_head
    rotary = arch == "nomic-bert"
    return Hyperparameters(
        architecture=arch, n_vocab=embd.shape[0], n_embd=n_embd, n_layer=n_layer, n_head=n_head,
        n_head_kv=n_head, head_dim=head_dim, head_dim_v=head_dim,
        n_ff=int(key("feed_forward_length")), norm_eps=float(key("attention.layer_norm_epsilon", 1e-12)),
        context_length=int(key("context_length")),
        rope_dim=int(key("rope.dimension_count", head_dim)) if rotary else 0,
        rope_base=float(key("rope.freq_base", 10000.0)) if rotary else 0.0, rope_base_local=0.0,
        rope_neox=rotary, rope_scale=rope_scale(file, key) if rotary else 1.0, rope_freq_factors=None,
        sliding_window=0, local_layers=(False,) * n_layer, attention_scale=1.0 / math.sqrt(head_dim),
        embedding_scale=1.0, causal=False, pooling=POOLING_TYPES.get(key("pooling_type", None)),
    )


def load_weights(file: GGUFFile, hp: Hyperparameters) -> Weights | BertWeights:
    """Wrap every tensor the architecture needs; merge Q/K/V and gate/up into one matrix each."""
    tensor, matrix, vector = _tensor_readers(file)
    if not hp.causal:
        return load_bert_weights(file, hp, matrix, vector)
    return _decoder_weights(file, hp, tensor, matrix, vector)


def _tensor_readers(file: GGUFFile):
    """Three readers of the file's tensors by name: any tensor (None if missing and not
    `required`), a matrix of a given shape (a quantized Weight), a vector (float32)."""

    def tensor(name: str, required: bool = True):
        t = file.tensors.get(name)
        if t is None and required:
            raise ModelFileError(f"{file.path}: tensor {name!r} is missing")
        return t

    def matrix(name: str, shape: tuple[int, int]):
        t = tensor(name)
        if tuple(t.shape) != shape:
            raise ModelFileError(f"{file.path}: tensor {name!r} has shape {t.shape}, expected {shape}")
        return load_weight(t)

    def vector(name: str, size: int, required: bool = True) -> np.ndarray | None:
        t = tensor(name, required)
        if t is None:
            return None
        if tuple(t.shape) != (size,):
            raise ModelFileError(f"{file.path}: tensor {name!r} has shape {t.shape}, expected ({size},)")
        return np.asarray(dequantize(t.data, t.type), np.float32).reshape(size)

    return tensor, matrix, vector


def _decoder_weights(file: GGUFFile, hp: Hyperparameters, tensor, matrix, vector) -> Weights:
    d, hd, hd_v = hp.n_embd, hp.head_dim, hp.head_dim_v
    n_q, n_k, n_v = hp.n_head * hd, hp.n_head_kv * hd, hp.n_head_kv * hd_v
    # A NEOX model's Q and K dimensions, head by head, in the order that makes its rotated
    # pairs adjacent (see architectures.neox_pairs_order); identity for the others.
    order = architectures.neox_pairs_order(hd, hp.rope_dim) if hp.rope_neox else np.arange(hd)
    q_rows = (np.arange(hp.n_head)[:, None] * hd + order).reshape(-1)     # (n_q,)
    k_rows = (np.arange(hp.n_head_kv)[:, None] * hd + order).reshape(-1)  # (n_k,)

    def reordered(w, rows):
        return reorder_rows(w, rows) if hp.rope_neox else w

    blocks = []
    for i in range(hp.n_layer):
        b = f"blk.{i}."
        q = reordered(matrix(b + "attn_q.weight", (n_q, d)), q_rows)
        k = reordered(matrix(b + "attn_k.weight", (n_k, d)), k_rows)
        v = matrix(b + "attn_v.weight", (n_v, d))
        biases = [vector(b + f"attn_{x}.bias", n, required=False) for x, n in (("q", n_q), ("k", n_k), ("v", n_v))]
        if any(x is not None for x in biases) and not all(x is not None for x in biases):
            raise ModelFileError(f"{file.path}: block {i} has some but not all of the Q/K/V biases")
        has_qk_norm = hp.architecture in ("qwen3", "gemma3")
        gemma = hp.architecture == "gemma3"
        blocks.append(Block(
            attn_norm=vector(b + "attn_norm.weight", d),
            qkv=concat_weights([q, k, v]),
            qkv_bias=np.concatenate([biases[0][q_rows], biases[1][k_rows], biases[2]])
            if biases[0] is not None else None,
            qk_norm=np.concatenate([np.tile(vector(b + "attn_q_norm.weight", hd)[order], (hp.n_head, 1)),
                                    np.tile(vector(b + "attn_k_norm.weight", hd)[order], (hp.n_head_kv, 1))])
            if has_qk_norm else None,
            attn_output=matrix(b + "attn_output.weight", (d, hp.n_head * hd_v)),
            post_attention_norm=vector(b + "post_attention_norm.weight", d) if gemma else None,
            ffn_norm=vector(b + "ffn_norm.weight", d),
            gate_up=concat_weights([matrix(b + "ffn_gate.weight", (hp.n_ff, d)),
                                    matrix(b + "ffn_up.weight", (hp.n_ff, d))]),
            ffn_down=matrix(b + "ffn_down.weight", (d, hp.n_ff)),
            post_ffw_norm=vector(b + "post_ffw_norm.weight", d) if gemma else None,
        ))
    token_embd = matrix("token_embd.weight", (hp.n_vocab, d))
    output = file.tensors.get("output.weight")
    return Weights(
        token_embd=token_embd,
        blocks=blocks,
        output_norm=vector("output_norm.weight", d),
        output=matrix("output.weight", (hp.n_vocab, d)) if output is not None else token_embd,
    )


def load_bert_weights(file: GGUFFile, hp: Hyperparameters, matrix, vector) -> BertWeights:
    """An encoder's tensors (llama.cpp's names): bert's or nomic-bert's blocks, and the
    embeddings (a position table only for bert)."""
    d = hp.n_embd

    def norm(name: str) -> tuple[np.ndarray, np.ndarray]:
        return vector(name + ".weight", d), vector(name + ".bias", d)

    rotary = hp.architecture == "nomic-bert"
    load_block = load_nomic_bert_block if rotary else load_bert_block
    types = file.tensors.get("token_types.weight")
    return BertWeights(
        token_embd=matrix("token_embd.weight", (hp.n_vocab, d)),
        position_embd=None if rotary else matrix("position_embd.weight", (hp.context_length, d)).dequantize(),
        token_type=None if types is None else load_weight(types).rows([0])[0],
        token_embd_norm=norm("token_embd_norm"),
        blocks=[load_block(f"blk.{i}.", hp, matrix, vector, norm) for i in range(hp.n_layer)],
    )


def load_bert_block(b: str, hp: Hyperparameters, matrix, vector, norm) -> BertBlock:
    """The tensors of BERT's block named `b`; Q, K, V merged into one matrix, as their biases."""
    d, n_ff = hp.n_embd, hp.n_ff
    return BertBlock(
        qkv=concat_weights([matrix(b + f"attn_{x}.weight", (d, d)) for x in "qkv"]),
        qkv_bias=np.concatenate([vector(b + f"attn_{x}.bias", d) for x in "qkv"]),
        attn_output=matrix(b + "attn_output.weight", (d, d)),
        attn_output_bias=vector(b + "attn_output.bias", d),
        attn_output_norm=norm(b + "attn_output_norm"),
        ffn_up=matrix(b + "ffn_up.weight", (n_ff, d)),
        ffn_up_bias=vector(b + "ffn_up.bias", n_ff),
        ffn_down=matrix(b + "ffn_down.weight", (d, n_ff)),
        ffn_down_bias=vector(b + "ffn_down.bias", d),
        layer_output_norm=norm(b + "layer_output_norm"),
    )


def load_nomic_bert_block(b: str, hp: Hyperparameters, matrix, vector, norm) -> NomicBertBlock:
    """The tensors of nomic-bert's block named `b`: its fused Q, K, V with the Q and K rows
    of each head put in the order that makes NEOX's pairs adjacent (as a decoder's)."""
    d, n_ff = hp.n_embd, hp.n_ff
    qk_rows = (np.arange(2 * hp.n_head)[:, None] * hp.head_dim
               + architectures.neox_pairs_order(hp.head_dim, hp.rope_dim)).reshape(-1)  # (2d,): Q's, then K's
    rows = np.concatenate([qk_rows, np.arange(2 * d, 3 * d)])  # (3d,): V's stay
    return NomicBertBlock(
        qkv=reorder_rows(matrix(b + "attn_qkv.weight", (3 * d, d)), rows),
        attn_output=matrix(b + "attn_output.weight", (d, d)),
        attn_output_norm=norm(b + "attn_output_norm"),
        gate_up=concat_weights([matrix(b + "ffn_gate.weight", (n_ff, d)), matrix(b + "ffn_up.weight", (n_ff, d))]),
        ffn_down=matrix(b + "ffn_down.weight", (d, n_ff)),
        layer_output_norm=norm(b + "layer_output_norm"),
    )
