"""A helper process that computes part of every decode matmul.

Why a process and not one more thread: numpy releases the GIL inside its loops, but a
decode matmul is many short numpy calls (per tile: one int8 -> float32 conversion and
one small batched matmul, ~10 us each), and every return from numpy has to take the
GIL back. Two threads splitting such a matmul spend their time handing the GIL to each
other; a second process has a GIL of its own.

So on Linux, with two or more threads configured, `start` moves a model's quantized
weights into shared memory (a memfd: no file, no /dev/shm size limit) and starts a
Python process running `serve`, which maps the same pages read-only. For a decode
matmul (`Helper.matmul`):

    model's thread                              helper process
    x -> shared I/O area
    "weight i, n rows, tiles b0:b1" -> pipe ->  reads the command
    computes tiles 0:b0 into the I/O area       computes tiles b0:b1 into the I/O area,
    computes the mins' part (formats with       claiming each one first, and stops at
      mins: one product over all columns)         the first one taken back (_helper_tiles)
    takes back tiles from b1 down while the
      helper is behind (_take_back)
    waits on the answer pipe, briefly   <-      writes one byte
    copies y out of the I/O area                converts ahead the first tiles of the
    runs the ops up to the next matmul          matmul it expects next (_ConvertAhead)

Both sides compute a tile with the same numpy calls as QuantWeight._decode_tiles
(engine/quants.py), so the floats are those of the plain kernel however the tiles were
shared. Nothing depends on the helper being there: until it has said it is ready, or
once it has died, the model computes every tile itself. Nor does the model wait for a
helper whose core another process took: when the helper's last tile is not answered
within a grace (about one tile's time), the model computes the helper's tiles itself, in
its own buffer (the helper may still write the I/O area), and computes the next matmuls
alone for a while (`Rests`); one that has not answered within HELPER_TIMEOUT is killed.
The helper exits when its command pipe closes: `close()`, the model dropped, or this
process ended, however it ended. The constants are in engine/tuning.py's table.

A decoder's helper also steps some of the sequences of a big decode batch whole, over
KV caches both processes map (`step_beside`, and `HelperSteps` in the helper): halves.py,
the next to read, says how.
A cache's memfd goes to the helper on a socket, beside the command that names it.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import weakref
from typing import Callable

import numpy as np

from engine import architectures, tuning
from engine.architectures import Batch, Hyperparameters, StepAbandoned, Weights
from engine.kv_cache import KVCache, Sequence
from engine.quants import QuantWeight, scratch


# the commands on the pipe: a kind and four numbers, which say
_COMMAND = struct.Struct("<c4q")
_MATMUL = b"m"  # a decode matmul's tiles: weight index, rows of x, first and end tile of the helper
_MAP = b"k"     # a KV cache's block to map (halves.py): its number and bytes; its memfd is on the socket
_FORGET = b"f"  # a block the model's process let go of: its number
_STEP = b"s"    # a forward step over some sequences (halves.py): the bytes of its pickled spec, which follow
_READY, _DONE = b"r", b"d"
# the claims at the start of the I/O area (int64): one past the helper's latest tile, the
# first of the tiles the model's process took back from the end (Helper._take_back), and
# whether the model's half of a halved step was abandoned (the helper then stops too)
_HELPER_NEXT, _TAKEN_FROM, _ABANDON = 0, 1, 2
_ALIGN = 64
_HELPER_MAIN = "import sys; sys.path.insert(0, sys.argv[1]); from engine.accel.helper import serve; serve()"


def start(weights: list[QuantWeight], n_threads: int,
          model: tuple[Hyperparameters, Weights] | None = None) -> Helper | None:
    """A helper for a model with these quantized weights, or None where it would not pay;
    given the model's plain weights and its hyperparameters, it can step sequences too.

    Only on Linux (memfd), with at least two threads configured, for models of
    HELPER_MIN_VALUES weights or more, and not with `LMSP_HELPER=0`. A helper that
    cannot be started is no error: the model computes everything itself.
    """
    if not (sys.platform == "linux" and hasattr(os, "memfd_create") and n_threads >= 2 and weights
            and os.environ.get("LMSP_HELPER", "1") != "0"
            and sum(w.shape[0] * w.shape[1] for w in weights) >= tuning.HELPER_MIN_VALUES):
        return None
    try:
        return Helper(weights, model)
    except OSError:
        return None


class Rests:
    """When the model leaves the helper alone after it was late: the times, given, decide.

    A late helper's core is most likely held by another process, which may go on
    holding it: trying the helper at every matmul would then cost a grace and a redone
    share each time. So the model rests from it for HELPER_REST, twice as long each
    time it is late again while it has answered fewer than HELPER_AGAIN_ANSWERS
    between two late answers, on average (halving the weight of the past at each), up
    to HELPER_REST_MAX. Answers, not seconds: on a machine that also runs the clients,
    their bursts take the helper's core now and then, and it pays to go on with it as
    long as it helps many matmuls between two late ones; a core held for good makes it
    late again within a few. A helper that had no command for ASLEEP_AFTER sleeps on
    its pipe and may take long to wake (on a VM whose idle core went back to the
    host): late then says nothing of its core, so it is no reason to rest; but it
    counts as the last late answer, so that a helper late again at once rests longer.
    """

    def __init__(self) -> None:
        self.rest = 0.0                  # seconds of the current (or last) rest
        self.late_at = -math.inf         # when the helper was last late (awake)
        self.answers_since_late = 0      # answers read since it was last late, awake or not
        # their average, from twice the bound: a first late answer never doubles a rest
        self.answers_between_lates = 2.0 * tuning.HELPER_AGAIN_ANSWERS
        self.answer_read_at = -math.inf  # when its latest answer was read

    def answered(self, now: float) -> None:
        self.answer_read_at = now
        # capped: an hour on time must not outweigh a held core's first late answers
        self.answers_since_late = min(self.answers_since_late + 1, 4 * tuning.HELPER_AGAIN_ANSWERS)

    def asleep(self, sent_at: float) -> bool:
        """Whether a command sent at sent_at found the helper asleep."""
        return sent_at - self.answer_read_at > tuning.ASLEEP_AFTER

    def late(self, sent_at: float, now: float) -> None:
        """The answer to the command sent at sent_at was late (noticed at now)."""
        if self.asleep(sent_at):
            self.answers_since_late = 0
            return
        self.behind(now)

    def behind(self, now: float) -> None:
        """The helper was late while awake (noticed at now): rest, longer if it was late
        again soon. A halved step's helper late by as long as our half is awake: waking
        takes a millisecond at most."""
        self.answers_between_lates = (self.answers_between_lates + self.answers_since_late) / 2
        again = self.answers_between_lates < tuning.HELPER_AGAIN_ANSWERS
        self.rest = min(tuning.HELPER_REST_MAX, 2 * self.rest) if again else tuning.HELPER_REST
        self.late_at = now
        self.answers_since_late = 0

    def resting(self, now: float) -> bool:
        return now < self.late_at + self.rest


def grace(tile_seconds: float) -> float:
    """Seconds to wait for the helper's last tile when ours took tile_seconds each.

    When we get there the helper holds at most the one tile it is computing: waiting
    much longer than we would take for that tile is wasted, and a shorter wait gives up
    on a helper merely a little slower this once.
    """
    return min(tuning.HELPER_GRACE_MAX, max(tuning.HELPER_GRACE, tuning.GRACE_TILES * tile_seconds))


class Helper:
    """The model's side of a helper process (see the module docstring).

    `weights[i]` is the matrix that command `i` names; they move into shared memory.
    With `model` (its hyperparameters and plain weights, those among them), the helper
    steps sequences too (`step_beside`, halves.py), their final states in `states`.
    """

    def __init__(self, weights: list[QuantWeight], model: tuple[Hyperparameters, Weights] | None = None):
        child_fds: list[int] = []  # the helper's ends: closed here once it has its copies, or failed to start
        own_fds: list[int] = []    # ours: closed here only if it failed to start
        try:
            weights_fd, weights_size, layout, shared = _share(weights, child_fds)
            self.x_values = tuning.DECODE_MAX_ROWS * max(w.shape[1] for w in weights)
            y_values = tuning.DECODE_MAX_ROWS * max(w.n_tiles * w.tile_rows for w in weights)
            io_size = _ALIGN + 4 * (self.x_values + y_values)
            io_fd = _memfd("lmsp-helper-io", io_size, child_fds)
            self.claims, self.io = _map_io(io_fd, io_size)
            cmd_r, self._cmd = _pipe(child_fds, own_fds)
            self._answers, ans_w = _pipe(own_fds, child_fds)
            # the blocks' memfds go on a socket of their own: a pipe is faster for the commands
            descriptors, their_descriptors = socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)
            own_fds.append(descriptors.detach())
            child_fds.append(descriptors_fd := their_descriptors.detach())
            spec = {"weights": (weights_fd, weights_size, layout), "io": (io_fd, io_size, self.x_values),
                    "commands": cmd_r, "answers": ans_w, "descriptors": descriptors_fd}
            if model is not None:
                d = model[1].output.shape[1]
                states_size = 4 * tuning.HALVES_MAX_ROWS * d
                states_fd = _memfd("lmsp-helper-states", states_size, child_fds)
                self.states = _map_states(states_fd, states_size, d)  # (HALVES_MAX_ROWS, d)
                spec["model"] = (_pickled(model, shared), states_fd, states_size)
            # the helper must run this very code: its package's directory goes first on its
            # path, before the working directory, which `python -c` puts first
            package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
            # in a session of its own: a Ctrl-C at the terminal goes to the model's process,
            # which decides what it means (stop an answer, drain the server); the helper
            # would only die of it, with a traceback. It ends when its command pipe closes.
            self.process = subprocess.Popen(
                [sys.executable, "-c", _HELPER_MAIN, package_root], stdin=subprocess.PIPE,
                pass_fds=child_fds, start_new_session=True)
        except BaseException:
            for fd in own_fds:
                os.close(fd)
            raise
        finally:
            for fd in child_fds:
                os.close(fd)
        self._descriptors = socket.socket(fileno=own_fds[-1])
        self._descriptors.settimeout(tuning.HELPER_TIMEOUT)  # a helper that reads nothing that long is hung
        try:
            with self.process.stdin as stdin:
                pickle.dump(spec, stdin)
        except OSError:  # it died at once: the model works without it
            pass
        self.weights = weights
        self.share = tuning.HELPER_SHARE  # of each matrix's tiles, computed by the helper
        self.rests = Rests()
        self._owed_since: float | None = None  # when the command it has not answered yet was sent
        self._state = "starting"
        self._lock = threading.Lock()        # one command at a time (close() waits for it)
        self._send_lock = threading.RLock()  # one command at a time (a block freed while sending: below)
        self._writing = False                # a command is being written (by the lock's holder)
        self._deferred: list[bytes] = []     # commands to write after it
        self._finalizer = weakref.finalize(self, _stop, self.process, self._descriptors, self._cmd, self._answers)

    @property
    def alive(self) -> bool:
        """Ready to take work (checks, without waiting, whether a starting helper is ready)."""
        if self._state == "starting" and select.select([self._answers], [], [], 0)[0]:
            self._state = "ready" if os.read(self._answers, 1) == _READY else "dead"
        return self._state == "ready"

    def wait_ready(self, timeout: float) -> bool:
        """Wait up to timeout seconds for a starting helper to be ready; whether it is."""
        if self._state == "starting":
            select.select([self._answers], [], [], timeout)
        return self.alive

    def matmul(self, i: int, x: np.ndarray) -> np.ndarray | None:
        """x @ weights[i].T for a few rows of x, the last `share` of its tiles given to the
        helper; None while the helper owes the answer to an earlier matmul or rests (the
        caller computes this one without it).

        The two cores of a VM need not be equally fast, nor equally free, so the share
        follows what happens: when the helper's answer is already there as we finish our
        part, it gets more next time, otherwise less. And rather than wait for a helper
        that is behind, we take back its last tiles until we meet it (`_take_back`), and
        if even its last tile is not answered within `grace`, we do it too.
        """
        with self._lock:
            if not self._idle():
                return None
            w = self.weights[i]
            n = x.shape[0]
            split = min(w.n_tiles - 1, max(1, round(w.n_tiles * (1.0 - self.share))))
            xs, ys = _io_views(self.io, self.x_values, w, n)
            xs[...] = x
            self.claims[_HELPER_NEXT], self.claims[_TAKEN_FROM] = split, w.n_tiles
            sent_at = time.perf_counter()
            if not self._send(_COMMAND.pack(_MATMUL, i, n, split, w.n_tiles)):
                return None
            w._decode_tiles(xs, ys, 0, split)
            tile_seconds = (time.perf_counter() - sent_at) / split
            mins_part = w._mins_part(xs)  # meanwhile the helper goes on with its tiles
            early = bool(select.select([self._answers], [], [], 0)[0])
            low, high = tuning.SHARE_BOUNDS
            self.share = min(high, max(low, self.share + (tuning.SHARE_STEP if early else -tuning.SHARE_STEP)))
            taken = w.n_tiles if early else self._take_back(w, xs, ys, split)
            answered = self._answered(sent_at, grace(tile_seconds))
            y = ys.copy()  # a late helper's writes go to the I/O area, not here
            # answered: the tile each of us may have left to the other (see _take_back);
            # not answered: all of its tiles
            missing = int(self.claims[_HELPER_NEXT]) if answered else split
            if missing < taken:
                w._decode_tiles(xs, y, missing, taken)
            if mins_part is not None:
                y += mins_part
            return y[:, : w.shape[0]]

    def _take_back(self, w: QuantWeight, xs: np.ndarray, ys: np.ndarray, split: int) -> int:
        """Compute the helper's tiles from the end while it is behind; the first tile taken.

        Each time we take half of what it has left, as one range of tiles (taken one
        by one, each would cost its own scaling and summing), until we meet it. Each
        side says which tiles it takes before it looks at the other's claims
        (claims[_HELPER_NEXT] is one past the helper's latest, claims[_TAKEN_FROM] the
        first of ours), so a tile is at worst computed twice (the same floats, written
        twice) or, when each saw the other's claim, left by both: the caller computes
        that one once the helper has answered.
        """
        claims = self.claims
        taken = w.n_tiles
        while (left := taken - int(claims[_HELPER_NEXT])) > 0:
            first = taken - max(1, left // 2)
            claims[_TAKEN_FROM] = first
            first = max(first, int(claims[_HELPER_NEXT]))  # not the tiles it claimed meanwhile
            if first >= taken:
                break
            w._decode_tiles(xs, ys, first, taken)
            taken = first
        return taken

    def close(self) -> None:
        """Stop the helper and reap it (the model keeps working without it); idempotent."""
        with self._lock:  # not in the middle of a matmul
            self._state = "dead"
            self._finalizer()

    def step_beside(self, spec: dict, own: Callable[[], list]) -> tuple[list, bool, bool] | None:
        """Send the helper a forward step over some sequences (`spec`, halves.py) and run
        `own` (the model's half) meanwhile. Returns own's result, whether the helper
        answered, and whether its answer was there as own ended; None when the helper
        is busy, resting or gone (nothing was sent).

        The helper gets as long again as own took (HALVES_GRACE_MIN at least). Not
        answered then, it is dead, or late (its core is likely taken): a late one is
        told to stop at its next layer, owes the answer (`_idle` reads it later, or
        kills it after HELPER_TIMEOUT), may still write its sequences' caches meanwhile,
        and the model rests from it. When own raises (StepAbandoned included), the
        helper is told to stop at its next layer and is waited for (up to
        HELPER_TIMEOUT) before the exception goes on.
        """
        with self._lock:
            if not self._idle():
                return None
            self.claims[_ABANDON] = 0
            sent_at = time.perf_counter()
            payload = pickle.dumps(spec, protocol=pickle.HIGHEST_PROTOCOL)
            if not self._send(_COMMAND.pack(_STEP, len(payload), 0, 0, 0) + payload):
                return None
            self._owed_since = sent_at
            try:
                result = own()
            except BaseException:
                self.claims[_ABANDON] = 1
                if not (_poll(self._answers, tuning.SPIN_SECONDS, tuning.HELPER_TIMEOUT) and self._read_answer()):
                    self._give_up()
                raise
            own_seconds = time.perf_counter() - sent_at
            early = bool(select.select([self._answers], [], [], 0)[0])
            if _poll(self._answers, tuning.SPIN_SECONDS, max(own_seconds, tuning.HALVES_GRACE_MIN)):
                return result, self._read_answer(), early
            self.claims[_ABANDON] = 1
            self.rests.behind(time.perf_counter())
            return result, False, False

    def map_block(self, number: int, fd: int, size: int) -> None:
        """Have the helper map a KV cache's block (memfd fd, size bytes), known by its number."""
        if self._state != "dead":
            self._send(_COMMAND.pack(_MAP, number, size, 0, 0), fd)

    def forget_block(self, number: int) -> None:
        """Have the helper unmap a block the model's process let go of (called by its finalizer)."""
        if self._state != "dead":
            self._send(_COMMAND.pack(_FORGET, number, 0, 0, 0))

    def _send(self, command: bytes, fd: int | None = None) -> bool:
        """Send a command (and before it, a descriptor it refers to); False if the helper is gone.

        A block's finalizer may run on this very thread between two parts of a long
        write: its command then waits for the end of that one, not to cut it in two.
        """
        try:
            with self._send_lock:
                if self._writing:
                    self._deferred.append(command)
                    return True
                self._writing = True
                try:
                    if fd is not None:
                        socket.send_fds(self._descriptors, [b"k"], [fd])
                    _write_all(self._cmd, command)
                    while self._deferred:
                        _write_all(self._cmd, self._deferred.pop(0))
                finally:
                    self._writing = False
            return True
        except OSError:  # its end is closed (it died), or it read no descriptor for HELPER_TIMEOUT
            self._give_up()
            return False

    def _idle(self) -> bool:
        """Whether the helper has answered every command sent (reading a late answer, and
        killing a helper that has owed one for HELPER_TIMEOUT) and is not resting."""
        if self._state != "ready" and not self.alive:
            return False
        now = time.perf_counter()
        if self._owed_since is not None:
            if not select.select([self._answers], [], [], 0)[0]:
                if now - self._owed_since > tuning.HELPER_TIMEOUT:
                    self._give_up()
                return False
            if not self._read_answer():
                return False
        return not self.rests.resting(now)

    def _answered(self, sent_at: float, grace_seconds: float) -> bool:
        """Whether the helper answers the command sent at `sent_at` within `grace_seconds`;
        if not, it owes that answer (see _idle) and the model may rest from it (Rests)."""
        if _poll(self._answers, grace_seconds, 0):
            return self._read_answer()
        self._owed_since = sent_at
        self.rests.late(sent_at, time.perf_counter())
        return False

    def _read_answer(self) -> bool:
        """Read the answer waiting on the pipe: True for "done", False (and the helper
        killed) for the end of the pipe, when it died."""
        if os.read(self._answers, 1) == _DONE:
            self._owed_since = None
            self.rests.answered(time.perf_counter())
            return True
        self._give_up()
        return False

    def _give_up(self) -> None:
        self._state = "dead"
        self.process.kill()  # before we write the I/O area ourselves: it must not write later
        self.process.wait()


def _stop(process: subprocess.Popen, descriptors: socket.socket, *fds: int) -> None:
    """Close our ends of the pipes and the socket (the helper reads end-of-file and exits) and reap it."""
    descriptors.close()
    for fd in fds:
        os.close(fd)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _aligned(nbytes: int) -> int:
    """nbytes rounded up to a multiple of _ALIGN."""
    return -(-nbytes // _ALIGN) * _ALIGN


def _memfd(name: str, size: int, fds: list[int]) -> int:
    """A new memfd of `size` bytes, added to `fds` (the caller closes them) as soon as it exists."""
    fd = os.memfd_create(name)
    fds.append(fd)
    os.ftruncate(fd, size)
    return fd


def _pipe(read_ends: list[int], write_ends: list[int]) -> tuple[int, int]:
    """os.pipe(), each end added as soon as it exists to the list of fds that will close it."""
    r, w = os.pipe()
    read_ends.append(r)
    write_ends.append(w)
    return r, w


def _share(weights: list[QuantWeight], fds: list[int]) -> tuple[int, int, list, dict[int, tuple]]:
    """Move the weights' arrays into one memfd (added to `fds`); their layout for the helper
    to map them, and each shared array's place (id(array) -> its layout entry).

    The layout has one entry per weight: [codes, scales, mins, n_out], each array as
    (offset, shape, dtype) or None.
    """
    size = max(1, sum(_aligned(a.nbytes) for w in weights for a in (w.codes, w.scales, w.mins) if a is not None))
    fd = _memfd("lmsp-weights", size, fds)
    memory = mmap.mmap(fd, size)
    layout, places, offset = [], {}, 0
    for w in weights:
        entry = []
        for name in ("codes", "scales", "mins"):
            a = getattr(w, name)
            if a is None:
                entry.append(None)
                continue
            shared = np.frombuffer(memory, a.dtype, a.size, offset).reshape(a.shape)
            shared[...] = a
            shared.flags.writeable = False
            setattr(w, name, shared)
            entry.append((offset, a.shape, a.dtype.str))
            places[id(shared)] = entry[-1]
            offset += _aligned(a.nbytes)
        layout.append([*entry, w.shape[0]])
    return fd, size, layout, places


def _pickled(model: tuple[Hyperparameters, Weights], places: dict[int, tuple]) -> bytes:
    """The model's hyperparameters and plain weights pickled, each shared array as its place
    in the weights' memfd (the helper maps it there), the rest (norms, biases) as it is."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.persistent_id = lambda obj: places.get(id(obj)) if isinstance(obj, np.ndarray) else None
    pickler.dump(model)
    return buffer.getvalue()


# --- the helper process -----------------------------------------------------------------


def serve() -> None:
    """The helper process: map the weights, then compute tiles on command until the pipe closes.

    It exits quietly when the model's process is gone, whenever that shows: an
    unfinished start-up message, a closed command pipe, or nobody left to answer.
    """
    from .threads import single_threaded_blas

    single_threaded_blas()  # one process, one core: its BLAS must not start threads of its own
    try:
        _serve(pickle.load(sys.stdin.buffer))
    except (EOFError, pickle.UnpicklingError, BrokenPipeError):
        pass


def _serve(spec: dict) -> None:
    """Map the weights and the I/O area, say ready, then do what each command asks."""
    weights_fd, weights_size, layout = spec["weights"]
    memory = mmap.mmap(weights_fd, weights_size, prot=mmap.PROT_READ)

    def array(entry):
        if entry is None:
            return None
        offset, shape, dtype = entry
        return np.frombuffer(memory, np.dtype(dtype), int(np.prod(shape)), offset).reshape(shape)

    weights = [QuantWeight(array(c), array(s), array(m), n_out) for c, s, m, n_out in layout]
    io_fd, io_size, x_values = spec["io"]
    claims, io = _map_io(io_fd, io_size)
    commands, answers = spec["commands"], spec["answers"]
    descriptors = socket.socket(fileno=spec["descriptors"])
    theirs = _their_half(spec["model"], array, claims) if "model" in spec else None
    ahead = _ConvertAhead(weights, tuning.CONVERT_AHEAD)
    os.write(answers, _READY)
    while True:
        while ahead.todo and not select.select([commands], [], [], 0)[0]:
            ahead.convert_one()
        _poll(commands, tuning.SPIN_SECONDS, None)  # the next matmul is usually microseconds away
        command = _read_exactly(commands, _COMMAND.size)
        if command is None:
            return
        kind, *numbers = _COMMAND.unpack(command)
        if kind == _MATMUL:
            i, n, b0, b1 = numbers
            w = weights[i]
            x, y = _io_views(io, x_values, w, n)
            claims[_HELPER_NEXT] = _helper_tiles(w, x, y, b0, b1, ahead.received(i, b0, b1), claims)
            os.write(answers, _DONE)
            ahead.plan(i)
        elif kind == _MAP:
            _, fds, _, _ = socket.recv_fds(descriptors, 1, 1)  # (sent before the command)
            theirs.map(numbers[0], fds[0], numbers[1])
        elif kind == _FORGET:
            theirs.forget(numbers[0])
        else:
            theirs.step(pickle.loads(_read_exactly(commands, numbers[0])))
            os.write(answers, _DONE)


def _their_half(model: tuple[bytes, int, int], array: Callable, claims: np.ndarray) -> HelperSteps:
    """The helper's side of halved steps (halves.py): the model's weights unpickled over the
    shared memory (`array` maps a place), and the area of the final states mapped."""
    pickled, states_fd, states_size = model
    unpickler = pickle.Unpickler(io.BytesIO(pickled))
    unpickler.persistent_load = array
    hp, plain = unpickler.load()
    states = _map_states(states_fd, states_size, plain.output.shape[1])
    return HelperSteps(hp, plain, states, lambda: bool(claims[_ABANDON]))


def _helper_tiles(w: QuantWeight, x: np.ndarray, y: np.ndarray, b0: int, b1: int,
                  converted: dict[int, np.ndarray], claims: np.ndarray) -> int:
    """The helper's share of a decode matmul: QuantWeight._decode_tiles over tiles b0:b1,
    with the same numpy calls, except that each tile is claimed before it is computed
    (the work stops at the first one the model's process took back, see Helper._take_back)
    and the tiles in `converted` (tile -> its codes as float32, flat) are used as they are.
    Returns the end of the tiles computed: b1, or the first one taken back."""
    xg, span, partials = w._decode_buffers(x, b1 - b0)
    n_groups, rows = xg.shape[0], w.tile_rows
    tile = scratch("tile", (w.shape[1], rows))
    tile_groups = tile.reshape(n_groups, w.group, rows)
    for s0 in range(b0, b1, span):
        m = min(span, b1 - s0)
        for j in range(m):
            b = s0 + j
            claims[_HELPER_NEXT] = b + 1
            if b >= claims[_TAKEN_FROM]:  # taken back: the model's process computes it
                w._scale_and_sum(partials[:j], y, s0)
                return b
            ready = converted.get(b)
            if ready is None:
                np.copyto(tile, w.codes[b])
                np.matmul(xg, tile_groups, out=partials[j])
            else:
                np.matmul(xg, ready[: tile.size].reshape(n_groups, w.group, rows), out=partials[j])
        w._scale_and_sum(partials[:m], y, s0)
    return b1


class HelperSteps:
    """The helper process's side of halved steps (halves.py): the KV caches' blocks it maps,
    and the steps of its sequences."""

    def __init__(self, hp: Hyperparameters, weights: Weights, states: np.ndarray,
                 abandoned: Callable[[], bool]):
        self.hp = hp
        self.weights = weights
        self.states = states          # (HALVES_MAX_ROWS, d) shared with the model's process
        self.abandoned = abandoned    # whether the model's half was abandoned (ask between layers)
        self.blocks: dict[int, np.ndarray] = {}

    def map(self, number: int, fd: int, size: int) -> None:
        try:
            self.blocks[number] = np.frombuffer(mmap.mmap(fd, size), np.float32)
        finally:
            os.close(fd)

    def forget(self, number: int) -> None:
        self.blocks.pop(number, None)  # (its memory goes once the model's process lets it go too)

    def step(self, spec: dict) -> None:
        """Run the layers over the sequences the spec names, their final states into the shared area."""
        hp = self.hp
        caches = []
        for number, capacity, start in spec["caches"]:
            block = self.blocks[number]
            cache = KVCache(hp.n_layer, hp.n_head_kv, hp.head_dim, hp.head_dim_v, capacity, capacity,
                            allocate=lambda n_values, block=block: block[:n_values])
            cache.length = start
            caches.append(Sequence([], cache))
        batch = Batch(caches, [start for _, _, start in spec["caches"]],
                      [slice(a, b) for a, b in spec["spans"]], spec["tokens"], spec["positions"], spec["wanted"])
        try:
            x = architectures.hidden_states(hp, self.weights, batch, all_rows=False, abandon=self.abandoned)
        except StepAbandoned:
            return
        self.states[: len(x)] = x


class _ConvertAhead:
    """The helper's idle time put to use: converting the tiles of its next matmul ahead.

    While the model's process finishes its part of a matmul and runs the ops between
    two matmuls, the helper has nothing to do. A decode step runs the same matmuls in
    the same order every time, so the next matmul is most likely the one that came
    after this one last time, and the helper's tiles of it those it was given last
    time (its share moves by one tile at a time). Converting a tile's codes to float32
    is most of a tile's work and does not depend on x, so the helper does it while it
    waits: the same floats, sooner. A guess that turns out wrong costs a tile's
    conversion at most (a command that comes in meanwhile waits for it).
    """

    def __init__(self, weights: list[QuantWeight], n_buffers: int):
        self.weights = weights
        values = max(w.shape[1] * w.tile_rows for w in weights)
        self.free = [np.empty(values, np.float32) for _ in range(n_buffers)]
        self.successor: dict[int, int] = {}        # weight -> the weight of the matmul after it, last time
        self.given: dict[int, tuple[int, int]] = {}  # weight -> the tiles the helper computed, last time
        self.last: int | None = None
        self.target: int | None = None             # the weight the tiles below are of
        self.converted: dict[int, np.ndarray] = {}  # tile -> its codes as float32 (flat)
        self.todo: list[int] = []                  # tiles of `target` still to convert

    def received(self, i: int, b0: int, b1: int) -> dict[int, np.ndarray]:
        """A command for weight i's tiles b0:b1: note it, and return the tiles converted for it."""
        if self.last is not None:
            self.successor[self.last] = i
        self.last = i
        self.given[i] = (b0, b1)
        return self.converted if self.target == i else {}

    def plan(self, i: int) -> None:
        """Weight i's matmul is done: take the buffers back, and plan the next matmul's tiles."""
        self.free.extend(self.converted.values())
        self.converted = {}
        self.target = self.successor.get(i)
        b0, b1 = self.given.get(self.target, (0, 0))
        self.todo = list(range(b0, min(b1, b0 + len(self.free))))

    def convert_one(self) -> bool:
        """Convert the next planned tile; False when none is left."""
        if not self.todo:
            return False
        b = self.todo.pop(0)
        w = self.weights[self.target]
        buffer = self.free.pop()
        np.copyto(buffer[: w.shape[1] * w.tile_rows].reshape(w.shape[1], w.tile_rows), w.codes[b])
        self.converted[b] = buffer
        return True


def _map_io(fd: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared I/O area: the three claims (int64), then x and y (float32, see _io_views)."""
    memory = mmap.mmap(fd, size)
    return np.frombuffer(memory, np.int64, 3), np.frombuffer(memory, np.float32, offset=_ALIGN)


def _map_states(fd: int, size: int, d: int) -> np.ndarray:
    """The area of a halved step's final states, from the helper: (HALVES_MAX_ROWS, d) float32."""
    return np.frombuffer(mmap.mmap(fd, size), np.float32).reshape(-1, d)


def _io_views(io: np.ndarray, x_values: int, w: QuantWeight, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The shared I/O area as both processes read it: x (n, in) first, y (n, padded out) after it."""
    x = io[: n * w.shape[1]].reshape(n, w.shape[1])
    y = io[x_values: x_values + n * w.n_tiles * w.tile_rows].reshape(n, -1)
    return x, y


def _poll(fd: int, spin: float, timeout: float | None) -> bool:
    """Whether fd has data within `timeout` seconds (None: however long), asking without sleeping
    for the first `spin`.

    A process that sleeps on a pipe takes tens of microseconds to wake up when the
    data comes (longer on a VM whose idle core was handed back to the host), and a
    decode step waits on the pipes twice per matmul: for the short waits, asking again
    costs less than sleeping.
    """
    end = time.perf_counter() + spin
    while time.perf_counter() < end:
        if select.select([fd], [], [], 0)[0]:
            return True
    return bool(select.select([fd], [], [], timeout)[0])


def _write_all(fd: int, data: bytes) -> None:
    """Write all of data to a pipe (a write may take only part of a long one)."""
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, size: int) -> bytes | None:
    """size bytes from a pipe, or None at end of file."""
    data = b""
    while len(data) < size:
        chunk = os.read(fd, size - len(data))
        if not chunk:
            return None
        data += chunk
    return data
