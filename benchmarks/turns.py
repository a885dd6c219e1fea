"""Settings of the engine compared in one process, their decode steps taking turns.

On a VM whose speed drifts by up to 2x within minutes, two runs one after the other
compare the machine's moods more than the code. Here each setting loads the model
(with its own helper process), then blocks of decode steps run setting after setting,
over and over, so that every setting meets the same moods; the medians compare.

    python -m benchmarks.turns smollm2:135m-instruct-q4_1 --rows 1,8 \\
        --setting "" --setting engine.tuning.SPIN_SECONDS=0.002

A setting is a comma-separated list of `module.NAME=value` (value a Python literal),
"" for the defaults. Its values hold while its model loads and while its steps run,
in this process, and in its helper process from its start (the helper reads
engine.tuning's constants itself). A value the code reads only at load
(engine.tuning.TILE_VALUES) takes effect through the load; one read at each matmul
(engine.tuning.DECODE_MAX_ROWS) through the steps. Each setting's model is its own
load: memory is that of one model per setting.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import statistics
import sys
import time
from pathlib import Path

Assignment = tuple[str, str, object]  # module, name, value
PROMPT = "Once upon a time, in a land far away, there lived"
NEXT_TOKEN = 100     # the token every step feeds (what is decoded does not change a step's work)
MAX_LENGTH = 300     # a block's sequences start again from the prompt past this many tokens


def parse_setting(text: str) -> list[Assignment]:
    """"engine.tuning.SPIN_SECONDS=0.002,engine.tuning.CONVERT_AHEAD=6" -> its assignments."""
    assignments = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        target, sep, value = part.partition("=")
        module, _, name = target.strip().rpartition(".")
        if not sep or not module or not name:
            raise ValueError(f"{part!r} is not module.NAME=value")
        try:
            literal = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            raise ValueError(f"{part!r}: {value.strip()!r} is not a Python literal") from None
        assignments.append((module, name, literal))
    return assignments


def apply(assignments: list[Assignment]) -> list[Assignment]:
    """Make the assignments; returns the ones that undo them."""
    undo = []
    for module, name, value in assignments:
        target = importlib.import_module(module)
        if not hasattr(target, name):
            raise ValueError(f"{module} has no {name}")
        undo.append((module, name, getattr(target, name)))
        setattr(target, name, value)
    return undo[::-1]


def helper_main(assignments: list[Assignment]) -> str:
    """The helper process's start-up code with the assignments made first (in the helper process)."""
    from engine.accel import helper

    start = "from engine.accel.helper import serve"
    if start not in helper._HELPER_MAIN:
        raise RuntimeError(f"engine.accel.helper._HELPER_MAIN no longer says {start!r}: "
                           "settings cannot reach the helper")
    lines = "".join(f"setattr(importlib.import_module({m!r}), {n!r}, {v!r}); " for m, n, v in assignments)
    return helper._HELPER_MAIN.replace(start, f"import importlib; {lines}{start}")


def load(path: Path, assignments: list[Assignment]):
    """The model loaded with the setting's values (restored afterwards), with its helper ready."""
    from engine import load_model
    from engine.accel import helper

    main = helper._HELPER_MAIN
    undo = apply(assignments)
    helper._HELPER_MAIN = helper_main(assignments)
    try:
        model = load_model(path)
    finally:
        helper._HELPER_MAIN = main
        apply(undo)
    if model.accel is not None and model.accel.helper is not None:
        model.accel.helper.wait_ready(timeout=60)
    return model


def measure(models: dict[str, object], settings: dict[str, list[Assignment]], rows: int,
            blocks: int, steps: int) -> dict[str, list[float]]:
    """Seconds of each setting's decode steps of `rows` sequences, blocks of `steps` taking turns
    (the first two steps of a block, which pay for the switch, are not counted)."""
    first = next(iter(models.values()))
    prompt = first.tokenize(PROMPT)
    seconds: dict[str, list[float]] = {name: [] for name in models}
    sequences = {}
    for _ in range(blocks):
        for name, model in models.items():
            undo = apply(settings[name])  # (the prompts' step too: a helper's buffers are sized by its setting)
            try:
                seqs = sequences.get(name)
                if seqs is None or len(seqs[0].tokens) > MAX_LENGTH:
                    seqs = sequences[name] = [model.new_sequence(list(prompt)) for _ in range(rows)]
                    model.step(seqs)
                for i in range(steps + 2):
                    for seq in seqs:
                        seq.append(NEXT_TOKEN)
                    started = time.perf_counter()
                    model.step(seqs)
                    if i >= 2:
                        seconds[name].append(time.perf_counter() - started)
            finally:
                apply(undo)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.turns", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="a model name (fetched if needed) or a GGUF file")
    parser.add_argument("--setting", action="append", default=[], metavar="ASSIGNMENTS",
                        help='module.NAME=value,... ("" for the defaults); give two or more')
    parser.add_argument("--rows", default="1,8", help="sequences per step, comma-separated (default 1,8)")
    parser.add_argument("--blocks", type=int, default=8, help="turns of each setting (default 8)")
    parser.add_argument("--steps", type=int, default=10, help="steps counted per turn (default 10)")
    args = parser.parse_args(argv)
    if len(set(args.setting)) < 2:
        parser.error("give at least two different --setting (\"\" for the defaults)")
    if len(set(args.setting)) < len(args.setting):
        parser.error("a --setting is given twice: each is one load, measured once")
    try:
        settings = {text or "defaults": parse_setting(text) for text in args.setting}
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError as exc:
        parser.error(str(exc))
    from benchmarks import prompts

    path = prompts.model_path(args.model)
    try:
        models = {name: load(path, assignments) for name, assignments in settings.items()}
    except (ValueError, ImportError) as exc:  # a name that is not there
        parser.error(str(exc))
    width = max(len(name) for name in models)
    print(f"{path.name}: median ms per decode step, {args.blocks} turns of {args.steps} steps")
    for n in rows:
        seconds = measure(models, settings, n, args.blocks, args.steps)
        base = statistics.median(next(iter(seconds.values())))
        print(f"{n} sequence{'s' if n > 1 else ''}:")
        for name, values in seconds.items():
            median = statistics.median(values)
            print(f"  {name:{width}s}  {median * 1e3:8.2f}  {median / base:6.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
