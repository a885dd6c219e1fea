"""Our embeddings against llama.cpp's, the oracle, on the real models and the tiny
encoders (slow).

llama-cpp-python's `Llama(path, embedding=True, pooling_type=...)` runs llama.cpp's
own pooling (llama-graph.cpp `build_pooling`) over the same GGUF; `embed(text,
normalize=True)` scales the vector to unit length as llama-server's /v1/embeddings
does. Both sides tokenize the text themselves (the ids are checked equal first), and
the vectors must agree to a cosine of at least 0.999. What keeps them from 1 is
llama.cpp's float16 / 8-bit rounding of the activations between its quantized matmuls
(our float32 forward is 1e-6 from the float64 reference: tests/test_embeddings.py);
measured: SmolLM2 0.9993-0.9998 in every pooling, Gemma 3 0.9992 by mean but 0.997-0.998
by last (one token's state, not an average of many roundings). There the exact model
settles it: the float64 reference (engine/reference.py) gives our vector to a cosine of
1 - 1e-8, and llama.cpp's to the same cosine as ours, so the distance is all llama.cpp's
and the test of Gemma 3's last pooling holds us to the reference instead
(docs/benchmarks.md). The tiny BERT and nomic-bert (tests/tiny.py) are the check that
their file layouts and their math are llama.cpp's, to a closer bar: measured 0.99993 or
more in every pooling, where a nomic-bert whose RoPE turned at base 10k instead of its
file's 1000 scores 0.9949-0.9998.
"""

import numpy as np
import pytest

from engine import load_model
from engine.embed import pool
from engine.reference import reference_hidden_states
from tiny import write_tiny_bert

llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the oracle)")

pytestmark = pytest.mark.slow

AGREEMENT = 0.999  # cosine, the bar
TINY_AGREEMENT = 0.9999  # the tiny encoders' (measured 0.99993 at the least): two layers round less
TEXTS = ["Hello, the cat sat on the mat!", "Embeddings turn text into vectors that a search can compare.",
         "def add(a, b):\n    return a + b", "Seven small boats left the harbor before dawn."]
TINY_TEXTS = ["Hello, the cat sat on the mat!", "embeddings running", "the dog", "a b c d e f g h i j k l m n o p"]
POOLING_TYPES = {"mean": llama_cpp.LLAMA_POOLING_TYPE_MEAN, "cls": llama_cpp.LLAMA_POOLING_TYPE_CLS,
                 "last": llama_cpp.LLAMA_POOLING_TYPE_LAST}


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))


def vectors(path, pooling: str, exact: bool = False, texts: list[str] = TEXTS) -> tuple[list, list, list]:
    """Per text: our vector, llama.cpp's and (with `exact`) the float64 reference's, pooled alike."""
    oracle = llama_cpp.Llama(model_path=str(path), embedding=True, pooling_type=POOLING_TYPES[pooling],
                             n_ctx=512, verbose=False)
    try:
        with load_model(path) as model:
            token_lists = [model.tokenize(text) for text in texts]
            assert [oracle.tokenize(text.encode()) for text in texts] == token_lists
            ours = [np.frombuffer(v, "<f4").astype(np.float64) for v in model.embed(token_lists, pooling)]
            reference = [pool(reference_hidden_states(model, ids), pooling) for ids in token_lists] if exact else []
        theirs = [np.asarray(oracle.embed(text, normalize=True), np.float64) for text in texts]
    finally:
        oracle.close()
    return ours, theirs, reference


def cosines(path, pooling: str, texts: list[str] = TEXTS) -> list[float]:
    ours, theirs, _ = vectors(path, pooling, texts=texts)
    return [cosine(a, b) for a, b in zip(ours, theirs)]


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_smollm2s_embeddings_agree_with_llama_cpps(smollm2_path, pooling):
    assert min(cosines(smollm2_path, pooling)) >= AGREEMENT


def test_gemma3s_mean_embeddings_agree_with_llama_cpps(gemma3_path):
    assert min(cosines(gemma3_path, "mean")) >= AGREEMENT


def test_where_gemma3s_last_embeddings_part_from_llama_cpps_the_exact_model_sides_with_ours(gemma3_path):
    ours, theirs, exact = vectors(gemma3_path, "last", exact=True)
    for a, b, x in zip(ours, theirs, exact):
        assert cosine(a, x) >= 1 - 1e-6  # ours is the exact model's vector
        assert abs(cosine(b, x) - cosine(a, b)) <= 1e-5  # llama.cpp is as far from it as from ours


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
@pytest.mark.parametrize("architecture", ["bert", "nomic-bert"])
def test_the_tiny_encoders_embeddings_agree_with_llama_cpps(tmp_path, architecture, pooling):
    path = write_tiny_bert(tmp_path / f"tiny-{architecture}.gguf", architecture=architecture)
    assert min(cosines(path, pooling, TINY_TEXTS)) >= TINY_AGREEMENT
