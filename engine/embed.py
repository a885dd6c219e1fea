"""Embeddings: one vector per text, pooled from a model's final hidden states.

    embed(model, token_lists, pooling, dimensions=None) -> list[bytes]

What llama.cpp computes with embeddings on (llama-graph.cpp's `build_pooling`): the
forward without the LM head, its hidden states after the output norm (`t_embd`;
BERT's last block ends with its own LayerNorm), pooled per sequence:

- mean: the average of all its tokens' states, the BOS / [CLS] / [SEP] it was
  given included;
- cls: its first token's state ([CLS] for BERT, BOS for a decoder that adds one);
- last: its last token's state (the one token of a causal model that saw all the
  others).

llama.cpp's other two, none (a vector per token) and rank (a reranker's classifier
head), are not served. Each vector is then scaled to unit length (L2), as
llama-server's /v1/embeddings does (`embd_normalize` 2): cosine similarity is then a
dot product. `dimensions` keeps the first k components and scales them to unit length
again, as OpenAI's shortened text-embedding-3 vectors are.

A model's default pooling is its file's `<arch>.pooling_type` (bge: cls, nomic and
all-MiniLM: mean); a file that names none (every chat model's) is pooled by mean,
where llama-server refuses its /v1/embeddings until `--pooling` says one.

Batching: engine/api.py's `embedding_groups` groups inputs into forward steps of at
most EMBED_BATCH_TOKENS tokens (engine/tuning.py), one `embed` (one `Model.final_states`)
call each, so that 64 short texts take a step or two, not 64, and a caller running
each group in a worker thread lets the scheduler's decode steps in between (they share
the model's forward lock).
The vectors are float32, little-endian, as bytes: plain data for the server
(lmsp_min/openai_dialect/embeddings.py), which writes them as JSON numbers or base64.
"""

from __future__ import annotations

import numpy as np

from .api import POOLINGS


def default_pooling(model) -> str:
    """The pooling a model's file asks for, else mean (the module docstring)."""
    return model.hp.pooling or "mean"


def embed(model, token_lists: list[list[int]], pooling: str, dimensions: int | None = None) -> list[bytes]:
    """The unit-length embedding of each token list (float32 little-endian bytes), all of
    them in one `final_states` call (blocking: run it in a worker thread). Every list
    holds at least one token and fits the context window (ContextLengthExceeded if not)."""
    if pooling not in POOLINGS:
        raise ValueError(f"pooling {pooling!r} is not one of {', '.join(POOLINGS)}")
    vectors = np.stack([pool(states, pooling) for states in model.final_states(token_lists)])  # (k, d)
    if dimensions is not None:
        vectors = vectors[:, :dimensions]                      # (k, dimensions)
    vectors = normalized(vectors)
    return [row.astype("<f4").tobytes() for row in vectors]


def pool(states: np.ndarray, pooling: str) -> np.ndarray:
    """One sequence's final hidden states (T, d) pooled into one vector (d,)."""
    if pooling == "mean":
        return states.mean(axis=0, dtype=np.float64).astype(np.float32)
    return states[0] if pooling == "cls" else states[-1]


def normalized(vectors: np.ndarray) -> np.ndarray:
    """Each row (k, d) scaled to unit L2 norm (an all-zero row stays zero, as llama.cpp's)."""
    norms = np.sqrt(np.einsum("ij,ij->i", vectors, vectors, dtype=np.float64))[:, None]  # (k, 1)
    return (vectors / np.where(norms > 0, norms, 1.0)).astype(np.float32)
