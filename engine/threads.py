"""The threads numpy work is split over, and their scratch buffers.

numpy releases the GIL inside its loops and inside BLAS, so Python threads can keep
several cores busy on one matmul as long as each call is long enough; the kernels
(engine/quants.py) and attention (engine/architectures.py) hand row ranges of their
work to `parallel_for`. BLAS itself is kept to one thread (`_single_threaded_blas`).
The thread count is `LMSP_THREADS`, else one per core (`set_num_threads` changes it).
"""

from __future__ import annotations

import ctypes
import glob
import os
import queue
import threading
from typing import Callable

import numpy as np

# Work on fewer values than this is not worth splitting across threads.
PARALLEL_MIN_VALUES = 1 << 16
# Larger ones are split into chunks of about this many values, shared out dynamically.
CHUNK_VALUES = 1 << 20
# Scratch buffers are never smaller than this (they grow to the largest size asked for).
MIN_SCRATCH_VALUES = 1 << 17


def _openblas_functions(name: str) -> list:
    """`openblas_<name>` of each OpenBLAS library numpy loaded (none when numpy was built with
    another BLAS), under the name its build exports: scipy-openblas prefixes `scipy_`,
    builds with 64-bit integers end in `64_`."""
    found = []
    for path in glob.glob(os.path.join(os.path.dirname(np.__file__), os.pardir, "numpy.libs", "*openblas*")):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_", "64_"), ("scipy_", ""), ("", "64_"), ("", "")):
            function = getattr(lib, f"{prefix}openblas_{name}{suffix}", None)
            if function is not None:
                found.append(function)
                break
    return found


def _single_threaded_blas() -> None:
    """Make numpy's OpenBLAS run every call on the calling thread alone.

    We split each matmul over threads ourselves, and those threads wait for work
    by blocking. OpenBLAS's own threads spin while they wait: on a busy machine a
    spinning thread holds the core the working one needs (a prefill GEMM ran 5x
    slower with 2 OpenBLAS threads than with 1, 12 processes on 2 cores), and our
    threads times its threads would oversubscribe the cores anyway.
    """
    for set_num_threads in _openblas_functions("set_num_threads"):
        set_num_threads(1)


def blas_kernel() -> str | None:
    """The CPU kernels numpy's OpenBLAS runs ("SkylakeX", "Haswell", ...), or None.

    OpenBLAS picks them when it loads, for this CPU, unless OPENBLAS_CORETYPE names
    others. Prefill is mostly float32 GEMM, so this decides its speed: on a Zen 5 the
    SkylakeX (AVX-512) kernels ran Gemma 3's prefill matmuls 1.8x faster than Haswell's.
    """
    for get_corename in _openblas_functions("get_corename"):
        get_corename.restype = ctypes.c_char_p
        return get_corename().decode()
    return None


_single_threaded_blas()


def _default_threads() -> int:
    """One thread per core, or `LMSP_THREADS` when set (e.g. to leave cores to other work)."""
    configured = os.environ.get("LMSP_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return os.cpu_count() or 1


_threads = _default_threads()  # how many threads split the work (set_num_threads changes it)
_jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, i0, i1, done queue) for the workers
_workers: list[threading.Thread] = []
_workers_lock = threading.Lock()
_local = threading.local()  # per thread: scratch buffers, the queue our jobs report to


def set_num_threads(n: int | None) -> None:
    """Split work over `n` threads (the caller's plus n - 1 workers).

    None restores the default: `LMSP_THREADS`, else one thread per core.
    """
    global _threads
    _threads = _default_threads() if n is None else max(1, int(n))


def num_threads() -> int:
    """How many threads work is split over (the caller's included)."""
    return _threads


def _run(job: tuple) -> None:
    """Run one range of somebody's work and report to that caller's queue."""
    fn, r0, r1, done = job
    try:
        fn(r0, r1)
    except BaseException as e:  # handed to the waiting caller, which raises it
        done.put(e)
    else:
        done.put(None)


def _work() -> None:
    """A worker thread: run ranges for whichever thread asks."""
    while True:
        _run(_jobs.get())


def parallel_for(fn: Callable[[int, int], None], n_items: int, n_values: int,
                 min_values: int = PARALLEL_MIN_VALUES, items_per_chunk: int | None = None) -> None:
    """Run fn(i0, i1) over contiguous ranges covering [0, n_items), on all threads.

    The items (rows, tiles, blocks of queries) stand for n_values values of work; below
    min_values it all runs on the calling thread. Otherwise the items are cut into
    chunks of about CHUNK_VALUES values, or of `items_per_chunk` items when given (at
    least one chunk per thread), fed through one queue to daemon worker threads (cheaper
    per call than concurrent.futures, which matters for ~100 small matmuls per decoded
    token). The caller works through the queue too, so it only ever waits for chunks a
    worker has already started: on a busy machine a worker can wait milliseconds for a
    core, and a matmul must not wait with it.
    """
    k = min(_threads, n_items) if n_values >= min_values else 1
    if k == 1:
        fn(0, n_items)
        return
    if len(_workers) < k - 1:
        with _workers_lock:
            while len(_workers) < k - 1:
                t = threading.Thread(target=_work, name="lmsp-matmul", daemon=True)
                t.start()
                _workers.append(t)
    done = getattr(_local, "done", None)
    if done is None:
        done = _local.done = queue.SimpleQueue()
    wanted = n_items // items_per_chunk if items_per_chunk else n_values // CHUNK_VALUES
    n_chunks = min(n_items, max(k, wanted))
    bounds = [n_items * i // n_chunks for i in range(n_chunks + 1)]
    for i in range(1, n_chunks):
        _jobs.put((fn, bounds[i], bounds[i + 1], done))
    _run((fn, bounds[0], bounds[1], done))
    while True:  # take the chunks no worker has started yet
        try:
            job = _jobs.get_nowait()
        except queue.Empty:
            break
        _run(job)
    error = None
    for _ in range(n_chunks):  # always wait for all: the workers write into the caller's arrays
        error = done.get() or error
    if error is not None:
        raise error


def _libc_malloc_trim():
    """glibc's malloc_trim, where the C library has one (not musl, not macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Hand back to the OS the memory malloc keeps after big jobs on the threads (loading).

    Each thread that allocates gets its own malloc arena, and glibc returns an arena's
    free pages only from the top of its heap: after a model is unpacked on the threads,
    depending on the order the temporaries were freed in, up to 80 MiB of them (Gemma 3
    270M, one load in five) stayed resident. malloc_trim(0) releases every free page.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)


def scratch(name: str, size: int) -> np.ndarray:
    """A flat float32 scratch array of `size` items, private to the calling thread."""
    buffers = getattr(_local, "buffers", None)
    if buffers is None:
        buffers = _local.buffers = {}
    buf = buffers.get(name)
    if buf is None or buf.size < size:
        buf = buffers[name] = np.empty(max(size, MIN_SCRATCH_VALUES), np.float32)
    return buf[:size]
