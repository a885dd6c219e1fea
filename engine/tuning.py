"""The engine's tuning constants, in one table: sizes, thresholds and priors chosen for speed.

Each line says why the value is what it is; "(perf: SECTION)" names the section of
docs/performance.md that records the measurements behind it, and a constant without
one was chosen once, not measured one by one. The code reads them as `tuning.NAME` when
it needs them, so a benchmark can set them (`python -m benchmarks.turns MODEL --setting
engine.tuning.NAME=value`), in the helper process too; the defaults of a signature (the
scheduler's, a cache's) and of a decorator are bound when their module is imported.

What is not here: facts of the model format (quant block sizes, GGUF constants), and the
limits that bound what a request may ask (a schema's size and depth, tool calls per
response), which stay beside the code they protect.

The base engine imports this module, and so does the acceleration layer on top of it
(engine/accel); it imports nothing. Read the code a section names next.
"""

# --- the plain kernels (engine/quants.py) ----------------------------------------------
# perf: "Kernels, threads and the helper", "The plain kernels"
TILE_VALUES = 1 << 19          # values of a stored tile (512 KiB of codes, 2 MiB as float32): numpy converts
                               # codes faster in long runs, and a matrix needs enough tiles to be shared out
PARTIAL_VALUES = 1 << 16       # the decode kernel scales and sums the partial sums of as many tiles at once as
                               # fit in this many values (256 KiB), or one: they stay in L2 until read back
PREFILL_TILE_VALUES = 1 << 20  # prefill converts up to this many values of a dense (F16, BF16) weight for one
                               # GEMM (BLAS blocks it for the caches); a quantized one's GEMMs are its tiles
DECODE_MAX_ROWS = 32           # up to this many rows of x the decode kernel runs, above it dequantize-and-GEMM:
                               # the two cost about the same near 48 rows, and 32 stays where decode surely wins
UNPACK_ROWS = 1024             # rows of a tensor unpacked at once at load, bounding the temporaries of a large one

# --- attention and the position-wise ops (engine/architectures.py) ----------------------
# perf: "Attention", "Decoding after a long prompt", "Prefill"
ATTENTION_BLOCK = 64           # queries per block of a long chunk: a block reads the keys up to its last query,
                               # so smaller blocks compute less of the causal mask's hidden half (a 512-token
                               # prefill: 56% of the full square at 64, 62.5% at 128) in GEMMs still big enough
KEYS_FIRST_MIN_KEYS = 256      # from this many keys on, one query's scores are keys @ q.T: OpenBLAS computes
                               # q @ keys.T 2x slower once the cache is long, and keys @ q.T costs a few us more below
CAUSAL_MASKS = 8               # causal masks kept, by chunk length: a prefill's chunks are mostly of one or two lengths
POSITION_WISE_MIN_VALUES = 1 << 18  # a position-wise op (norms, activations) on fewer values (decode) stays on one thread

# --- KV caches (engine/kv_cache.py, engine/prefix_cache.py) -----------------------------
INITIAL_CAPACITY = 256         # positions a new sequence's cache has room for, unless its prompt is longer:
                               # a short chat does not pay for the whole window; the cache doubles as it grows
PREFIX_CACHE_BYTES = 256 << 20  # finished sequences' caches kept per model for later prompts (perf: "The prefix cache")

# --- the scheduler (engine/scheduler.py) ------------------------------------------------
MAX_BATCH = 8                  # requests stepped together: a step reads the weights once for all its rows
PREFILL_CHUNK = 512            # prompt tokens per forward step (Model.step's default too; perf: "Prefill", a full
                               # prompt chunk)
EMBED_BATCH_TOKENS = 512       # input tokens an embedding request's forward step takes at most: a prefill
                               # chunk's worth, so the scheduler's decode steps wait no longer for one of them
PREFILL_SHARE = 0.4            # while streams decode, prompt chunks take at most this share of the worker's time:
                               # after a step that fed prompts for t seconds, the decoders get t * 0.6 / 0.4 of steps
                               # of their own, so a running stream keeps most of its pace through a burst of arrivals
                               # and a chunk's stall is one of its gaps in twenty or more. Whole chunks, not thin
                               # ones beside every token: a prompt token costs ~4x more in a step of 9 rows than in
                               # one of 512 (perf: "A burst of arrivals beside a running stream")

# --- drafts (engine/speculate.py, engine/jump_forward.py) -------------------------------
# perf: "Fast decoding: drafts from the context and forced text"
NGRAM_MAX = 4                  # the longest context match looked for
MAX_DRAFT = 16                 # draft tokens per sequence per step, at most (a copy reached 5.8 tokens per step)
# a new request's per-token acceptance of a draft after a match of n tokens, until observed:
# one shared token predicts the next far worse than four (free text repeats single tokens)
ACCEPTANCE_PRIOR = {1: 0.1, 2: 0.2, 3: 0.35, 4: 0.5}
FORCED_PRIOR = 0.9             # forced text: the model almost always takes the canonical split
SMOOTHING = 0.2                # weight of each new observation in the acceptance rate
ROW_COST_PRIOR = 0.25          # one more row, relative to a one-row step, until measured
MAX_FORCED_BYTES = 64          # a forced run is at most this long per step (a key and its quotes fit)
FORCED_RUNS = 1024             # forced runs cached per grammar (a few bytes each, where a mask is n_vocab / 8)

# --- constrained decoding and the tokenizer (engine/constrain/matcher.py, engine/tokenizer.py)
MAX_MASKS = 64                 # token masks cached per grammar, bit-packed (n_vocab / 8 bytes each)
MAX_TRANSITIONS = 200_000      # byte transitions cached per grammar (cleared when full)
# tokens before the end of its budget from which a constrained output's masks are exact for
# the budget (matcher.py GrammarConstraint.mask): an exact mask walks the whole trie, 0.1 s
# for 49k tokens; before it, only a token that commits the output to this many more tokens
# at once (an optional property with a long required value) is refused, and by `allows`
BUDGET_HORIZON = 32
# where each plain token leads from a pattern's DFA state, for masks inside a pattern or a
# format (engine/constrain/regex.py): 2 bytes a plain token, 90 kB each for SmolLM2's
# vocabulary, 0.5 MB for Gemma 3's; all patterns of all grammars together
MAX_PATTERN_WALKS = 128
WORD_CACHE = 100_000           # words whose token ids a tokenizer keeps (cleared when full) ...
WORD_CACHE_MAX_CHARS = 64      # ... of at most this many characters: long words seldom repeat

# --- the worker threads (engine/accel/threads.py) ---------------------------------------
# perf: "The worker threads"
PARALLEL_MIN_VALUES = 1 << 16       # less work than this is not worth splitting over threads
CHUNK_VALUES = 1 << 20              # bigger work is cut into chunks of about this, shared out as threads free up
DECODE_PARALLEL_MIN_WORK = 1 << 21  # a decode matmul (values of W times rows of x) is split only from here:
                                    # below, the threads' GIL hand-offs between short numpy calls cost more than they save
PREFILL_CHUNK_VALUES = 1 << 20      # a prefill matmul is shared out in chunks of W this big: a few ms of GEMM each
                                    # (smaller chunks balance the threads better, but BLAS runs slower on them)

# --- the helper process (engine/accel/helper.py) ----------------------------------------
# perf: "The helper process"
HELPER_MIN_VALUES = 1 << 24  # weights a model needs for a helper: smaller ones (tests' tiny models) are not worth a process
HELPER_MIN_WORK = 1 << 18    # values of W times rows of x below which a matmul is not worth a command to the helper
HELPER_SHARE = 0.5           # the helper's first share of each matrix's tiles; it then follows how early it answers ...
SHARE_STEP = 0.01            # ... moving by this much per matmul (about a tile of the big matrices) ...
SHARE_BOUNDS = (0.1, 0.9)    # ... within these: each side always has tiles to compute while the other works
HELPER_GRACE = 0.0003        # seconds a matmul waits for the helper's last tile, at least ...
GRACE_TILES = 1.5            # ... and at least this many of its own tiles' time (the helper holds one tile at most) ...
HELPER_GRACE_MAX = 0.001     # ... but at most this (our tiles were slow because we were descheduled)
HELPER_REST = 0.005          # seconds of matmuls without the helper after it was late: its core may stay taken ...
HELPER_REST_MAX = 1.0        # ... doubling, up to this, each time it is late again soon after a rest ...
HELPER_AGAIN_ANSWERS = 32    # ... answers between two late ones, on average: 3-40 beside a held core, 70-85 with clients' bursts
ASLEEP_AFTER = 0.001         # a helper without a command for this long sleeps on its pipe: late then is no reason to rest
SPIN_SECONDS = 0.0003        # a wait on a pipe polls this long before it sleeps: the next command is microseconds away
HELPER_TIMEOUT = 30.0        # seconds a helper may owe an answer before it is taken for hung and killed
CONVERT_AHEAD = 3            # tiles of its next matmul the helper converts to float32 while it waits (within its L2)

# --- the step in two halves (engine/accel/halves.py) ------------------------------------
# perf: "A step in two halves"
HALVES_MIN_SEQUENCES = 12    # a decode step of this many sequences or more is halved with the helper: below,
                             # each half converting every tile costs more than the hand-overs saved
HALVES_MAX_ROWS = 2 * DECODE_MAX_ROWS  # ... of at most this many rows (drafts included): both halves decode
HALVES_SHARE = 0.5           # the helper's first share of a step's rows; it then follows how early it answers ...
HALVES_SHARE_STEP = 0.02     # ... moving by this much a step (a row of 50), within SHARE_BOUNDS
HALVES_GRACE_MIN = 0.005     # seconds a halved step waits for the helper after our half, at least (else as long
                             # as our half took): waking a process on a VM can take a millisecond and more
