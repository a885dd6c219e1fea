"""Continuous batching and the prefix cache change no output.

Greedy generation must give the same tokens alone, batched with other sequences
(whose prompts are prefilled in chunks between decode steps), and starting from
a cached prefix. The batched matmuls run over different numbers of rows than the
lone ones, and BLAS may sum a row in a different order then, so "the same" means:
identical tokens, except where the model's top two candidates are within
NEAR_TIE nats of each other (there a last-bit difference may pick the other one,
and the sequences go their own ways after it).
"""

import threading

import numpy as np
import pytest
import trio

from engine import architectures
from engine.errors import ModelClosed, QueueFull
from engine.kv_cache import KVCache, Sequence
from engine.model import Model, load_model
from engine.prefix_cache import PrefixCache
from engine.scheduler import Scheduler
from tiny import write_tiny_model
from waiting import wait_until

NEAR_TIE = 0.01  # nats between the top two logits


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    with load_model(write_tiny_model(path, request.param)) as model:
        yield model


@pytest.fixture
def schedulers(model):
    """Make schedulers over the model, each closed (its thread joined) when the test ends."""
    made = []

    def make(**settings) -> Scheduler:
        made.append(Scheduler(model, **settings))
        return made[-1]

    yield make
    for scheduler in made:
        scheduler.close()


def greedy(logits: np.ndarray) -> int:
    return int(np.argmax(logits))


def prompt(n: int, seed: int) -> list[int]:
    return [1] + np.random.default_rng(seed).integers(2, 40000, n - 1).tolist()


async def generate(scheduler: Scheduler, prompt_ids: list[int], n: int,
                   decoding: trio.Event | None = None) -> tuple[list[int], int]:
    """Greedy tokens and cached prompt tokens; `decoding` is set at the first token."""
    with scheduler.submit(prompt_ids, pick=greedy, max_tokens=n) as generation:
        tokens = []
        async for step in generation:
            tokens.append(step.token)
            if decoding is not None:
                decoding.set()
    return tokens, generation.cached_tokens


def assert_same_greedy(model, prompt_ids: list[int], expected: list[int], got: list[int]) -> None:
    """Equal, or equal up to a position where the expected choice was a near tie."""
    assert len(got) == len(expected)
    for i, (a, b) in enumerate(zip(expected, got)):
        if a != b:
            row = model.logits(prompt_ids + expected[:i])[-1]             # (V,)
            top2 = np.sort(row)[-2:]
            assert top2[1] - top2[0] < NEAR_TIE, f"token {i}: {b} instead of {a}, not a near tie"
            return


def alone(model) -> Scheduler:
    """A scheduler that runs one sequence at a time and remembers no prefix."""
    return Scheduler(model, max_batch=1, prefix_cache_bytes=0)


PROMPTS = [(3, 1), (40, 2), (150, 3), (300, 4), (9, 5)]  # (length, seed): some longer than a chunk


async def test_batched_generation_equals_alone(model, schedulers):
    expected = [await generate(alone(model), prompt(n, s), 12) for n, s in PROMPTS]

    scheduler = schedulers(max_batch=4, prefill_chunk=128, prefix_cache_bytes=0)
    got = [None] * len(PROMPTS)
    decoding = [trio.Event() for _ in PROMPTS]

    async def run(i: int, n: int, seed: int) -> None:
        if i:
            await decoding[i - 1].wait()   # each joins once the one before it decodes
        got[i] = await generate(scheduler, prompt(n, seed), 12, decoding[i])

    steps = model.steps
    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i, (n, seed) in enumerate(PROMPTS):
                nursery.start_soon(run, i, n, seed)
    for (n, seed), (want, _), (tokens, cached) in zip(PROMPTS, expected, got):
        assert cached == 0
        assert_same_greedy(model, prompt(n, seed), want, tokens)
    # they shared steps: fewer than the lone runs would take (ceil(prompt/chunk) + 11 each)
    assert model.steps - steps < sum(-(-n // 128) + 11 for n, _ in PROMPTS)


async def test_a_burst_of_prompts_takes_at_most_its_share_of_a_running_streams_time(model, schedulers, monkeypatch):
    """While a stream decodes, the steps that feed prompts take at most `prefill_share` of the
    worker's time, by a clock the test turns (a step that feeds prompts takes 1 s, one without
    0.1 s): after each, the streams get 1 * 0.4 / 0.6 s of steps of their own, 7 of them, before
    the next prompt chunk. Nobody's tokens change."""
    now, kinds = [0.0], []  # kinds: per step, "prompt" (it fed prompt tokens) or "decode"
    step = model.step

    def timed_step(sequences, **kwargs):
        feeds_prompts = any(seq.n_pending > 1 for seq in sequences)
        kinds.append("prompt" if feeds_prompts else "decode")
        now[0] += 1.0 if feeds_prompts else 0.1
        return step(sequences, **kwargs)

    stream_prompt, burst = prompt(20, 1), [prompt(150, seed) for seed in (2, 3, 4)]
    expected = [await generate(alone(model), ids, n) for ids, n in [(stream_prompt, 120)] + [(b, 4) for b in burst]]
    monkeypatch.setattr(model, "step", timed_step)
    scheduler = schedulers(prefill_chunk=64, prefill_share=0.6, speculate=False, prefix_cache_bytes=0,
                           clock=lambda: now[0])
    got, streaming = [None] * 4, trio.Event()

    async def run(i: int, ids: list[int], n: int) -> None:
        got[i] = await generate(scheduler, ids, n, streaming if i == 0 else None)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, 0, stream_prompt, 120)
            await streaming.wait()
            arrived = len(kinds)
            for i, ids in enumerate(burst, 1):
                nursery.start_soon(run, i, ids, 4)
    during = "".join("p" if kind == "prompt" else "d" for kind in kinds[arrived:]).strip("d")
    assert during.count("p") == 9  # (three prompts of 150 tokens, in chunks of at most 64)
    assert all(len(run_) == 7 for run_ in during.split("p")[1:-1])  # 7 steps of the streams' own between
    for (want, _), (tokens, _), ids in zip(expected, got, [stream_prompt] + burst):
        assert_same_greedy(model, ids, want, tokens)


async def test_prefix_cache_gives_the_same_tokens(model):
    scheduler = Scheduler(model)
    first_prompt = prompt(60, 7)
    first, cached = await generate(scheduler, first_prompt, 10)
    assert cached == 0
    # the next turn: the whole first sequence, then new tokens
    second_prompt = first_prompt + first + prompt(20, 8)[1:]
    second, cached = await generate(scheduler, second_prompt, 10)
    assert cached == len(first_prompt) + len(first) - 1   # the last generated token was never fed
    assert_same_greedy(model, second_prompt, (await generate(alone(model), second_prompt, 10))[0], second)
    # a shared beginning (a system prompt) is reused too, by a prompt that then differs
    third_prompt = first_prompt[:30] + prompt(15, 9)[1:]
    third, cached = await generate(scheduler, third_prompt, 10)
    assert cached == 30
    assert_same_greedy(model, third_prompt, (await generate(alone(model), third_prompt, 10))[0], third)


@pytest.mark.parametrize("prefix_cache_bytes", [256 << 20, 0])  # resumed from the prefix cache, or recomputed
async def test_kv_budget_preempts_the_newest_and_changes_no_output(model, schedulers, monkeypatch,
                                                                   prefix_cache_bytes):
    """Two requests fit the KV budget when they join, not once their caches grow: the newer
    one leaves the batch, waits, and resumes where it was, with the tokens it gives alone."""
    per_position = model.kv_bytes_per_position
    budget = 900 * per_position  # both at 256 positions, one at 512 beside one at 256; not both at 512
    # (without drafts: a request taking several tokens a step would outrun the growth it stages)
    scheduler = schedulers(kv_cache_bytes=budget, prefix_cache_bytes=prefix_cache_bytes, speculate=False)
    prompts = [prompt(100, 21), prompt(100, 22)]
    expected = [(await generate(alone(model), p, 300))[0] for p in prompts]
    together = []

    def step(sequences, **kwargs):
        if len(sequences) > 1:
            together.append(sum(seq.cache.nbytes for seq in sequences))
        return Model.step(model, sequences, **kwargs)

    monkeypatch.setattr(model, "step", step)
    generations, got = [], [None, None]
    first_decodes = trio.Event()

    async def run(i: int) -> None:
        if i:
            await first_decodes.wait()  # the second joins while the first decodes
        with scheduler.submit(prompts[i], pick=greedy, max_tokens=300) as generation:
            generations.append(generation)
            got[i] = []
            async for step in generation:
                got[i].append(step.token)
                first_decodes.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            for i in range(2):
                nursery.start_soon(run, i)
    for p, want, tokens in zip(prompts, expected, got):
        assert_same_greedy(model, p, want, tokens)
    assert together and max(together) <= budget   # they did share steps, within the budget
    assert [g.preempted for g in generations] == [0, 1]
    assert [g.cached_tokens for g in generations] == [0, 0]  # its own tokens are not "cached" prompt


async def test_32_running_requests_stay_within_the_kv_budget_and_give_their_lone_tokens(model, schedulers,
                                                                                       monkeypatch):
    """`max_batch` 32: all of them step together, and when their caches outgrow the budget the
    newest leave, wait and resume; the tokens are those each gives alone."""
    prompts = [prompt(200, 100 + i) for i in range(32)]
    # 24 join at 512 positions each (their first growth counted), 8 more once the first hold
    # 256 each; all 32 do not fit once they grow past 256
    budget = 32 * 384 * model.kv_bytes_per_position
    # (prefill_share 1: the prompts take every step they can, so that all 32 run and grow together)
    scheduler = schedulers(max_batch=32, kv_cache_bytes=budget, prefix_cache_bytes=0, speculate=False,
                           prefill_share=1.0)
    running, held = [], []
    step = scheduler._step

    def step_and_count(active):
        running.append(len(active))
        held.append(sum(r.seq.cache.nbytes for r in active))
        step(active)

    monkeypatch.setattr(scheduler, "_step", step_and_count)
    generations, got = [None] * 32, [None] * 32

    async def run(i: int) -> None:
        with scheduler.submit(prompts[i], pick=greedy, max_tokens=100) as generation:
            generations[i] = generation
            got[i] = [step.token async for step in generation]

    with trio.fail_after(120):
        async with trio.open_nursery() as nursery:
            for i in range(32):
                nursery.start_soon(run, i)
    assert max(running) == 32 and max(held) <= budget
    assert sum(g.preempted for g in generations) > 0
    monkeypatch.undo()
    for i in (0, 31):  # the oldest, and the newest, preempted first
        assert_same_greedy(model, prompts[i], (await generate(alone(model), prompts[i], 100))[0], got[i])


async def test_a_preempted_request_cancelled_while_it_waits_is_gone(model, schedulers):
    scheduler = schedulers(kv_cache_bytes=900 * model.kv_bytes_per_position, speculate=False)
    first = scheduler.submit(prompt(100, 25), pick=greedy, max_tokens=300)
    with trio.fail_after(30):
        await first.__anext__()       # it decodes
    with scheduler.submit(prompt(100, 26), pick=greedy, max_tokens=300) as second:
        await wait_until(lambda: second.preempted, "the second request preempted")  # it waits, first in the queue
    # cancelled while it waits: the first runs to its end, and the worker stops
    with trio.fail_after(30):
        assert len([s async for s in first]) == 299
    await wait_until(lambda: not scheduler.running, "the worker stopped")
    assert scheduler.n_waiting == 0


async def test_a_request_cancelled_while_it_is_preempted_does_not_go_back_to_the_queue(model, schedulers,
                                                                                       monkeypatch):
    """A cancel that comes while the worker preempts the request (storing its cache, before
    it is queued again) found it in no queue: it must not be queued all the same, where it
    would hold a place in `max_queue`, and the head of the queue, for nobody."""
    scheduler = schedulers(kv_cache_bytes=900 * model.kv_bytes_per_position, speculate=False)
    first = scheduler.submit(prompt(100, 27), pick=greedy, max_tokens=300)
    with trio.fail_after(30):
        await first.__anext__()       # it decodes
    second = scheduler.submit(prompt(100, 28), pick=greedy, max_tokens=300)
    store, step, stale = scheduler.prefix_cache.store, scheduler._step, []

    def store_and_cancel(seq):        # (in the worker thread, halfway through the preemption)
        if seq is second._request.seq:
            scheduler._cancel(second._request)
        store(seq)

    def step_and_look(active):
        stale.extend(r for r in scheduler._waiting if r.cancelled)
        step(active)

    monkeypatch.setattr(scheduler.prefix_cache, "store", store_and_cancel)
    monkeypatch.setattr(scheduler, "_step", step_and_look)
    with trio.fail_after(30):
        async for _ in second:         # its stream ends: nothing more will come
            pass
        assert len([s async for s in first]) == 299
    assert second.preempted == 1 and not stale


async def test_a_request_over_the_kv_budget_runs_alone(model):
    scheduler = Scheduler(model, kv_cache_bytes=10 * model.kv_bytes_per_position, prefix_cache_bytes=0,
                          speculate=False)  # (drafts would take fewer steps than it counts)
    prompts = [prompt(20, 23), prompt(30, 24)]
    expected = [(await generate(alone(model), p, 8))[0] for p in prompts]
    steps = model.steps
    got = [None, None]

    async def run(i: int) -> None:
        got[i] = (await generate(scheduler, prompts[i], 8))[0]

    async with trio.open_nursery() as nursery:
        for i in range(2):
            nursery.start_soon(run, i)
    assert got == expected
    assert model.steps - steps == 2 * 8  # one after the other: a prefill and 7 decode steps each


async def test_queue_full_raises_and_frees_on_cancel(model):
    scheduler = Scheduler(model, max_batch=1, max_queue=2)
    generations = []
    with pytest.raises(QueueFull) as raised:
        for _ in range(10):
            generations.append(scheduler.submit(prompt(5, 1), pick=greedy, max_tokens=100))
    assert raised.value.retry_after >= 1
    assert 2 <= len(generations) <= 3   # the worker may have taken one into the batch already
    for generation in generations:
        generation.cancel()
    scheduler.submit(prompt(5, 1), pick=greedy, max_tokens=1).cancel()   # room again


async def test_a_client_that_leaves_during_a_long_prefill_frees_the_worker_at_the_next_layer(
        model, schedulers, monkeypatch):
    """Its prompt's second chunk is in the first layer when the client leaves: the worker stops
    before the next layer (it never runs, here it would hold the worker for good), and the
    prefix cache keeps only the first chunk, which a new request's tokens confirm."""
    scheduler = schedulers(prefill_chunk=64, speculate=False)
    long_prompt = prompt(150, 40)
    expected = (await generate(alone(model), long_prompt, 5))[0]
    block = architectures.BLOCKS[model.hp.architecture]
    in_second_chunk, client_left, released = threading.Event(), threading.Event(), threading.Event()

    def slow_block(x, blk, hp, batch, layer, **kwargs):  # (in the worker thread)
        if batch.starts == [64]:      # the second chunk
            if layer == 0:
                in_second_chunk.set()
                client_left.wait(30)
            else:                     # a later layer of the step nobody waits for
                released.wait(30)
        return block(x, blk, hp, batch, layer, **kwargs)

    monkeypatch.setitem(architectures.BLOCKS, model.hp.architecture, slow_block)
    try:
        generation = scheduler.submit(long_prompt, pick=greedy, max_tokens=5)
        await trio.to_thread.run_sync(in_second_chunk.wait, 30)
        generation.cancel()
        client_left.set()
        with trio.fail_after(10):
            await wait_until(lambda: not scheduler.running, "the worker stopped")
    finally:
        released.set()
    monkeypatch.undo()
    with trio.fail_after(30):
        tokens, cached = await generate(scheduler, long_prompt, 5)
    assert (tokens, cached) == (expected, 64)


async def test_cancelled_request_leaves_the_batch(model, schedulers):
    scheduler = schedulers(max_batch=4)
    other_prompt = prompt(20, 11)
    expected, _ = await generate(alone(model), other_prompt, 30)
    steps = model.steps

    async def other() -> list[int]:
        return (await generate(scheduler, other_prompt, 30))[0]

    result = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _collect(other, result))
        with scheduler.submit(prompt(10, 12), pick=greedy, max_tokens=400) as generation:
            async for i, _ in _aenumerate(generation):
                if i == 3:
                    break
    assert_same_greedy(model, other_prompt, expected, result[0])
    # nothing left running: the cancelled one is out (it would have run hundreds more steps)
    await wait_until(lambda: not scheduler.running, "the worker stopped")
    assert model.steps - steps < 60


async def test_a_failing_pick_fails_only_its_own_request(model):
    def broken(logits: np.ndarray) -> int:
        raise RuntimeError("sampler bug")

    scheduler = Scheduler(model)
    expected, _ = await generate(alone(model), prompt(12, 4), 6)
    result = []
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _collect(lambda: generate(scheduler, prompt(12, 4), 6), result))
        with pytest.raises(RuntimeError, match="sampler bug"):
            with scheduler.submit(prompt(8, 5), pick=broken, max_tokens=5) as generation:
                async for _ in generation:
                    pass
    assert_same_greedy(model, prompt(12, 4), expected, result[0][0])


async def test_a_sequence_that_cannot_be_made_fails_only_its_own_request(model, monkeypatch):
    # a KV cache that cannot be allocated (MemoryError for a long prompt) as the request
    # joins the batch: it was lost between the queue and the batch, its reader waited forever
    bad = prompt(30, 13)
    new_sequence = model.new_sequence

    def failing(tokens, *args, **kwargs):
        if list(tokens) == bad:
            raise MemoryError("no room for this cache")
        return new_sequence(tokens, *args, **kwargs)

    monkeypatch.setattr(model, "new_sequence", failing)
    scheduler = Scheduler(model, prefix_cache_bytes=0)
    expected, _ = await generate(alone(model), prompt(12, 4), 6)
    result = []
    with trio.fail_after(30):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(lambda: _collect(lambda: generate(scheduler, prompt(12, 4), 6), result))
            with pytest.raises(MemoryError):
                await generate(scheduler, bad, 5)
        assert_same_greedy(model, prompt(12, 4), expected, result[0][0])
        assert (await generate(scheduler, prompt(12, 4), 6))[0] == result[0][0]   # it still serves


async def test_close_ends_the_requests_and_stops_the_worker(model, schedulers):
    """Closing a scheduler (as Model.close does) ends the requests still running, returns
    once its worker thread has stopped, and refuses new requests."""
    scheduler = schedulers()
    generation = scheduler.submit(prompt(20, 30), pick=greedy, max_tokens=400)
    waiting = scheduler.submit(prompt(20, 31), pick=greedy, max_tokens=400)
    with trio.fail_after(30):
        await generation.__anext__()
        await trio.to_thread.run_sync(scheduler.close)
        assert not scheduler.running and scheduler.n_waiting == 0
        for stream in (generation, waiting):
            with pytest.raises(ModelClosed):
                async for _ in stream:
                    pass
    with pytest.raises(ModelClosed):
        scheduler.submit(prompt(5, 1), pick=greedy, max_tokens=1)
    scheduler.close()  # (again: nothing)


async def test_context_full_ends_with_length(model):
    with Scheduler(model).submit(prompt(model.n_ctx - 4, 3), pick=greedy, max_tokens=100) as generation:
        steps = [step async for step in generation]
    assert len(steps) == 4 and steps[-1].finish_reason == generation.finish_reason == "length"


def test_prefix_cache_is_lru_bounded_in_bytes():
    def finished(tokens: list[int]) -> Sequence:
        seq = Sequence(tokens, KVCache(1, 1, 4, 4, 64, capacity=16))   # every entry: the same bytes
        seq.cache.length = len(tokens)
        return seq

    size = finished([1] * 16).cache.nbytes
    cache = PrefixCache(max_bytes=2 * size)
    cache.store(finished(list(range(16))))
    cache.store(finished(list(range(100, 116))))
    cache.start(list(range(10)) + [99], lambda t: finished([]))    # touch the first: most recent
    cache.store(finished(list(range(200, 216))))                    # evicts the second
    assert len(cache) == 2 and cache.nbytes <= 2 * size
    assert cache.start(list(range(100, 120)), lambda t: Sequence(t, KVCache(1, 1, 4, 4, 64)))[1] == 0
    seq, n = cache.start(list(range(20)), lambda t: Sequence(t, KVCache(1, 1, 4, 4, 64)))
    assert n == 16 and seq.tokens == list(range(20)) and seq.cache.length == 16
    cache.store(finished(list(range(16)) + [5, 6]))                 # extends an entry: replaces it
    assert len(cache) == 2


def test_prefix_cache_keeps_what_an_entry_holds_not_the_room_it_grew():
    """A cache that doubled its storage for a last few tokens is stored, when the budget is
    short, as a copy of its positions: the budget counts (and holds) what is cached."""
    seq = Sequence(list(range(40)), KVCache(2, 1, 4, 4, 128, capacity=32))
    seq.cache.reserve(40)                                           # doubled: room for 64
    for layer in range(2):
        seq.cache.store(layer, 0, np.full((40, 1, 4), layer + 1.0, np.float32), np.ones((40, 1, 4), np.float32))
    seq.cache.length = 40
    assert seq.cache.capacity == 64
    kept = Sequence(list(range(40)), KVCache(2, 1, 4, 4, 128, capacity=40)).cache.nbytes
    cache = PrefixCache(max_bytes=kept)                             # room for what it holds only
    cache.store(seq)
    assert len(cache) == 1 and cache.nbytes == kept
    again, n = cache.start(list(range(41)), lambda t: Sequence(t, KVCache(2, 1, 4, 4, 128)))
    assert n == 40 and all(again.cache.keys[layer][0, :40].min() == layer + 1 for layer in range(2))


@pytest.mark.slow
async def test_real_model_batched_and_cached_equal_alone(smollm2_path):
    """SmolLM2: three chats alone, then at once, then the first again from the prefix cache."""
    with load_model(smollm2_path) as model:
        chats = [model.tokenize(model.apply_chat_template([{"role": "user", "content": q}]), parse_special=True)
                 for q in ("What is the capital of France?", "Name three fruits.", "Write a haiku about rain.")]
        expected = [(await generate(alone(model), ids, 12))[0] for ids in chats]
        got = [None] * len(chats)

        async def run(i: int) -> None:
            got[i] = (await generate(model.scheduler, chats[i], 12))[0]

        async with trio.open_nursery() as nursery:
            for i in range(len(chats)):
                nursery.start_soon(run, i)
        for ids, want, tokens in zip(chats, expected, got):
            assert_same_greedy(model, ids, want, tokens)
        again, cached = await generate(model.scheduler, chats[0], 12)
        assert cached == len(chats[0]) - 1
        assert_same_greedy(model, chats[0], expected[0], again)


async def _collect(fn, out: list) -> None:
    out.append(await fn())


async def _aenumerate(iterator):
    i = 0
    async for item in iterator:
        yield i, item
        i += 1
