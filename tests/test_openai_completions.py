"""POST /v1/completions, and n, logprobs, penalties and logit_bias on chat and Responses,
driven by the real openai SDK over sockets (its parsing is the oracle of the shapes).

The oracles of the values: the engine itself, driven directly (`Model.generate`, with the
same SamplingParams), and the model's logits (`Model.logits`) log-softmaxed here.
"""

import math

import numpy as np
import openai
import pytest
import trio

from engine import ChatRequest, SamplingParams
from server_harness import make_service, start_server, tiny_path  # noqa: F401

TINY_ID = "tiny:chat-q8_0"
PROMPT = "Once upon a time"


@pytest.fixture
async def server(nursery, tiny_path):
    return await start_server(nursery, await make_service([tiny_path]))


async def sdk(server, work):
    """work(client) with a sync OpenAI client, in a worker thread."""
    def run():
        with openai.OpenAI(base_url=f"http://{server.host}:{server.port}/v1", api_key="sk-x", max_retries=0,
                           timeout=60) as client:
            return work(client)
    with trio.fail_after(120):
        return await trio.to_thread.run_sync(run)


def engine_model(server):
    return server.service.registry.get(TINY_ID).model


async def engine_text(model, prompt_ids, max_tokens: int, **sampling) -> str:
    """The engine's own output for a prompt: the oracle of what the server gives."""
    generation = model.generate(prompt_ids, max_tokens=max_tokens, sampling=SamplingParams(**sampling))
    return "".join([token.text async for token in generation])


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64) - row.max()
    return z - np.log(np.exp(z).sum())


# -- /v1/completions ---------------------------------------------------------------------------


async def test_a_completion_is_the_engines_greedy_continuation_of_the_raw_prompt(server):
    model = engine_model(server)
    completion = await sdk(server, lambda c: c.completions.create(model=TINY_ID, prompt=PROMPT, max_tokens=8,
                                                                  temperature=0))
    assert completion.object == "text_completion" and completion.id.startswith("cmpl-")
    [choice] = completion.choices
    assert choice.text == await engine_text(model, model.tokenize(PROMPT), 8, temperature=0)
    assert choice.index == 0 and choice.finish_reason == "length" and choice.logprobs is None
    assert completion.usage.prompt_tokens == len(model.tokenize(PROMPT)) and completion.usage.completion_tokens == 8


async def test_max_tokens_defaults_to_openais_16(server):
    completion = await sdk(server, lambda c: c.completions.create(model=TINY_ID, prompt=PROMPT, temperature=0))
    assert completion.usage.completion_tokens == 16 and completion.choices[0].finish_reason == "length"


async def test_token_id_prompts_and_a_list_of_prompts_give_prompt_major_choices(server):
    model = engine_model(server)
    ids = model.tokenize(PROMPT)
    completion = await sdk(server, lambda c: c.completions.create(
        model=TINY_ID, prompt=[ids, ids[:2]], n=2, max_tokens=4, temperature=0))
    assert [choice.index for choice in completion.choices] == [0, 1, 2, 3]
    first, second = await engine_text(model, ids, 4, temperature=0), await engine_text(model, ids[:2], 4, temperature=0)
    assert [choice.text for choice in completion.choices] == [first, first, second, second]
    assert completion.usage.completion_tokens == 16


async def test_seeded_choices_differ_and_each_repeats(server):
    def work(client):
        return [client.completions.create(model=TINY_ID, prompt=PROMPT, n=3, max_tokens=12, temperature=1.5,
                                          seed=5) for _ in range(2)]
    first, again = await sdk(server, work)
    texts = [choice.text for choice in first.choices]
    assert texts == [choice.text for choice in again.choices] and len(set(texts)) == 3
    model = engine_model(server)
    assert texts[1] == await engine_text(model, model.tokenize(PROMPT), 12, temperature=1.5, seed=6)  # seed + i


async def test_echo_puts_the_prompt_first_and_stop_ends_the_text(server):
    model = engine_model(server)
    plain = await engine_text(model, model.tokenize(PROMPT), 8, temperature=0)
    stop = plain[3:5]
    completion = await sdk(server, lambda c: c.completions.create(model=TINY_ID, prompt=PROMPT, max_tokens=8,
                                                                  temperature=0, echo=True, stop=[stop]))
    choice = completion.choices[0]
    assert choice.text == PROMPT + plain[:plain.index(stop)] and choice.finish_reason == "stop"


async def test_echo_with_logprobs_scores_every_token_of_the_prompt_as_the_model_does(server):
    """How evaluation harnesses score a text: echo, logprobs, one token; the first token's is null."""
    model = engine_model(server)
    ids = model.tokenize(PROMPT)
    completion = await sdk(server, lambda c: c.completions.create(model=TINY_ID, prompt=PROMPT, max_tokens=1,
                                                                  temperature=0, echo=True, logprobs=2))
    choice = completion.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(ids) + 1  # the prompt's tokens, then the one generated
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for t in range(1, len(ids)):
        expected = log_softmax(model.logits(ids[:t])[-1])  # the oracle: the model's logits for the prefix
        assert logprobs.token_logprobs[t] == pytest.approx(expected[ids[t]], abs=1e-4)
        assert max(logprobs.top_logprobs[t].values()) == pytest.approx(expected.max(), abs=1e-4)
    for token, offset in zip(logprobs.tokens[1:], logprobs.text_offset[1:]):
        assert choice.text.startswith(token, offset)  # each offset is where its token's text is


async def test_a_streamed_echo_sends_the_prompts_logprobs_with_its_text(server):
    def work(client):
        asked = dict(model=TINY_ID, prompt=[PROMPT, "A cat"], max_tokens=2, temperature=0, echo=True, logprobs=1)
        return client.completions.create(**asked), list(client.completions.create(**asked, stream=True))
    whole, chunks = await sdk(server, work)
    for index in (0, 1):
        parts = [chunk.choices[0] for chunk in chunks if chunk.choices and chunk.choices[0].index == index]
        streamed = [token for part in parts if part.logprobs for token in part.logprobs.tokens]
        assert parts[0].text.startswith(["Once", "A"][index]) and streamed == whole.choices[index].logprobs.tokens
        assert parts[0].logprobs.token_logprobs[0] is None


async def test_a_streamed_completion_is_the_synchronous_one_in_chunks(server):
    def work(client):
        whole = client.completions.create(model=TINY_ID, prompt=PROMPT, n=2, max_tokens=6, temperature=0)
        chunks = list(client.completions.create(model=TINY_ID, prompt=PROMPT, n=2, max_tokens=6, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
        return whole, chunks
    whole, chunks = await sdk(server, work)
    texts = ["", ""]
    for chunk in chunks[:-1]:
        [choice] = chunk.choices
        texts[choice.index] += choice.text
    assert texts == [choice.text for choice in whole.choices]
    assert [c.choices[0].finish_reason for c in chunks[:-1] if c.choices[0].finish_reason] == ["length", "length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12


async def test_completion_logprobs_are_the_models_log_softmax(server):
    model = engine_model(server)
    completion = await sdk(server, lambda c: c.completions.create(model=TINY_ID, prompt=PROMPT, max_tokens=5,
                                                                  temperature=0, logprobs=3))
    logprobs = completion.choices[0].logprobs
    ids = model.tokenize(PROMPT)
    assert len(logprobs.tokens) == 5 and logprobs.text_offset[0] == 0
    assert "".join(logprobs.tokens) == completion.choices[0].text
    for position, (token_logprob, top) in enumerate(zip(logprobs.token_logprobs, logprobs.top_logprobs)):
        expected = log_softmax(model.logits(ids)[-1])
        best = int(np.argmax(expected))
        assert token_logprob == pytest.approx(expected[best], abs=1e-4) and len(top) == 3
        assert max(top.values()) == pytest.approx(token_logprob)
        ids.append(best)
    assert logprobs.text_offset == [sum(len(t) for t in logprobs.tokens[:i]) for i in range(5)]


@pytest.mark.parametrize("param, kwargs", [
    ("suffix", {"suffix": "The end."}),
    ("best_of", {"best_of": 3}),
    ("logprobs", {"logprobs": 21}),
    ("n", {"n": 9}),
    ("prompt", {"prompt": []}),
    ("prompt[1]", {"prompt": ["a", [-1]]}),
    ("prompt", {"prompt": [[10**9]]}),
    ("logit_bias.1", {"logit_bias": {"1": 101}}),
    ("max_tokens", {"max_tokens": 0}),
    ("stop[0]", {"stop": [""]}),
])
async def test_completion_parameters_refused_are_named(server, param, kwargs):
    def work(client):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(**{"model": TINY_ID, "prompt": PROMPT, **kwargs})
        return caught.value
    error = await sdk(server, work)
    assert error.param == param, error.message


# -- chat and Responses ---------------------------------------------------------------------------


async def test_chat_with_n_gives_each_choice_and_streams_them_by_index(server):
    messages = [{"role": "user", "content": "hi"}]

    def work(client):
        whole = client.chat.completions.create(model=TINY_ID, messages=messages, n=2, max_tokens=6, temperature=1,
                                               seed=3)
        chunks = list(client.chat.completions.create(model=TINY_ID, messages=messages, n=2, max_tokens=6,
                                                     temperature=1, seed=3, stream=True))
        return whole, chunks
    whole, chunks = await sdk(server, work)
    assert [choice.index for choice in whole.choices] == [0, 1]
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == [choice.message.content for choice in whole.choices] and texts[0] != texts[1]
    assert whole.usage.completion_tokens == 12


async def test_chat_logprobs_are_the_models_and_ride_on_the_chunks_too(server):
    messages = [{"role": "user", "content": "hi"}]
    model = engine_model(server)

    def work(client):
        whole = client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=4, temperature=0,
                                               logprobs=True, top_logprobs=2)
        chunks = list(client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=4, temperature=0,
                                                     logprobs=True, top_logprobs=2, stream=True))
        return whole, chunks
    whole, chunks = await sdk(server, work)
    content = whole.choices[0].logprobs.content
    streamed = [entry for chunk in chunks for choice in chunk.choices if choice.logprobs
                for entry in choice.logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content] and len(content) >= 1
    prepared = model.prepare_chat(ChatRequest(messages))
    ids = list(prepared.prompt_ids)
    for entry in content:
        expected = log_softmax(model.logits(ids)[-1])
        best = int(np.argmax(expected))
        assert entry.logprob == pytest.approx(expected[best], abs=1e-4)
        assert bytes(entry.bytes) == model.tokenizer.piece(best) and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        ids.append(best)


async def test_chat_penalties_and_logit_bias_are_the_engines(server):
    messages = [{"role": "user", "content": "hi"}]
    model = engine_model(server)
    banned = model.tokenize(await engine_text(model, model.prepare_chat(
        ChatRequest(messages)).prompt_ids, 1, temperature=0), add_special=False)[0]

    def work(client):
        return client.chat.completions.create(model=TINY_ID, messages=messages, max_tokens=10, temperature=0,
                                              frequency_penalty=1.5, presence_penalty=0.5,
                                              logit_bias={str(banned): -100})
    completion = await sdk(server, work)
    prompt_ids = model.prepare_chat(ChatRequest(messages)).prompt_ids
    expected = await engine_text(model, prompt_ids, 10, temperature=0, frequency_penalty=1.5, presence_penalty=0.5,
                                 logit_bias=((banned, -100.0),))
    assert completion.choices[0].message.content == expected
    assert completion.choices[0].message.content != await engine_text(model, prompt_ids, 10, temperature=0)


async def test_greedy_chat_without_the_new_parameters_is_the_engines_output(server):
    messages = [{"role": "user", "content": "hi"}]
    model = engine_model(server)
    completion = await sdk(server, lambda c: c.chat.completions.create(model=TINY_ID, messages=messages,
                                                                       max_tokens=10, temperature=0))
    prompt_ids = model.prepare_chat(ChatRequest(messages)).prompt_ids
    assert completion.choices[0].message.content == await engine_text(model, prompt_ids, 10, temperature=0)
    assert completion.choices[0].logprobs is None


async def test_responses_include_output_logprobs(server):
    def work(client):
        return client.responses.create(model=TINY_ID, input="hi", max_output_tokens=4, temperature=0,
                                       include=["message.output_text.logprobs"], top_logprobs=2)
    response = await sdk(server, work)
    part = response.output[0].content[0]
    assert part.logprobs and all(len(entry.top_logprobs) == 2 for entry in part.logprobs)
    assert all(math.isfinite(entry.logprob) and entry.logprob <= 0 for entry in part.logprobs)
    assert "".join(entry.token for entry in part.logprobs) == part.text


async def test_responses_stream_carries_logprobs_on_its_deltas(server):
    def work(client):
        events = list(client.responses.create(model=TINY_ID, input="hi", max_output_tokens=4, temperature=0,
                                              include=["message.output_text.logprobs"], stream=True))
        return events
    events = await sdk(server, work)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    done = [e for e in events if e.type == "response.output_text.done"][0]
    streamed = [entry.model_dump() for d in deltas for entry in d.logprobs]
    assert streamed == [entry.model_dump() for entry in done.logprobs] and streamed



# -- agreement with llama.cpp (slow) -----------------------------------------------------------


@pytest.mark.slow
async def test_completion_logprobs_agree_with_llama_cpps_on_smollm2(nursery, smollm2_path):
    """Our /v1/completions logprobs against llama-cpp-python's create_completion(logprobs=5)
    with logits_all (its raw logits, log-softmaxed), greedy, while its top two are 0.5 nats
    apart (nearer, the two may pick apart: at step 6 here its top two are 0.33 apart, and
    ours are the other way round): the same tokens, and each logprob, the picked tokens'
    and the alternatives both report, within the bound tests/test_real_models.py sets for
    our float64 against its float16 K/V and 8-bit activations (0.25 nats)."""
    llama_cpp = pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (the `compare` extra)")
    prompt, steps = "The capital of France is", 8
    def llama_cpp_completion():
        llama = llama_cpp.Llama(str(smollm2_path), n_ctx=256, logits_all=True, n_threads=2, verbose=False)
        return llama.create_completion(prompt, max_tokens=steps, temperature=0, logprobs=5)
    theirs = (await trio.to_thread.run_sync(llama_cpp_completion))["choices"][0]["logprobs"]
    server = await start_server(nursery, await make_service([smollm2_path]))
    model_id = next(iter(server.service.registry)).id

    def work(client):
        return client.completions.create(model=model_id, prompt=prompt, max_tokens=steps, temperature=0, logprobs=5)
    ours = (await sdk(server, work)).choices[0].logprobs
    diffs = []
    for position in range(min(len(ours.tokens), len(theirs["tokens"]))):
        top = sorted(theirs["top_logprobs"][position].values(), reverse=True)
        if top[0] - top[1] < 0.5:
            break  # (a near-tie may be decided either way: the continuations part here)
        assert ours.tokens[position] == theirs["tokens"][position]
        diffs.append(abs(ours.token_logprobs[position] - theirs["token_logprobs"][position]))
        for token, logprob in theirs["top_logprobs"][position].items():
            if token in ours.top_logprobs[position]:
                assert ours.top_logprobs[position][token] == pytest.approx(logprob, abs=0.25)
    assert len(diffs) >= 3 and max(diffs) <= 0.25
