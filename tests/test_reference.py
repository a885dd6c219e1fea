"""The fast path against the float64 reference forward (engine/reference.py).

Every way the engine runs a sequence's tokens gives the reference's logits up to
float32 rounding: one prefill, prefill in chunks, prefill then decoding token by
token, several sequences stepping together (prefill and decode), and a prompt
that continues from the prefix cache, through the scheduler's generation path.
On the tiny random-weight model of every architecture, and (slow) on both real
models, with the helper process and without (`LMSP_HELPER=0`): the helper only
starts for big models, so the tiny ones always run without it.

The bound: every token's logprob within LOGPROB_TOLERANCE of the reference's, and
the same argmax wherever the reference's top two are further apart than twice
that (within it, they may swap). float32 against float64 lands about 15x below
the bound on every path measured (docs/benchmarks.md); a real error (a wrong
RoPE pairing, a mask off by one, another sequence's cache) is off by 0.1 to 10.
"""

import math

import numpy as np
import pytest
import trio

from conftest import DATA
from engine import load_model
from engine.reference import reference_logits
from tiny import ARCHITECTURES, write_tiny_model

LOGPROB_TOLERANCE = 1e-3  # nats

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."
OTHER_TEXT = "Seven small boats left the harbor before dawn; only three of them came back with fish."


def log_softmax(logits: np.ndarray) -> np.ndarray:
    z = np.asarray(logits, np.float64)                         # (n, V)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def assert_agrees(logits: np.ndarray, reference: np.ndarray) -> None:
    """The engine's logits (n, V) agree with the reference's (n, V) (see the module docstring)."""
    got, want = log_softmax(logits), log_softmax(reference)
    assert got.shape == want.shape
    worst = float(np.abs(got - want).max())
    assert worst <= LOGPROB_TOLERANCE, f"a logprob is {worst:.2e} nats from the reference's"
    top2 = np.sort(want, axis=-1)[:, -2:]                      # (n, 2)
    decisive = top2[:, 1] - top2[:, 0] > 2 * LOGPROB_TOLERANCE
    np.testing.assert_array_equal(got.argmax(axis=-1)[decisive], want.argmax(axis=-1)[decisive])


# --- the engine's ways of running tokens, each giving logits (n, V) of every position ----


def chunked_prefill(model, ids: list[int], chunk: int) -> np.ndarray:
    seq = model.new_sequence(ids)
    rows = []
    while seq.n_pending:
        rows.append(model.step([seq], all_logits=True, chunk=chunk)[0])  # (<= chunk, V)
    assert len(rows) == math.ceil(len(ids) / chunk)
    return np.concatenate(rows)


def prefill_then_decode(model, ids: list[int], prompt: int) -> np.ndarray:
    seq = model.new_sequence(ids[:prompt])
    rows = [model.step([seq], all_logits=True)[0]]             # (prompt, V)
    for token in ids[prompt:]:
        seq.append(token)
        rows.append(model.step([seq])[0])                      # (1, V)
    return np.concatenate(rows)


def stepped_together(model, token_lists: list[list[int]], prompts: list[int],
                     all_logits: bool = True) -> list[np.ndarray]:
    """The sequences prefill their prompts in one step, then decode the rest of their
    tokens together, one token each per step (each leaves the batch when done).
    Returns each one's logits from its first position on, or without `all_logits`
    from its prompt's last one on."""
    seqs = [model.new_sequence(ids[:p]) for ids, p in zip(token_lists, prompts)]
    rows = [[out] for out in model.step(seqs, all_logits=all_logits, chunk=max(prompts))]  # (p_i or 1, V)
    while True:
        going = [i for i, seq in enumerate(seqs) if len(seq.tokens) < len(token_lists[i])]
        if not going:
            return [np.concatenate(r) for r in rows]
        for i in going:
            seqs[i].append(token_lists[i][len(seqs[i].tokens)])
        for i, out in zip(going, model.step([seqs[i] for i in going])):
            rows[i].append(out)                                # (1, V)


async def generated_logits(model, prompt: list[int], continuation: list[int]) -> tuple[np.ndarray, int]:
    """What the scheduler hands a generation's sampler, teacher-forced: each pick records
    its logits and picks the next token of `continuation`. Returns the logits
    (len(continuation), V), of positions len(prompt) - 1 on, and the prompt tokens the
    prefix cache supplied."""
    seen = []

    def pick(logits: np.ndarray) -> int:
        seen.append(logits.copy())
        return continuation[len(seen) - 1]

    with trio.fail_after(120):
        with model.scheduler.submit(prompt, pick=pick, max_tokens=len(continuation)) as steps:
            async for _ in steps:
                pass
            return np.stack(seen), steps.cached_tokens


async def check_prefix_cache_path(model, ids: list[int], reference: np.ndarray, first: int, second: int,
                                  generated: int) -> None:
    """A request for ids[:first] generates `generated` tokens; a second one, for the
    longer prompt ids[:second], starts from the first one's cached keys and values."""
    logits, cached = await generated_logits(model, ids[:first], ids[first: first + generated])
    assert cached == 0
    assert_agrees(logits, reference[first - 1: first - 1 + generated])
    logits, cached = await generated_logits(model, ids[:second], ids[second: second + generated])
    assert cached >= first
    assert_agrees(logits, reference[second - 1: second - 1 + generated])


# --- the tiny models: every architecture -----------------------------------------------


@pytest.fixture(scope="module", params=ARCHITECTURES)
def tiny(request, tmp_path_factory):
    """A tiny model, two token lists and the reference's logits of each."""
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    model = load_model(write_tiny_model(path, request.param))
    texts = [model.tokenize(TEXT), model.tokenize(OTHER_TEXT)]
    assert min(len(ids) for ids in texts) > 16  # past gemma3's tiny sliding window of 8
    return model, texts, [reference_logits(model, ids) for ids in texts]


def test_reference_is_causal_and_float64(tiny):
    model, (ids, _), (reference, _) = tiny
    assert reference.dtype == np.float64 and reference.shape == (len(ids), model.info.n_vocab)
    assert np.isfinite(reference).all()
    np.testing.assert_allclose(reference_logits(model, ids[:7]), reference[:7], rtol=0, atol=1e-12)


def test_prefill(tiny):
    model, texts, references = tiny
    for ids, reference in zip(texts, references):
        assert_agrees(model.logits(ids), reference)


def test_chunked_prefill(tiny):
    model, (ids, _), (reference, _) = tiny
    assert_agrees(chunked_prefill(model, ids, chunk=6), reference)


def test_decode_token_by_token(tiny):
    model, (ids, _), (reference, _) = tiny
    assert_agrees(prefill_then_decode(model, ids, prompt=3), reference)


@pytest.mark.parametrize("all_logits", [True, False])
def test_sequences_stepping_together(tiny, all_logits):
    """Without all_logits the last block computes each sequence's last row only, but it
    still stores every token's keys and values: the decode steps after it read them."""
    model, (a, b), (ref_a, ref_b) = tiny
    prompts = [5, 9, 2]
    out = stepped_together(model, [a, b, a[:12]], prompts, all_logits)
    for logits, reference, p in zip(out, [ref_a, ref_b, ref_a[:12]], prompts):
        assert_agrees(logits, reference if all_logits else reference[p - 1:])


async def test_prefix_cache_path(tiny):
    model, (ids, _), (reference, _) = tiny
    await check_prefix_cache_path(model, ids, reference, first=6, second=14, generated=4)


# --- the real models (slow) ------------------------------------------------------------

REAL_MODELS = ("smollm2", "gemma3")


@pytest.fixture(scope="module", params=REAL_MODELS)
def real_case(request):
    """A real model (with its helper process, where the machine has one), two texts'
    token lists (256 and 160 tokens) and the reference's logits of each."""
    path = request.getfixturevalue(f"{request.param}_path")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LMSP_HELPER", "1")
        model = load_model(path)
    texts = [model.tokenize((DATA / "perplexity.txt").read_text())[:256],
             model.tokenize((DATA / "longcontext.txt").read_text())[:160]]
    assert [len(ids) for ids in texts] == [256, 160]
    return path, model, texts, [reference_logits(model, ids) for ids in texts]


@pytest.fixture(scope="module", params=["helper", "no helper"])
def real(request, real_case):
    """The helper computes part of the matmuls of decode steps only: the tests of those
    run with it and without it."""
    path, model, texts, references = real_case
    if request.param == "no helper":
        with pytest.MonkeyPatch.context() as env:
            env.setenv("LMSP_HELPER", "0")
            model = load_model(path)
    return model, texts, references


@pytest.mark.slow
def test_real_prefill_and_chunked_prefill(real_case):
    _, model, (ids, _), (reference, _) = real_case
    assert_agrees(model.logits(ids), reference)
    assert_agrees(chunked_prefill(model, ids, chunk=48), reference)


@pytest.mark.slow
def test_real_decode_token_by_token(real):
    model, (ids, _), (reference, _) = real
    assert_agrees(prefill_then_decode(model, ids, prompt=224), reference)


@pytest.mark.slow
def test_real_sequences_stepping_together(real):
    model, (a, b), (ref_a, ref_b) = real
    out = stepped_together(model, [a, b, a[:150]], prompts=[232, 140, 120])
    for logits, reference in zip(out, [ref_a, ref_b, ref_a[:150]]):
        assert_agrees(logits, reference)


@pytest.mark.slow
async def test_real_prefix_cache_path(real):
    model, (ids, _), (reference, _) = real
    await check_prefix_cache_path(model, ids, reference, first=200, second=230, generated=6)
