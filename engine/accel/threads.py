"""Worker threads that share numpy work out, and the process settings they rely on.

numpy releases the GIL inside its loops and inside BLAS, so Python threads can keep
several cores busy on one matmul as long as each call is long enough. A `WorkerPool`
is owned by whoever starts it (a loaded model's accelerator, engine/accel/__init__.py)
and stopped by its `close()`, which joins its threads. The kernels are split over it
by the wrapper weights (engine/accel/weights.py); attention and the position-wise ops
(engine/architectures.py) run through `parallel_for`, which uses the latest pool still
open: `install` (engine/accel/__init__.py) hands it to them at load.

BLAS itself runs each call on the calling thread alone (`single_threaded_blas`, called
when a model is loaded): we split the work ourselves, and OpenBLAS's own threads spin
while they wait, holding cores that our threads (or other processes) need.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
import weakref
from typing import Callable

from threadpoolctl import threadpool_info, threadpool_limits

from engine import tuning

_STOP = None  # what a worker takes from the queue to end


def num_threads() -> int:
    """How many threads a model loaded now splits its work over (the caller's included):
    `LMSP_THREADS` when set (e.g. to leave cores to other work), else one per core."""
    configured = os.environ.get("LMSP_THREADS", "").strip()
    if configured.isdigit() and int(configured) > 0:
        return int(configured)
    return os.cpu_count() or 1


class WorkerPool:
    """n_threads - 1 worker threads that, with the calling thread, run `parallel_for`'s chunks.

    The workers wait on one queue (cheaper per call than concurrent.futures, which
    matters for ~100 small matmuls per decoded token). They are daemon threads only so
    that a process that never closed its model can still exit; `close()` (or the pool
    being dropped) ends them.
    """

    def __init__(self, n_threads: int):
        self.n_threads = max(1, int(n_threads))
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()  # (fn, i0, i1, done queue), or _STOP
        self._local = threading.local()  # per calling thread: the queue its chunks report to
        self._workers = [threading.Thread(target=_work, args=(self._jobs,), name=f"lmsp-matmul-{i}", daemon=True)
                         for i in range(self.n_threads - 1)]
        for worker in self._workers:
            worker.start()
        self.closed = False
        self._stop = weakref.finalize(self, _stop_workers, self._jobs, len(self._workers))
        with _pools_lock:
            _pools.append(weakref.ref(self))

    def parallel_for(self, fn: Callable[[int, int], None], n_items: int, n_values: int,
                     min_values: int | None = None, items_per_chunk: int | None = None) -> None:
        """Run fn(i0, i1) over contiguous ranges covering [0, n_items), on all threads.

        The items (rows, tiles, blocks of queries) stand for n_values values of work;
        below min_values (default tuning.PARALLEL_MIN_VALUES) it all runs on the calling
        thread. Otherwise the items are cut into chunks of about tuning.CHUNK_VALUES
        values, or of `items_per_chunk` items when given (at least one chunk per thread).
        The caller works through the queue too, so it only ever waits for chunks a worker
        has already started: on a busy machine a worker can wait milliseconds for a core,
        and a matmul must not wait with it.
        """
        if min_values is None:
            min_values = tuning.PARALLEL_MIN_VALUES
        k = min(self.n_threads, n_items) if n_values >= min_values and not self.closed else 1
        if k <= 1:
            fn(0, n_items)
            return
        done = getattr(self._local, "done", None)
        if done is None:
            done = self._local.done = queue.SimpleQueue()
        wanted = n_items // items_per_chunk if items_per_chunk else n_values // tuning.CHUNK_VALUES
        n_chunks = min(n_items, max(k, wanted))
        bounds = [n_items * i // n_chunks for i in range(n_chunks + 1)]
        for i in range(1, n_chunks):
            self._jobs.put((fn, bounds[i], bounds[i + 1], done))
        _run((fn, bounds[0], bounds[1], done))
        stops = 0
        while True:  # take the chunks no worker has started yet (whoever's they are)
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is _STOP:  # the pool is closing: that one is a worker's
                stops += 1
            else:
                _run(job)
        for _ in range(stops):
            self._jobs.put(_STOP)
        error = None
        for _ in range(n_chunks):  # always wait for all: the workers write into the caller's arrays
            error = done.get() or error
        if error is not None:
            raise error

    def close(self) -> None:
        """Stop the workers and join them (after the chunks they have started); idempotent.
        A closed pool runs every parallel_for on the calling thread."""
        self.closed = True
        self._stop()
        for worker in self._workers:
            if worker is not threading.current_thread():
                worker.join()

    def __enter__(self) -> WorkerPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


_pools: list[weakref.ref] = []  # every pool started, latest last (the dropped ones are pruned)
_pools_lock = threading.Lock()


def parallel_for(fn: Callable[[int, int], None], n_items: int, n_values: int,
                 min_values: int | None = None) -> None:
    """WorkerPool.parallel_for on the latest pool still open (a loaded model's), or all of it
    on the calling thread when there is none: for the work between the matmuls, which has
    no weight to carry a pool."""
    with _pools_lock:
        _pools[:] = [ref for ref in _pools if (pool := ref()) is not None and not pool.closed]
        pool = _pools[-1]() if _pools else None
    if pool is None:
        fn(0, n_items)
    else:
        pool.parallel_for(fn, n_items, n_values, min_values)


def _run(job: tuple) -> None:
    """Run one range of somebody's work and report to that caller's queue."""
    fn, r0, r1, done = job
    try:
        fn(r0, r1)
    except BaseException as e:  # handed to the waiting caller, which raises it
        done.put(e)
    else:
        done.put(None)


def _work(jobs: queue.SimpleQueue) -> None:
    """A worker thread: run ranges for whichever thread asks, until told to stop."""
    while (job := jobs.get()) is not _STOP:
        _run(job)


def _stop_workers(jobs: queue.SimpleQueue, n_workers: int) -> None:
    """Tell every worker to stop once the chunks queued before are done."""
    for _ in range(n_workers):
        jobs.put(_STOP)


# --- BLAS and malloc: process settings the threads rely on ------------------------------


def single_threaded_blas() -> None:
    """Make numpy's BLAS run every call on the calling thread alone (the module docstring
    says why). A process-wide setting, made when a model is loaded, not at import."""
    threadpool_limits(limits=1, user_api="blas")


def blas_kernel() -> str | None:
    """The CPU kernels numpy's OpenBLAS runs ("SkylakeX", "Haswell", ...), or None (another BLAS).

    OpenBLAS picks them when it loads, for this CPU, unless OPENBLAS_CORETYPE names
    others. Prefill is mostly float32 GEMM, so they decide its speed.
    """
    for library in threadpool_info():
        if library.get("internal_api") == "openblas":
            return library.get("architecture")
    return None


# OpenBLAS's kernels that use AVX-512 (the names `blas_kernel` gives, in lower case)
AVX512_KERNELS = frozenset({"skylakex", "cooperlake", "sapphirerapids"})
AVX512_FLAGS = frozenset({"avx512f", "avx512bw", "avx512dq", "avx512vl"})  # what they need of the CPU


def blas_kernel_below_cpu() -> bool:
    """Whether OpenBLAS runs kernels without AVX-512 on a CPU that has it, as an
    OPENBLAS_CORETYPE set for an older OpenBLAS makes it do (Haswell on a Zen 5: the
    decode kernel's products up to 1.6x slower, docs/performance.md). Linux only: elsewhere False."""
    kernel = blas_kernel()
    return bool(kernel) and kernel.lower() not in AVX512_KERNELS and AVX512_FLAGS <= _cpu_flags()


def _cpu_flags() -> set[str]:
    """The first CPU's feature flags, from /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return set(line.partition(":")[2].split())
    except OSError:
        pass
    return set()


def _libc_malloc_trim():
    """glibc's malloc_trim, where the C library has one (not musl, not macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


_malloc_trim = _libc_malloc_trim()


def release_freed_memory() -> None:
    """Hand back to the OS the memory malloc keeps after big jobs (loading a model).

    Each thread that allocates gets its own malloc arena, and glibc returns an arena's
    free pages only from the top of its heap: depending on the order temporaries were
    freed in, tens of MiB of them can stay resident. malloc_trim(0) releases every
    free page.
    """
    if _malloc_trim is not None:
        _malloc_trim(0)
