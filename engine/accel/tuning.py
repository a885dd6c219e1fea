"""The acceleration layer's tuning constants, in one table.

Each line says why the value is what it is; docs/performance.md ("Kernels, threads and
the helper: the constants and why") has the measurements behind them. The code reads
them as `tuning.NAME` when it needs them, so a benchmark can set them
(`python -m benchmarks.turns MODEL --setting engine.accel.tuning.NAME=value`), in the
helper process too.
"""

# --- threads (engine/accel/threads.py) ------------------------------------------------
PARALLEL_MIN_VALUES = 1 << 16       # less work than this is not worth splitting over threads
CHUNK_VALUES = 1 << 20              # bigger work is cut into chunks of about this, shared out as threads free up
DECODE_PARALLEL_MIN_WORK = 1 << 21  # a decode matmul (values of W times rows of x) is split only from here:
                                    # below, the threads' GIL hand-offs between short numpy calls cost more than they save
PREFILL_CHUNK_VALUES = 1 << 20      # a prefill matmul is shared out in chunks of W this big: a few ms of GEMM each
                                    # (smaller chunks balance the threads better, but BLAS runs slower on them)
POSITION_WISE_MIN_VALUES = 1 << 18  # a position-wise op (norms, activations) on fewer values (decode) stays on one thread

# --- the helper process (engine/accel/helper.py) --------------------------------------
HELPER_MIN_VALUES = 1 << 24  # weights a model needs for a helper: smaller ones (tests' tiny models) are not worth a process
HELPER_MIN_WORK = 1 << 18    # values of W times rows of x below which a matmul is not worth a command to the helper
HELPER_SHARE = 0.5           # the helper's first share of each matrix's tiles; it then follows how early it answers ...
SHARE_STEP = 0.01            # ... moving by this much per matmul (about a tile of the big matrices) ...
SHARE_BOUNDS = (0.1, 0.9)    # ... within these: each side always has tiles to compute while the other works
HELPER_GRACE = 0.0003        # seconds a matmul waits for the helper's last tile, at least ...
GRACE_TILES = 1.5            # ... and at least this many of its own tiles' time (the helper holds one tile at most) ...
HELPER_GRACE_MAX = 0.001     # ... but at most this (our tiles were slow because we were descheduled)
HELPER_REST = 0.005          # seconds of matmuls without the helper after it was late: its core may stay taken ...
HELPER_REST_MAX = 1.0        # ... doubling, up to this, each time it is late again soon after a rest
ASLEEP_AFTER = 0.001         # a helper without a command for this long sleeps on its pipe: late then is no reason to rest
SPIN_SECONDS = 0.0003        # a wait on a pipe polls this long before it sleeps: the next command is microseconds away
HELPER_TIMEOUT = 30.0        # seconds a helper may owe an answer before it is taken for hung and killed
CONVERT_AHEAD = 3            # tiles of its next matmul the helper converts to float32 while it waits (within its L2)
