"""The sampler's OpenAI parameters on a tiny model: penalties, logit_bias, logprobs, raw prompts.

Oracles: the model's own logits (`Model.logits`, a fresh context) with numpy's
log-softmax written out here, and OpenAI's definitions of the penalties.
"""

import numpy as np
import pytest

from engine import ChatRequest, SamplingParams
from engine.api import Finished, TextDelta, TokenLogprob
from engine.errors import PromptError
from engine.sampling import Sampler
from test_generate import GREEDY, model, prompt  # noqa: F401 (fixtures)


def log_softmax(row: np.ndarray) -> np.ndarray:
    z = row.astype(np.float64) - row.max()
    return z - np.log(np.exp(z).sum())


async def collect(generation):
    return [token async for token in generation]


async def test_greedy_output_is_the_same_with_logprobs_asked_and_each_logprob_is_the_models(model, prompt):
    plain = await collect(model.generate(prompt, max_tokens=6, sampling=GREEDY))
    reported = await collect(model.generate(prompt, max_tokens=6, sampling=SamplingParams(temperature=0, logprobs=3)))
    assert [t.id for t in reported] == [t.id for t in plain] and all(t.logprob is None for t in plain)
    ids = list(prompt)
    for token in reported:
        expected = log_softmax(model.logits(ids)[-1])
        assert token.logprob.logprob == pytest.approx(expected[token.id], abs=1e-4)  # (float32 logits, another batch)
        top_ids = [i for i, _ in token.logprob.top]
        assert top_ids == list(np.argsort(-expected, kind="stable")[:3]) and top_ids[0] == token.id
        assert [lp for _, lp in token.logprob.top] == pytest.approx(list(np.sort(expected)[::-1][:3]), abs=1e-4)
        ids.append(token.id)


def test_logprobs_are_of_the_raw_logits_not_after_temperature_or_bias():
    logits = np.array([2.0, 1.0, 0.0, -1.0], np.float32)
    sampler = Sampler(SamplingParams(temperature=0.5, logit_bias=((3, 100.0),), logprobs=2, seed=1))
    token = sampler.pick(logits)
    assert token == 3  # the bias decides the pick ...
    reported = sampler.reported.popleft()
    assert reported.logprob == pytest.approx(log_softmax(logits)[3])  # ... not the logprob
    assert [i for i, _ in reported.top] == [0, 1]


def test_logit_bias_is_added_to_the_logits_before_the_pick():
    logits = np.array([3.0, 2.0, 1.0], np.float32)
    assert Sampler(SamplingParams(temperature=0, logit_bias=((2, 2.5),))).pick(logits) == 2
    assert Sampler(SamplingParams(temperature=0, logit_bias=((0, -100.0),))).pick(logits) == 1


def test_penalties_count_the_output_as_openai_defines_them():
    """presence: -p once a token appeared; frequency: -f × its count (OpenAI's definition)."""
    logits = np.array([1.0, 0.9, 0.0], np.float32)
    frequency = Sampler(SamplingParams(temperature=0, frequency_penalty=0.06))
    assert [frequency.pick(logits) for _ in range(4)] == [0, 0, 1, 0]  # 1, 0.94, then 0.88 < 0.9, then 0.88 > 0.84
    presence = Sampler(SamplingParams(temperature=0, presence_penalty=0.2))
    assert [presence.pick(logits) for _ in range(4)] == [0, 1, 0, 0]  # 0.8 < 0.9, then 0.8 > 0.7 for good


def test_no_penalty_or_bias_leaves_the_logits_untouched():
    sampler = Sampler(GREEDY)
    logits = np.array([0.0, 1.0], np.float32)
    assert sampler.pick(logits) == 1 and not sampler.output_counts and not sampler.reported


@pytest.mark.parametrize("field, value", [("presence_penalty", 2.5), ("frequency_penalty", -3.0),
                                          ("logit_bias", ((1, 101.0),)), ("logprobs", 21)])
def test_sampling_parameters_out_of_range_are_refused(field, value):
    with pytest.raises(ValueError):
        SamplingParams(**{field: value})


async def test_a_chat_gives_each_tokens_logprob_before_its_text(model):
    request = ChatRequest([{"role": "user", "content": "hi"}], max_tokens=4,
                          sampling=SamplingParams(temperature=0, logprobs=1))
    events = [e async for e in model.generate_chat(model.prepare_chat(request))]
    logprobs = [e for e in events if isinstance(e, TokenLogprob)]
    assert isinstance(events[-1], Finished) and len(logprobs) == events[-1].output_tokens
    assert events[0] == logprobs[0]
    pieces = b"".join(e.piece for e in logprobs).decode("utf-8", "replace")
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) in pieces


async def test_a_raw_prompt_is_generated_without_the_chat_template(model, prompt):
    request = ChatRequest([], max_tokens=5, sampling=GREEDY)
    prepared = model.prepare_text("Once upon a time", request)
    assert prepared.prompt_ids == prompt and prepared.prompt == "Once upon a time"
    text = "".join([e.text async for e in model.generate_chat(prepared) if isinstance(e, TextDelta)])
    expected = await collect(model.generate(prompt, max_tokens=5, sampling=GREEDY))
    assert text == "".join(t.text for t in expected)
    from_ids = model.prepare_text(prompt, request)
    assert from_ids.prompt_ids == prompt and from_ids.prompt == model.detokenize(prompt)
    with pytest.raises(PromptError):
        model.prepare_text([model.tokenizer.n_vocab], request)
