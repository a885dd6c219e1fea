"""The helper process (engine/helper.py): the same floats with it or without it, and no harm when it dies."""

from __future__ import annotations

import errno
import os
import signal
import sys
import time

import numpy as np
import pytest

from engine import helper as helper_module
from engine import quants, threads
from engine.model import load_model, quantized_matrices
from tiny import write_tiny_model

pytestmark = pytest.mark.skipif(sys.platform != "linux" or not hasattr(os, "memfd_create"),
                                reason="the helper process needs Linux's memfd")


def tiny_model_starting_a_helper(tmp_path, monkeypatch):
    """A tiny model loaded as a big one would be: on two threads, with a helper starting."""
    monkeypatch.setattr(helper_module, "HELPER_MIN_VALUES", 0)
    monkeypatch.delenv("LMSP_HELPER", raising=False)
    threads.set_num_threads(2)
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    model = load_model(path)
    threads.set_num_threads(None)
    return model


@pytest.fixture
def model_with_helper(tmp_path, monkeypatch):
    """A tiny model whose matrices have several tiles, with a helper that takes every matmul."""
    monkeypatch.setattr(quants, "TILE_VALUES", 1024)  # tiles of 16 rows for 64 inputs
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    helper = model.helper
    assert helper is not None
    helper.min_work = 0
    deadline = time.monotonic() + 60
    while not helper.alive:
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.05)
    yield model
    helper.close()


def decode_logits(model, steps: int = 6) -> list[np.ndarray]:
    seq = model.new_sequence([1, 5, 9, 13])
    out = [model.step([seq])[0]]
    for i in range(steps):
        seq.append(int(np.argmax(out[-1])))
        out.append(model.step([seq])[0])
    return out


def test_the_same_floats_with_and_without_the_helper(model_with_helper, monkeypatch):
    model = model_with_helper
    calls = []
    matmul = helper_module.Helper.matmul
    monkeypatch.setattr(helper_module.Helper, "matmul", lambda self, w, x: calls.append(w) or matmul(self, w, x))
    with_helper = decode_logits(model)
    embeddings_only = model.weights.token_embd if model.weights.output is not model.weights.token_embd else None
    multiplied = {id(w) for w in quantized_matrices(model.weights) if w is not embeddings_only}
    assert {id(w) for w in calls} == multiplied  # every quantized matrix went through the helper
    model.helper.min_work = 1 << 62  # every matmul computed here
    alone = decode_logits(model)
    for a, b in zip(with_helper, alone):
        np.testing.assert_array_equal(a, b)


def widest_matmul_alone(model, rows: int, seed: int):
    """The matrix of the most tiles, an x, and x @ W.T computed without the helper."""
    helper = model.helper
    w = max(quantized_matrices(model.weights), key=lambda w: w.n_tiles)
    x = np.random.default_rng(seed).random((rows, w.shape[1])).astype(np.float32)
    helper.min_work = 1 << 62
    alone = w.matmul(x)
    helper.min_work = 0
    return w, x, alone


def wait_until_idle(helper) -> None:
    deadline = time.monotonic() + 10
    while not helper._idle():
        assert time.monotonic() < deadline, "the helper did not answer"
        time.sleep(0.01)


def test_a_helper_that_is_behind_costs_no_wait(model_with_helper):
    """A helper that does not run (stopped here, as another process on its core would
    delay it) costs no wait: its tiles are taken back, the next matmuls are computed
    without it until it answers, and its late answer claims none of the tiles."""
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 2, seed=0)
    assert w.n_tiles >= 4
    split = min(w.n_tiles - 1, max(1, round(w.n_tiles * (1.0 - helper.share))))  # as matmul cuts it
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        started = time.monotonic()
        with_helper = helper.matmul(w, x)
        assert time.monotonic() - started < 0.2  # it was 30 s (HELPER_TIMEOUT) before
        assert helper.matmul(w, x) is None  # it owes an answer: the next one is computed alone
        np.testing.assert_array_equal(w.matmul(x), alone)
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    np.testing.assert_array_equal(with_helper, alone)
    wait_until_idle(helper)
    assert helper.claims[helper_module._TAKEN_FROM] == split  # every tile of the helper's taken back
    assert helper.claims[helper_module._HELPER_NEXT] == split  # and it computed none
    assert helper.alive
    np.testing.assert_array_equal(helper.matmul(w, x), alone)  # it helps again


def test_tiles_a_stopped_helper_holds_are_computed_in_a_buffer_of_our_own(model_with_helper, monkeypatch):
    """The tiles a helper claimed and did not answer for within the grace are computed
    by the model's process, into its own buffer: the helper writes them into the shared
    one when it runs again, which must change nothing the model returned."""
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 2, seed=1)
    helper.share = 0.9
    split = min(w.n_tiles - 1, max(1, round(w.n_tiles * 0.1)))  # as matmul cuts it
    take_back = helper_module.Helper._take_back

    def helper_holds_two_tiles(self, w, xs, ys, split):  # as if it had claimed split and split + 1
        self.claims[helper_module._HELPER_NEXT] = split + 2
        return take_back(self, w, xs, ys, split)

    monkeypatch.setattr(helper_module.Helper, "_take_back", helper_holds_two_tiles)
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        with_helper = helper.matmul(w, x)
        np.testing.assert_array_equal(with_helper, alone)
        assert helper.claims[helper_module._TAKEN_FROM] == split + 2  # the tiles it did not "hold" taken back
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    wait_until_idle(helper)  # it has now written its two tiles into the shared buffer
    assert helper.claims[helper_module._HELPER_NEXT] == split + 2
    np.testing.assert_array_equal(with_helper, alone)
    monkeypatch.setattr(helper_module.Helper, "_take_back", take_back)
    np.testing.assert_array_equal(helper.matmul(w, x), alone)


def late_once(helper, w, x, alone) -> None:
    """A matmul the helper is late for (stopped meanwhile), then its late answer read."""
    os.kill(helper.process.pid, signal.SIGSTOP)
    try:
        np.testing.assert_array_equal(helper.matmul(w, x), alone)  # the helper late
    finally:
        os.kill(helper.process.pid, signal.SIGCONT)
    deadline = time.monotonic() + 10
    while helper._owed_since is not None:  # its late answer read
        assert time.monotonic() < deadline, "the helper did not answer"
        helper._idle()
        time.sleep(0.01)


def test_after_a_late_answer_the_model_rests_from_the_helper(model_with_helper, monkeypatch):
    """A helper late once is left alone for HELPER_REST, twice as long when it is late again
    soon after: the process that holds its core may go on holding it."""
    monkeypatch.setattr(helper_module, "HELPER_REST", 0.5)
    monkeypatch.setattr(helper_module, "ASLEEP_AFTER", 60.0)  # it counts as awake: late is late
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 1, seed=2)
    np.testing.assert_array_equal(helper.matmul(w, x), alone)  # an answer read: it is awake
    late_once(helper, w, x, alone)
    assert helper.matmul(w, x) is None  # answered, but resting: computed alone
    time.sleep(0.55)
    late_once(helper, w, x, alone)  # late again soon after its rest
    assert helper.matmul(w, x) is None
    time.sleep(0.55)
    assert helper.matmul(w, x) is None  # twice as long this time
    time.sleep(0.5)
    np.testing.assert_array_equal(helper.matmul(w, x), alone)  # it helps again


def test_a_helper_late_after_sleeping_is_no_reason_to_rest(model_with_helper, monkeypatch):
    """A helper without a command for ASLEEP_AFTER is taken to sleep, and may take long to
    wake: a late answer then says nothing of its core, so the next matmul has its help again."""
    monkeypatch.setattr(helper_module, "HELPER_REST", 60.0)  # a rest would show
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 1, seed=3)
    time.sleep(0.01)  # past ASLEEP_AFTER: asleep
    late_once(helper, w, x, alone)
    np.testing.assert_array_equal(helper.matmul(w, x), alone)  # not resting: helped


def test_a_helper_late_after_sleeping_and_again_at_once_rests_longer(model_with_helper, monkeypatch):
    """Late after sleeping, then late again as soon as it is awake: its core is held, and
    the rest doubles as if both had been late answers (the first made it rest no longer)."""
    monkeypatch.setattr(helper_module, "HELPER_REST", 0.5)
    monkeypatch.setattr(helper_module, "ASLEEP_AFTER", 60.0)  # awake
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 1, seed=5)
    np.testing.assert_array_equal(helper.matmul(w, x), alone)  # an answer read
    late_once(helper, w, x, alone)  # a rest of 0.5 s
    time.sleep(1.05)  # past twice that: the next late answer alone would start again at 0.5 s
    monkeypatch.setattr(helper_module, "ASLEEP_AFTER", 0.0)  # asleep: no rest for this one
    late_once(helper, w, x, alone)
    monkeypatch.setattr(helper_module, "ASLEEP_AFTER", 60.0)
    late_once(helper, w, x, alone)  # late again at once: 1 s
    time.sleep(0.55)
    assert helper.matmul(w, x) is None


def test_the_grace_for_the_last_tile_is_about_a_tile_of_this_matmul(model_with_helper, monkeypatch):
    """The model waits for the helper's last tile about as long as it takes itself to
    compute a tile of this matmul, within HELPER_GRACE and HELPER_GRACE_MAX."""
    helper = model_with_helper.helper
    w, x, alone = widest_matmul_alone(model_with_helper, 1, seed=4)
    graces = []
    answered = helper_module.Helper._answered

    def answered_noting_grace(self, sent_at, grace, asleep):
        graces.append(grace)
        return answered(self, sent_at, grace, asleep)

    monkeypatch.setattr(helper_module.Helper, "_answered", answered_noting_grace)
    decode_tiles = quants.QuantWeight._decode_tiles
    tile_seconds = 0.0

    def slow_tiles(self, x, y, b0, b1, *args, **kwargs):  # tile_seconds a tile, in this process only
        time.sleep(tile_seconds * (b1 - b0))
        return decode_tiles(self, x, y, b0, b1, *args, **kwargs)

    np.testing.assert_array_equal(helper.matmul(w, x), alone)
    assert graces[-1] == helper_module.HELPER_GRACE  # tiles this small take less than it
    monkeypatch.setattr(quants.QuantWeight, "_decode_tiles", slow_tiles)
    tile_seconds = 0.0004
    np.testing.assert_array_equal(helper.matmul(w, x), alone)
    assert graces[-1] >= min(helper_module.HELPER_GRACE_MAX, helper_module.GRACE_TILES * tile_seconds)
    tile_seconds = 0.02  # as if we had been descheduled
    np.testing.assert_array_equal(helper.matmul(w, x), alone)
    assert graces[-1] == helper_module.HELPER_GRACE_MAX


def test_tiles_refused_by_the_claim_are_left_alone(monkeypatch):
    monkeypatch.setattr(quants, "TILE_VALUES", 1024)
    rng = np.random.default_rng(0)
    w = quants.QuantWeight.from_rows(rng.integers(-8, 8, (60, 64)).astype(np.int8),
                                     rng.random((2, 60)).astype(np.float32), rng.random((2, 60)).astype(np.float32))
    x = rng.random((3, 64)).astype(np.float32)
    expected = np.zeros((3, w.n_tiles * w.tile_rows), np.float32)
    w._decode_tiles(x, expected, 0, 4)
    got = np.full_like(expected, np.nan)
    asked = []
    assert w._decode_tiles(x, got, 1, 4, claim=lambda b: asked.append(b) or b < 3) == 3
    assert asked == [1, 2, 3]
    rows = w.tile_rows
    np.testing.assert_array_equal(got[:, rows: 3 * rows], expected[:, rows: 3 * rows])
    assert np.isnan(got[:, : rows]).all() and np.isnan(got[:, 3 * rows:]).all()
    assert w._decode_tiles(x, got, 1, 4, claim=lambda b: False) == 1  # none taken: nothing written


def test_tiles_converted_ahead_give_the_same_floats(monkeypatch):
    monkeypatch.setattr(quants, "TILE_VALUES", 1024)
    rng = np.random.default_rng(0)
    w = quants.QuantWeight.from_rows(rng.integers(-8, 8, (60, 64)).astype(np.int8),
                                     rng.random((2, 60)).astype(np.float32), rng.random((2, 60)).astype(np.float32))
    assert w.n_tiles == 4
    x = rng.random((3, 64)).astype(np.float32)
    converted = {}
    for b in (1, 3):  # in buffers bigger than a tile, as the helper's are
        converted[b] = np.full(w.shape[1] * w.tile_rows + 100, np.nan, np.float32)
        converted[b][: w.shape[1] * w.tile_rows] = w.codes[b].ravel()
    expected, got = (np.zeros((3, w.n_tiles * w.tile_rows), np.float32) for _ in range(2))
    w._decode_tiles(x, expected, 1, 4)
    w._decode_tiles(x, got, 1, 4, converted)
    np.testing.assert_array_equal(got, expected)
    converted[3][:] = np.nan  # and they are what tile 3 is computed from
    w._decode_tiles(x, got, 1, 4, converted)
    rows = w.tile_rows
    assert np.isnan(got[:, 3 * rows:]).all() and not np.isnan(got[:, : 3 * rows]).any()


def test_the_helper_converts_ahead_the_tiles_of_the_matmul_that_came_next_last_time(monkeypatch):
    monkeypatch.setattr(quants, "TILE_VALUES", 1 << 17)  # tiles of 2048 rows for 64 inputs
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


def test_a_killed_helper_is_replaced_by_the_model_itself(model_with_helper):
    model = model_with_helper
    before = decode_logits(model)
    model.helper.process.kill()
    model.helper.process.wait()
    after = decode_logits(model)
    assert not model.helper.alive
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def test_a_ctrl_c_at_the_terminal_does_not_reach_the_helper(model_with_helper):
    # the terminal signals its foreground process group; the helper has a session of its own
    assert os.getpgid(model_with_helper.helper.process.pid) != os.getpgid(0)
    assert model_with_helper.helper.alive


def test_the_helper_exits_when_closed(model_with_helper):
    process = model_with_helper.helper.process
    model_with_helper.helper.close()
    assert process.wait(timeout=10) == 0
    assert decode_logits(model_with_helper)  # and the model still works


def test_no_helper_for_small_models_or_when_turned_off(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    assert load_model(path).helper is None  # far below HELPER_MIN_VALUES
    monkeypatch.setattr(helper_module, "HELPER_MIN_VALUES", 0)
    monkeypatch.setenv("LMSP_HELPER", "0")
    threads.set_num_threads(2)
    try:
        assert load_model(path).helper is None
    finally:
        threads.set_num_threads(None)


def test_the_helper_runs_this_engine_whatever_the_working_directory(tmp_path, monkeypatch):
    """`python -c` puts the working directory first on the path: an `engine` package there
    (a user's project, another checkout) must not be the one the helper imports."""
    decoy = tmp_path / "workdir" / "engine"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text("raise ImportError('the wrong engine package')\n")
    monkeypatch.chdir(decoy.parent)
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    deadline = time.monotonic() + 60
    while not model.helper.alive:
        assert model.helper.process.poll() is None, "the helper died"
        assert time.monotonic() < deadline, "the helper did not start"
        time.sleep(0.05)
    model.helper.close()


def test_a_helper_whose_model_is_gone_exits_quietly(tmp_path, monkeypatch, capfd):
    model = tiny_model_starting_a_helper(tmp_path, monkeypatch)
    process = model.helper.process
    model.helper.close()  # at once: before the helper has said it is ready, most likely
    assert process.wait(timeout=30) == 0
    assert "Traceback" not in capfd.readouterr().err


def test_a_helper_that_cannot_start_leaves_no_descriptor_open(tmp_path, monkeypatch):
    path = tmp_path / "tiny.gguf"
    write_tiny_model(path, "llama")
    weights = quantized_matrices(load_model(path).weights)
    monkeypatch.setattr(helper_module, "HELPER_MIN_VALUES", 0)
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
