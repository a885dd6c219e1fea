"""The helper process (engine/accel/helper.py): the same floats with it or without it, no
wait for one that is behind, and no harm when it dies."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

import numpy as np
import pytest

from engine import accel, quants, tuning
from engine.accel import helper as helper_module
from engine.accel.helper import Rests, grace
from engine.model import load_model
from tiny import write_tiny_model
from waiting import wait_until_sync

needs_memfd = pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "memfd_create"),
                                 reason="the helper process needs Linux's memfd")


def tiny_model_starting_a_helper(tmp_path, monkeypatch):
    """A tiny model loaded as a big one would be: on two threads, with a helper starting."""
    monkeypatch.setattr(tuning, "HELPER_MIN_VALUES", 0)
    monkeypatch.delenv("LMSP_HELPER", raising=False)
    monkeypatch.setenv("LMSP_THREADS", "2")
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    return load_model(path)


@pytest.fixture
def model_with_helper(tmp_path, monkeypatch):
    """A tiny model whose matrices have several tiles, with a helper that takes every matmul."""
    monkeypatch.setattr(tuning, "TILE_VALUES", 1024)  # tiles of 16 rows for 64 inputs
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    helper = model.accel.helper
    assert helper is not None and helper.wait_ready(timeout=60), "the helper did not start"
    monkeypatch.setattr(tuning, "HELPER_MIN_WORK", 0)
    yield model
    model.accel.close()


def decode_logits(model, steps: int = 6) -> list[np.ndarray]:
    seq = model.new_sequence([1, 5, 9, 13])
    out = [model.step([seq])[0]]
    for i in range(steps):
        seq.append(int(np.argmax(out[-1])))
        out.append(model.step([seq])[0])
    return out


@needs_memfd
def test_the_same_floats_with_and_without_the_helper(model_with_helper, monkeypatch):
    model = model_with_helper
    helper = model.accel.helper
    calls = []
    matmul = helper_module.Helper.matmul
    monkeypatch.setattr(helper_module.Helper, "matmul", lambda self, i, x: calls.append(i) or matmul(self, i, x))
    with_helper = decode_logits(model)
    embeddings_only = model.weights.token_embd if model.weights.output is not model.weights.token_embd else None
    multiplied = {i for i, w in enumerate(helper.weights) if embeddings_only is None or w is not embeddings_only.plain}
    assert set(calls) == multiplied  # every quantized matrix went through the helper
    monkeypatch.setattr(tuning, "HELPER_MIN_WORK", 1 << 62)  # every matmul computed here
    calls.clear()
    alone = decode_logits(model)
    assert not calls
    for a, b in zip(with_helper, alone):
        np.testing.assert_array_equal(a, b)


def widest_matmul_alone(helper, rows: int, seed: int):
    """The helper's number of the matrix of the most tiles, an x, and x @ W.T by the plain kernel."""
    i = max(range(len(helper.weights)), key=lambda i: helper.weights[i].n_tiles)
    w = helper.weights[i]
    x = np.random.default_rng(seed).random((rows, w.shape[1])).astype(np.float32)
    return i, x, w.matmul(x)


def read_late_answer(helper) -> None:
    """Wait (bounded) until the helper's late answer is read."""
    def answered():
        if helper._owed_since is None:
            return True
        helper._idle()
        return False

    wait_until_sync(answered, "the helper's answer", seconds=30, every=0.01)


@needs_memfd
def test_a_helper_that_is_behind_costs_no_wait(model_with_helper, monkeypatch):
    """A helper that does not run (stopped here, as another process on its core would
    delay it) costs no wait: its tiles are taken back, the next matmuls are computed
    without it until it answers, and its late answer claims none of the tiles."""
    monkeypatch.setattr(tuning, "HELPER_TIMEOUT", 600.0)
    monkeypatch.setattr(tuning, "HELPER_REST", 0.0)  # no rest after it, to see it help again
    helper = model_with_helper.accel.helper
    i, x, alone = widest_matmul_alone(helper, 2, seed=0)
    n_tiles = helper.weights[i].n_tiles
    assert n_tiles >= 4
    split = min(n_tiles - 1, max(1, round(n_tiles * (1.0 - helper.share))))  # as matmul cuts it
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with_helper = helper.matmul(i, x)
        assert time.monotonic() - started < 60  # not the 600 s the helper could owe it
        assert helper.matmul(i, x) is None  # it owes an answer: the next one is computed alone
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    np.testing.assert_array_equal(with_helper, alone)
    read_late_answer(helper)
    assert helper.claims[helper_module._TAKEN_FROM] == split  # every tile of the helper's taken back
    assert helper.claims[helper_module._HELPER_NEXT] == split  # and it computed none
    assert helper.alive
    np.testing.assert_array_equal(helper.matmul(i, x), alone)  # it helps again


@needs_memfd
def test_tiles_a_stopped_helper_holds_are_computed_in_a_buffer_of_our_own(model_with_helper, monkeypatch):
    """The tiles a helper claimed and did not answer for within the grace are computed
    by the model's process, into its own buffer: the helper writes them into the shared
    one when it runs again, which must change nothing the model returned."""
    monkeypatch.setattr(tuning, "HELPER_REST", 0.0)
    helper = model_with_helper.accel.helper
    i, x, alone = widest_matmul_alone(helper, 2, seed=1)
    helper.share = 0.9
    split = min(helper.weights[i].n_tiles - 1, max(1, round(helper.weights[i].n_tiles * 0.1)))  # as matmul cuts it
    take_back = helper_module.Helper._take_back

    def helper_holds_two_tiles(self, w, xs, ys, split):  # as if it had claimed split and split + 1
        self.claims[helper_module._HELPER_NEXT] = split + 2
        return take_back(self, w, xs, ys, split)

    monkeypatch.setattr(helper_module.Helper, "_take_back", helper_holds_two_tiles)
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        with_helper = helper.matmul(i, x)
        np.testing.assert_array_equal(with_helper, alone)
        assert helper.claims[helper_module._TAKEN_FROM] == split + 2  # the tiles it did not "hold" taken back
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    read_late_answer(helper)  # it has now written its two tiles into the shared buffer
    assert helper.claims[helper_module._HELPER_NEXT] == split + 2
    np.testing.assert_array_equal(with_helper, alone)
    monkeypatch.setattr(helper_module.Helper, "_take_back", take_back)
    np.testing.assert_array_equal(helper.matmul(i, x), alone)


@needs_memfd
def test_after_a_late_answer_the_next_matmuls_are_computed_without_the_helper(model_with_helper, monkeypatch):
    monkeypatch.setattr(tuning, "HELPER_REST", 3600.0)
    monkeypatch.setattr(tuning, "ASLEEP_AFTER", 3600.0)  # it counts as awake: late is late
    helper = model_with_helper.accel.helper
    i, x, alone = widest_matmul_alone(helper, 1, seed=2)
    np.testing.assert_array_equal(helper.matmul(i, x), alone)
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        np.testing.assert_array_equal(helper.matmul(i, x), alone)  # the helper late
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    read_late_answer(helper)
    assert helper.alive and helper.matmul(i, x) is None  # answered, but resting: computed alone


def test_a_rest_after_a_late_answer_doubles_when_the_helper_is_late_again_soon_after():
    rest, most = tuning.HELPER_REST, tuning.HELPER_REST_MAX
    rests = Rests()
    rests.answered(0.0)
    rests.late(sent_at=0.0, now=0.001)  # awake when the command came
    assert rests.resting(0.001) and rests.resting(0.001 + rest * 0.99) and not rests.resting(0.001 + rest)
    now = 0.001 + rest * 1.5  # late again, one answer after the last time
    rests.answered(now - 0.0001)
    rests.late(sent_at=now - 0.0001, now=now)
    assert rests.rest == 2 * rest and rests.resting(now + rest * 1.5) and not rests.resting(now + 2 * rest)
    for _ in range(40):  # late again and again: the rest grows to the most
        now += rests.rest
        rests.answered(now)
        rests.late(sent_at=now, now=now)
    assert rests.rest == most
    for _ in range(4 * tuning.HELPER_AGAIN_ANSWERS):  # late again after many answers: a short rest again
        now += 0.0001
        rests.answered(now)
    rests.late(sent_at=now, now=now)
    assert rests.rest == rest


def test_a_helper_late_now_and_then_rests_briefly_however_long_its_last_rest():
    """Clients on the same machine take the helper's core now and then: late again
    soon after its longest rest, but after many answers (four times as many as a held
    core would give, on average), it starts from a short rest."""
    rests = Rests()
    now = 0.0
    for _ in range(40):  # late at once after each rest: the rest grows to the most
        rests.answered(now)
        rests.late(sent_at=now, now=now)
        now += rests.rest
    assert rests.rest == tuning.HELPER_REST_MAX
    for _ in range(4 * tuning.HELPER_AGAIN_ANSWERS):  # answers a millisecond apart ...
        now += 0.001
        rests.answered(now)
    rests.late(sent_at=now, now=now)  # ... then late, well within a rest's length
    assert rests.rest == tuning.HELPER_REST


def test_a_helper_late_after_sleeping_does_not_rest_unless_it_is_late_again_at_once():
    """A helper without a command for ASLEEP_AFTER sleeps on its pipe and may take long to
    wake: late then says nothing of its core. Late again as soon as it is awake: its core
    is held, and the rest doubles as if both had been late answers."""
    rest = tuning.HELPER_REST
    rests = Rests()
    rests.answered(0.0)
    rests.late(sent_at=0.0, now=0.0)  # awake: a rest
    now = 10.0
    assert rests.asleep(sent_at=now)
    rests.late(sent_at=now, now=now)  # after sleeping: no rest
    assert not rests.resting(now)
    rests.answered(now + 0.0001)
    rests.late(sent_at=now + 0.0002, now=now + 0.0003)  # awake, late again at once
    assert rests.rest == min(2 * rest, tuning.HELPER_REST_MAX)
    assert rests.resting(now + 0.0003 + rest * 1.5)


def test_a_helper_behind_in_a_halved_step_rests_even_after_sleeping():
    """A halved step's helper that takes twice our half is not waking up (that takes a
    millisecond at most): its core is held, however long it had no command."""
    rests = Rests()
    rests.answered(0.0)
    now = 10.0
    assert rests.asleep(sent_at=now)
    rests.behind(now)
    assert rests.rest == tuning.HELPER_REST and rests.resting(now)


def test_the_grace_for_the_last_tile_is_about_one_of_our_tiles():
    assert grace(0.0) == tuning.HELPER_GRACE  # tiny tiles: at least HELPER_GRACE
    assert grace(0.0004) == tuning.GRACE_TILES * 0.0004
    assert grace(0.02) == tuning.HELPER_GRACE_MAX  # as if we had been descheduled: at most HELPER_GRACE_MAX


def small_quantized_weight(monkeypatch, n_out: int = 60, mins: bool = True) -> quants.QuantWeight:
    monkeypatch.setattr(tuning, "TILE_VALUES", 1024)
    rng = np.random.default_rng(0)
    return quants.QuantWeight.from_rows(rng.integers(-8, 8, (n_out, 64)).astype(np.int8),
                                        rng.random((2, n_out)).astype(np.float32),
                                        rng.random((2, n_out)).astype(np.float32) if mins else None)


def claims(taken_from: int) -> np.ndarray:
    out = np.zeros(2, np.int64)
    out[helper_module._TAKEN_FROM] = taken_from
    return out


def test_the_helper_stops_at_the_first_tile_taken_back(monkeypatch):
    w = small_quantized_weight(monkeypatch)
    assert w.n_tiles == 4
    x = np.random.default_rng(1).random((3, 64)).astype(np.float32)
    expected = w.padded_output(3)
    w._decode_tiles(x, expected, 0, 4)
    got = np.full_like(expected, np.nan)
    shared = claims(taken_from=3)
    assert helper_module._helper_tiles(w, x, got, 1, 4, {}, shared) == 3
    rows = w.tile_rows
    np.testing.assert_array_equal(got[:, rows: 3 * rows], expected[:, rows: 3 * rows])
    assert np.isnan(got[:, : rows]).all() and np.isnan(got[:, 3 * rows:]).all()
    got[...] = np.nan
    assert helper_module._helper_tiles(w, x, got, 1, 4, {}, claims(taken_from=1)) == 1  # none taken
    assert np.isnan(got).all()


def test_tiles_converted_ahead_give_the_same_floats(monkeypatch):
    w = small_quantized_weight(monkeypatch)
    x = np.random.default_rng(2).random((3, 64)).astype(np.float32)
    converted = {}
    for b in (1, 3):  # in buffers bigger than a tile, as the helper's are
        converted[b] = np.full(w.shape[1] * w.tile_rows + 100, np.nan, np.float32)
        converted[b][: w.shape[1] * w.tile_rows] = w.codes[b].ravel()
    expected, got = np.zeros((2, 3, w.n_tiles * w.tile_rows), np.float32)
    w._decode_tiles(x, expected, 1, 4)
    assert helper_module._helper_tiles(w, x, got, 1, 4, converted, claims(taken_from=4)) == 4
    np.testing.assert_array_equal(got, expected)
    converted[3][:] = np.nan  # and they are what tile 3 is computed from
    helper_module._helper_tiles(w, x, got, 1, 4, converted, claims(taken_from=4))
    rows = w.tile_rows
    assert np.isnan(got[:, 3 * rows:]).all() and not np.isnan(got[:, : 3 * rows]).any()


def test_the_helper_converts_ahead_the_tiles_of_the_matmul_that_came_next_last_time(monkeypatch):
    monkeypatch.setattr(tuning, "TILE_VALUES", 1 << 17)  # tiles of 2048 rows for 64 inputs
    rng = np.random.default_rng(0)
    weights = [quants.QuantWeight.from_rows(rng.integers(-8, 8, (n, 64)).astype(np.int8),
                                            rng.random((2, n)).astype(np.float32), None) for n in (4000, 6000)]
    ahead = helper_module._ConvertAhead(weights, n_buffers=2)
    assert [w.n_tiles for w in weights] == [2, 3]

    def matmul(i, b0, b1):
        converted = ahead.received(i, b0, b1)
        ahead.plan(i)
        return converted

    assert matmul(0, 1, 2) == {} and not ahead.convert_one()  # nothing seen yet: nothing to guess
    assert matmul(1, 1, 3) == {} and not ahead.convert_one()  # 1 came after 0, but what comes after 1?
    assert matmul(0, 1, 2) == {}                              # 0 came after 1: expect 1, tiles 1:3, next
    assert ahead.convert_one() and ahead.convert_one() and not ahead.convert_one()  # two buffers
    converted = ahead.received(1, 0, 3)                       # the share moved: it gets tile 0 too
    assert sorted(converted) == [1, 2]
    for b in (1, 2):
        tile = converted[b][: 64 * weights[1].tile_rows].reshape(64, -1)
        np.testing.assert_array_equal(tile, weights[1].codes[b])
    ahead.plan(1)
    assert ahead.target == 0 and ahead.todo == [1]             # after 1 comes 0: its tile 1
    assert ahead.received(1, 0, 3) == {}                      # a wrong guess converts nothing for 1


@needs_memfd
def test_a_killed_helper_is_replaced_by_the_model_itself(model_with_helper):
    model = model_with_helper
    before = decode_logits(model)
    model.accel.helper.process.kill()
    model.accel.helper.process.wait(timeout=30)
    after = decode_logits(model)
    assert not model.accel.helper.alive
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


@needs_memfd
def test_a_ctrl_c_at_the_terminal_does_not_reach_the_helper(model_with_helper):
    # the terminal signals its foreground process group; the helper has a session of its own
    assert os.getpgid(model_with_helper.accel.helper.process.pid) != os.getpgid(0)
    assert model_with_helper.accel.helper.alive


@needs_memfd
def test_closing_the_accelerator_stops_the_helper_and_the_model_still_works(model_with_helper):
    process = model_with_helper.accel.helper.process
    before = decode_logits(model_with_helper)
    model_with_helper.accel.close()
    assert process.wait(timeout=10) == 0
    model_with_helper.accel.close()  # idempotent
    after = decode_logits(model_with_helper)  # on the calling thread alone
    for a, b in zip(before, after):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(a).max())


@needs_memfd
def test_no_helper_for_small_models_or_when_turned_off(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    monkeypatch.setenv("LMSP_THREADS", "2")
    monkeypatch.delenv("LMSP_HELPER", raising=False)
    model = load_model(path)
    assert model.accel.helper is None  # far below HELPER_MIN_VALUES
    model.accel.close()
    monkeypatch.setattr(tuning, "HELPER_MIN_VALUES", 0)
    monkeypatch.setenv("LMSP_HELPER", "0")
    model = load_model(path)
    assert model.accel.helper is None
    model.accel.close()


@needs_memfd
def test_the_helper_runs_this_engine_whatever_the_working_directory(tmp_path, monkeypatch):
    """`python -c` puts the working directory first on the path: an `engine` package there
    (a user's project, another checkout) must not be the one the helper imports."""
    decoy = tmp_path / "workdir" / "engine"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the wrong engine package')\n")
    monkeypatch.chdir(decoy.parent)
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    try:
        assert model.accel.helper.wait_ready(timeout=60), "the helper did not start"
    finally:
        model.accel.close()


@needs_memfd
def test_a_helper_whose_model_is_gone_exits_quietly(tmp_path, monkeypatch, capfd):
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    process = model.accel.helper.process
    model.accel.close()  # at once: before the helper has said it is ready, most likely
    assert process.wait(timeout=30) == 0
    assert "Traceback" not in capfd.readouterr().err


@needs_memfd
def test_a_helper_that_cannot_start_leaves_no_descriptor_open(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    monkeypatch.setenv("LMSP_THREADS", "1")
    weights = accel.quantized_matrices(load_model(path).weights)
    monkeypatch.setattr(tuning, "HELPER_MIN_VALUES", 0)
    monkeypatch.delenv("LMSP_HELPER", raising=False)
    real_pipe = os.pipe
    pipes = []

    def one_pipe_then_none():  # as when the process runs out of descriptors half-way
        if pipes:
            raise OSError(errno.EMFILE, "Too many open files")
        pipes.append(real_pipe())
        return pipes[-1]

    def open_descriptors() -> dict[str, str]:
        return {fd: os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
                if os.path.exists(f"/proc/self/fd/{fd}")}

    before = open_descriptors()
    monkeypatch.setattr(os, "pipe", one_pipe_then_none)
    assert helper_module.start(weights, n_threads=2) is None  # the model works without one
    monkeypatch.setattr(os, "pipe", real_pipe)
    new = [link for fd, link in open_descriptors().items() if fd not in before]
    assert pipes and new == ["/memfd:lmsp-weights (deleted)"]  # the weights' mapping (mmap's own copy)
