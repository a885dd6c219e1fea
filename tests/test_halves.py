"""A decode step in two halves (engine/accel/halves.py): the helper process steps some of a
batch's sequences over KV caches both processes map. The oracle is the plain engine, one
process on one thread: the same tokens, the floats within rounding; and no harm when the
helper dies, nor when a step is abandoned."""

from __future__ import annotations

import gc
import os
import signal

import numpy as np
import pytest
import trio

from engine import tuning
from engine.accel import halves as halves_module
from engine.architectures import StepAbandoned
from engine.model import load_model
from test_helper import needs_memfd, tiny_model_starting_a_helper
from test_scheduler import alone, assert_same_greedy, generate, prompt
from waiting import wait_until_sync

N_SEQUENCES = 16  # enough for a halved step (tuning.HALVES_MIN_SEQUENCES)


@pytest.fixture
def halving_model(tmp_path, monkeypatch):
    """A tiny model with a helper that halves its decode steps."""
    assert N_SEQUENCES >= tuning.HALVES_MIN_SEQUENCES
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    assert model.accel.halves is not None and model.accel.helper.wait_ready(timeout=60), "the helper did not start"
    yield model
    model.close()


@pytest.fixture
def plain_model(tmp_path, monkeypatch):
    """The same tiny model in the plain engine: one process, one thread."""
    monkeypatch.setenv("LMSP_THREADS", "1")
    model = load_model(tmp_path / "tiny.gguf")
    assert model.accel is None
    yield model
    model.close()


def prompts() -> list[list[int]]:
    return [[1, 5 + i, 9, 13 + 2 * i][: 2 + i % 3] for i in range(N_SEQUENCES)]


def greedy_steps(model, steps: int = 5) -> list[np.ndarray]:
    """The logits (N_SEQUENCES, V) of each decode step, every sequence taking its argmax."""
    seqs = [model.new_sequence(p) for p in prompts()]
    out = model.step(seqs)
    steps_logits = []
    for _ in range(steps):
        for seq, logits in zip(seqs, out):
            seq.append(int(np.argmax(logits[-1])))
        out = model.step(seqs)
        steps_logits.append(np.concatenate(out))
    return steps_logits


def assert_same_decoding(a: list[np.ndarray], b: list[np.ndarray]) -> None:
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.argmax(axis=-1), y.argmax(axis=-1))
        np.testing.assert_allclose(x, y, rtol=0, atol=1e-5 * np.abs(y).max())


@needs_memfd
def test_a_decode_step_of_many_sequences_is_halved_and_decodes_as_the_plain_engine(halving_model, plain_model):
    halved = greedy_steps(halving_model)
    assert halving_model.accel.halves.halved > 0
    assert_same_decoding(halved, greedy_steps(plain_model))


@needs_memfd
def test_a_step_of_few_sequences_is_not_halved(halving_model):
    seqs = [halving_model.new_sequence(p) for p in prompts()[: tuning.HALVES_MIN_SEQUENCES - 1]]
    halving_model.step(seqs)
    halving_model.step([halving_model.new_sequence([1, 2])])
    assert halving_model.accel.halves.halved == 0


@needs_memfd
def test_a_helper_killed_before_a_halved_step_leaves_its_half_to_the_model(halving_model, plain_model):
    halving_model.accel.helper.process.kill()
    halving_model.accel.helper.process.wait(timeout=30)
    assert_same_decoding(greedy_steps(halving_model), greedy_steps(plain_model))
    assert not halving_model.accel.helper.alive


@needs_memfd
def test_a_helper_that_dies_in_a_halved_step_leaves_its_half_to_the_model(halving_model, plain_model):
    helper = halving_model.accel.helper
    seqs = [halving_model.new_sequence(p) for p in prompts()]
    # abandon() is asked between the layers of the model's half, while the helper runs its own
    out = halving_model.step(seqs, abandon=lambda: helper.process.kill())
    plain_seqs = [plain_model.new_sequence(p) for p in prompts()]
    plain = plain_model.step(plain_seqs)
    assert_same_decoding([np.concatenate(out)], [np.concatenate(plain)])
    for seq, plain_seq, logits in zip(seqs, plain_seqs, out):  # and the next step, without it
        seq.append(int(np.argmax(logits[-1])))
        plain_seq.append(int(np.argmax(logits[-1])))
    assert_same_decoding([np.concatenate(halving_model.step(seqs))], [np.concatenate(plain_model.step(plain_seqs))])
    assert not helper.alive


@needs_memfd
def test_an_abandoned_halved_step_leaves_every_cache_as_it_was(halving_model, plain_model):
    seqs = [halving_model.new_sequence(p) for p in prompts()]
    halving_model.step(seqs)
    for seq in seqs:
        seq.append(3)
    lengths = [seq.cache.length for seq in seqs]
    with pytest.raises(StepAbandoned):
        halving_model.step(seqs, abandon=lambda: True)
    assert [seq.cache.length for seq in seqs] == lengths
    plain = [plain_model.new_sequence(p + [3]) for p in prompts()]
    assert_same_decoding([np.concatenate(halving_model.step(seqs))], [np.concatenate(plain_model.step(plain))])


def helper_kv_mappings(model) -> int:
    with open(f"/proc/{model.accel.helper.process.pid}/maps") as maps:
        return sum("lmsp-kv" in line for line in maps)


@needs_memfd
def test_the_helper_lets_go_of_the_caches_the_model_drops(halving_model):
    seqs = [halving_model.new_sequence(p) for p in prompts()]
    halving_model.step(seqs)
    wait_until_sync(lambda: helper_kv_mappings(halving_model) >= N_SEQUENCES, "the helper mapped the caches")
    del seqs
    gc.collect()
    wait_until_sync(lambda: helper_kv_mappings(halving_model) == 0, "the helper unmapped the caches")
    assert os.path.exists(f"/proc/{halving_model.accel.helper.process.pid}")


@needs_memfd
async def test_many_requests_batched_with_the_helper_give_the_tokens_each_gives_alone(halving_model, plain_model):
    """Through the scheduler: prompts that share a start (their caches copied from the
    prefix cache), halved steps, and each request's tokens those of the plain engine alone."""
    shared_start = prompt(30, 7)
    prompts = [shared_start + prompt(4 + i, 50 + i)[1:] for i in range(N_SEQUENCES)]
    halving_model.scheduler.max_batch = N_SEQUENCES  # (what `load_model(max_batch=...)` sets)
    await generate(halving_model.scheduler, shared_start, 1)  # the start, into the prefix cache
    got = [None] * N_SEQUENCES

    async def run(i: int) -> None:
        got[i] = await generate(halving_model.scheduler, prompts[i], 10)

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(N_SEQUENCES):
                nursery.start_soon(run, i)
    assert halving_model.accel.halves.halved > 0
    assert all(cached > 0 for _, cached in got)
    for p, (tokens, _) in zip(prompts, got):  # (the oracle: the plain engine, one request at a time)
        assert_same_greedy(plain_model, p, (await generate(alone(plain_model), p, 10))[0], tokens)


@needs_memfd
def test_caches_past_the_shared_blocks_bound_are_private_and_stepped_by_the_model(halving_model, plain_model,
                                                                                 monkeypatch):
    monkeypatch.setattr(halves_module, "MAX_SHARED_BLOCKS", N_SEQUENCES // 2)
    blocks = halving_model.accel.halves.blocks
    halved = greedy_steps(halving_model)
    assert halving_model.accel.halves.halved > 0  # the shared half of them still halves
    assert_same_decoding(halved, greedy_steps(plain_model))
    seqs = [halving_model.new_sequence(p) for p in prompts()]
    assert sum(blocks.number(seq.cache.storage) is not None for seq in seqs) == N_SEQUENCES // 2


@needs_memfd
def test_a_block_freed_in_the_middle_of_a_command_is_forgotten_after_it(halving_model, plain_model, monkeypatch):
    """A finalizer may run between two parts of a long write, on the writing thread: its
    command must not cut the other in two."""
    from engine.accel import helper as helper_module

    helper = halving_model.accel.helper
    dropped = halving_model.new_sequence([1, 2, 3])
    number = halving_model.accel.halves.blocks.number(dropped.cache.storage)
    write_all = helper_module._write_all
    cut = []

    def write_in_two_parts(fd, data):
        if cut:
            return write_all(fd, data)
        cut.append(len(data))
        write_all(fd, data[: len(data) // 2])
        helper.forget_block(number)  # what the block's finalizer sends
        write_all(fd, data[len(data) // 2:])

    monkeypatch.setattr(helper_module, "_write_all", write_in_two_parts)
    assert_same_decoding(greedy_steps(halving_model, steps=2), greedy_steps(plain_model, steps=2))
    assert cut and helper.alive and halving_model.accel.halves.halved > 0


@needs_memfd
def test_a_helper_late_in_a_halved_step_is_not_waited_for_and_is_back_after_its_rest(halving_model, plain_model):
    """A helper whose core is taken (stopped, here) is given as long again as our half took:
    the model then computes its half itself, over copies of the caches it may still write."""
    helper, halves = halving_model.accel.helper, halving_model.accel.halves
    seqs = [halving_model.new_sequence(p) for p in prompts()]
    plain_seqs = [plain_model.new_sequence(p) for p in prompts()]
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        out = halving_model.step(seqs)
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    assert halves.halved == 1 and helper.alive  # sent, not waited for, not killed
    plain = plain_model.step(plain_seqs)
    assert_same_decoding([np.concatenate(out)], [np.concatenate(plain)])
    for _ in range(200):  # steps until it is back: its late answer read, its rest over
        for seq, plain_seq, logits in zip(seqs, plain_seqs, plain):
            seq.append(int(np.argmax(logits[-1])))
            plain_seq.append(int(np.argmax(logits[-1])))
        out, plain = halving_model.step(seqs), plain_model.step(plain_seqs)
        assert_same_decoding([np.concatenate(out)], [np.concatenate(plain)])
        if halves.halved > 1:
            break
    assert halves.halved > 1 and helper.alive
