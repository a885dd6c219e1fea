"""Embeddings in the engine: final hidden states, pooling, batching, BERT, nomic-bert and
their WordPiece.

The oracle is the float64 reference (engine/reference.py `reference_hidden_states`):
the fast path's final states agree with it for every decoder architecture (chunked
prefill included) and for the tiny BERT and nomic-bert; a pooled vector is the reference's states
pooled and scaled to unit length by hand. The WordPiece tokenizer is checked against
ids worked out by hand from the tiny vocabulary (tests/tiny.py `bert_vocabulary`).
(The agreement with llama.cpp on the real models and the tiny encoders is the slow
tests/test_embeddings_llamacpp.py.)
"""

import numpy as np
import pytest

from engine import load_model
from engine.api import ChatRequest, embedding_groups
from engine.errors import ContextLengthExceeded, UnsupportedModelError
from engine.reference import reference_hidden_states
from tiny import ARCHITECTURES, bert_vocabulary, write_architecture_only, write_tiny_bert, write_tiny_model

STATE_TOLERANCE = 1e-4  # float32 against float64, relative to the states' size (~1): 1e-6 is what they reach

TEXTS = ["Hello, the cat sat on the mat!", "embeddings running", "the dog", "a b c d e f g h i j k l m n o p"]


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    return load_model(write_tiny_bert(tmp_path_factory.mktemp("bert") / "tiny-bert.gguf"))


@pytest.fixture(scope="module")
def nomic_bert(tmp_path_factory):
    return load_model(write_tiny_bert(tmp_path_factory.mktemp("nomic") / "tiny-nomic-bert.gguf",
                                      architecture="nomic-bert"))


@pytest.fixture(scope="module", params=ARCHITECTURES)
def decoder(request, tmp_path_factory):
    return load_model(write_tiny_model(tmp_path_factory.mktemp("tiny") / f"{request.param}.gguf", request.param))


def vector(data: bytes) -> np.ndarray:
    return np.frombuffer(data, "<f4")


def by_hand(states: np.ndarray, pooling: str) -> np.ndarray:
    pooled = {"mean": states.mean(axis=0), "cls": states[0], "last": states[-1]}[pooling]
    return pooled / np.linalg.norm(pooled)


def test_a_decoders_final_states_agree_with_the_reference_whole_and_in_chunks(decoder):
    token_lists = [decoder.tokenize(text) for text in TEXTS]
    for chunk in (512, 3):
        for ids, states in zip(token_lists, decoder.final_states(token_lists, chunk=chunk)):
            np.testing.assert_allclose(states, reference_hidden_states(decoder, ids), rtol=0, atol=STATE_TOLERANCE)


def test_berts_final_states_agree_with_the_reference(bert):
    token_lists = [bert.tokenize(text) for text in TEXTS]
    for ids, states in zip(token_lists, bert.final_states(token_lists)):
        np.testing.assert_allclose(states, reference_hidden_states(bert, ids), rtol=0, atol=STATE_TOLERANCE)


def test_nomic_berts_final_states_agree_with_the_reference_alone_and_batched_together(nomic_bert):
    token_lists = [nomic_bert.tokenize(text) for text in TEXTS]
    together = nomic_bert.final_states(token_lists)
    for ids, states in zip(token_lists, together):
        reference = reference_hidden_states(nomic_bert, ids)
        np.testing.assert_allclose(states, reference, rtol=0, atol=STATE_TOLERANCE)
        np.testing.assert_allclose(nomic_bert.final_states([ids])[0], reference, rtol=0, atol=STATE_TOLERANCE)


def test_a_nomic_bert_reads_word_order_from_its_rotary_positions_alone(nomic_bert):
    # it has no position table: were Q and K not rotated, a mean over reordered tokens would not change
    ids = nomic_bert.tokenize("the cat sat on the mat")
    shuffled = [ids[0], *ids[-2:0:-1], ids[-1]]
    forward, backward = (vector(v) for v in nomic_bert.embed([ids, shuffled], "mean"))
    assert forward @ backward < 0.999
    np.testing.assert_allclose(backward, by_hand(reference_hidden_states(nomic_bert, shuffled), "mean"), atol=1e-5)


@pytest.mark.parametrize("pooling", ["mean", "cls", "last"])
def test_each_pooling_is_the_reference_states_pooled_and_unit_length(bert, decoder, pooling):
    for model in (bert, decoder):
        token_lists = [model.tokenize(text) for text in TEXTS]
        for ids, got in zip(token_lists, model.embed(token_lists, pooling)):
            got = vector(got)
            assert got.shape == (model.hp.n_embd,)
            np.testing.assert_allclose(got, by_hand(reference_hidden_states(model, ids), pooling), atol=1e-5)
            assert abs(np.linalg.norm(got) - 1) < 1e-6


def test_dimensions_keep_the_first_components_at_unit_length(bert):
    ids = bert.tokenize(TEXTS[0])
    full, short = vector(bert.embed([ids])[0]), vector(bert.embed([ids], dimensions=10)[0])
    np.testing.assert_allclose(short, full[:10] / np.linalg.norm(full[:10]), atol=1e-6)


def test_a_batch_of_64_inputs_is_one_forward_step_and_embeds_each_as_alone(bert, nomic_bert, decoder):
    for model in (bert, nomic_bert, decoder):
        token_lists = [model.tokenize(f"the cat {i}") for i in range(64)]
        alone = [vector(model.embed([ids])[0]) for ids in token_lists[:3]]
        steps = model.steps
        together = model.embed(token_lists)
        assert model.steps == steps + 1
        for a, b in zip(alone, together):
            np.testing.assert_allclose(vector(b), a, atol=1e-6)


def test_the_default_pooling_is_the_files_else_mean(tmp_path, decoder):
    assert decoder.pooling == "mean"  # (a chat model's file names none)
    for key, name in ((1, "mean"), (2, "cls"), (3, "last"), (None, "mean")):
        with load_model(write_tiny_bert(tmp_path / f"bert-{key}.gguf", pooling=key)) as model:
            assert model.pooling == name


def test_a_nomic_bert_moe_gguf_is_refused_as_an_architecture_not_supported(tmp_path):
    path = write_architecture_only(tmp_path / "moe.gguf", "nomic-bert-moe")
    with pytest.raises(UnsupportedModelError, match="moe.gguf: architecture 'nomic-bert-moe' is not supported"):
        load_model(path)


def test_an_input_over_the_context_window_is_refused(bert):
    with pytest.raises(ContextLengthExceeded):
        bert.embed([[2] * (bert.n_ctx + 1)])


def test_groups_hold_at_most_the_budget_and_a_long_input_alone():
    assert embedding_groups([3, 3, 3, 10, 1], budget=6) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    assert embedding_groups([1] * 64, budget=512) == [range(0, 64)]
    assert embedding_groups([]) == []


# -- WordPiece ---------------------------------------------------------------------------------------


def pieces(model, text: str) -> list[str]:
    return [model.tokenizer.tokens[i] for i in model.tokenize(text)]


def test_wordpiece_frames_lowercases_and_cuts_at_spaces_and_punctuation(bert):
    assert pieces(bert, "Hello,  the CAT!") == ["[CLS]", "▁hello", "▁,", "▁the", "▁cat", "▁!", "[SEP]"]
    assert bert.tokenize("the", add_special=False) == [bert_vocabulary().index("▁the")]


def test_wordpiece_takes_the_longest_piece_first(bert):
    # "embeddings": "▁embed" then "dings" (not "ding" + "s"); "running": "▁run" + "n" + "ing"
    assert pieces(bert, "embeddings running")[1:-1] == ["▁embed", "dings", "▁run", "n", "ing"]


def test_a_word_with_an_unspellable_part_is_one_unknown_token(bert):
    # "é" is "e" + U+0301 after NFD: no piece holds the accent, so the whole word is [UNK]
    assert pieces(bert, "the café dog")[1:-1] == ["▁the", "[UNK]", "▁dog"]
    assert pieces(bert, "a\u200bb")[1:-1] == ["▁a", "b"]  # (a format character is dropped, not a cut)


def test_an_encoder_asked_to_generate_says_it_only_embeds(bert, nomic_bert):
    for model in (bert, nomic_bert):
        with pytest.raises(UnsupportedModelError, match="embedding model"):
            model.prepare_chat(ChatRequest(messages=[{"role": "user", "content": "hi"}], max_tokens=2))
        with pytest.raises(UnsupportedModelError, match="embedding model"):
            model.step([model.new_sequence([2, 3])])
