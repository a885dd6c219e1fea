"""Forward passes of the tiny random-weight models, and their building blocks.

The fast path's ways of running tokens are held to the float64 reference
(engine/reference.py) in tests/test_reference.py; here: a forked or grown and
truncated cache against the reference too, the model's metadata and errors, and
the engine's building blocks (RoPE, attention, activations, RMSNorm) against the
reference's plain versions of them.
"""

from types import SimpleNamespace

import numpy as np
import pytest
from gguf import GGUFWriter

from engine import ModelFileError, ModelInfo, SamplingParams, UnsupportedModelError, load_model
from engine import reference
from engine.architectures import (attend, attend_one_each, geglu, neox_pairs_order, rms_norm, rope_angles, rope_pairs,
                                  swiglu)
from engine.reference import reference_logits
from engine.sampling import Sampler
from test_reference import assert_agrees
from tiny import ARCHITECTURES, write_architecture_only, write_tiny_model

TEXT = "The quick brown fox jumps over the lazy dog, and then it runs far away into the woods."


@pytest.fixture(scope="module", params=ARCHITECTURES)
def model(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / f"tiny-{request.param}.gguf"
    return load_model(write_tiny_model(path, request.param))


@pytest.fixture(scope="module")
def ids(model):
    ids = model.tokenize(TEXT)
    assert len(ids) > 16  # long enough to cross gemma3's sliding window of 8
    return ids


def test_logits_shape_and_fresh_context(model, ids):
    first = model.logits(ids)
    assert first.dtype == np.float32 and first.shape == (len(ids), model.info.n_vocab)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(model.logits(ids), first)


def test_forked_cache_continues_like_a_fresh_one(model, ids):
    seq = model.new_sequence(ids[:12])
    model.step([seq])
    fork = seq.fork(8)
    assert fork.cache.length == 8
    fork.tokens.extend(ids[8:15])
    out = model.step([fork], all_logits=True)[0]
    assert_agrees(out, reference_logits(model, ids[:15])[8:])


def test_cache_grows_past_its_initial_capacity(model, ids):
    seq = model.new_sequence(ids[:2], capacity=2)
    model.step([seq])
    for token in ids[2:]:
        seq.append(token)
        model.step([seq])
    assert seq.cache.length == len(ids) and seq.cache.capacity >= len(ids)
    seq.cache.truncate(4)
    seq.tokens[4:] = [ids[4]]
    assert_agrees(model.step([seq])[0], reference_logits(model, ids[:5])[-1:])


def test_info(model):
    info = model.info
    assert isinstance(info, ModelInfo)
    assert info.architecture in ARCHITECTURES
    assert info.quantization == "Q8_0"
    assert info.n_vocab == 49152 and info.n_embd == 64
    assert info.context_length == 512 and info.has_chat_template
    assert info.n_params > 0 and info.size_bytes > 0
    assert set(info.capabilities) <= {"tools", "structured_output"}  # no <think> in ChatML


def test_sampling_is_deterministic(model, ids):
    logits = model.logits(ids)[-1]                             # (V,)
    logits = logits / logits.std()                             # a spread-out distribution
    greedy = Sampler(SamplingParams(temperature=0))
    assert greedy.pick(logits) == int(np.argmax(logits)) == greedy.pick(logits)
    params = SamplingParams(temperature=1.5, top_k=50, top_p=0.95, min_p=0.01, seed=1234)
    s1, s2 = Sampler(params), Sampler(params)
    draws = [s1.pick(logits) for _ in range(20)]
    assert draws == [s2.pick(logits) for _ in range(20)]
    assert len(set(draws)) > 1


def test_sampling_filters():
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))   # probabilities at temperature 1
    def draws(**params):
        sampler = Sampler(SamplingParams(seed=0, **params))
        return {sampler.pick(logits) for _ in range(300)}
    assert draws() == {0, 1, 2, 3}
    assert draws(top_k=1) == draws(top_p=0.4) == draws(min_p=0.7) == {0}
    assert draws(top_k=2) == draws(top_p=0.6) == draws(min_p=0.5) == {0, 1}
    assert draws(top_p=0.85) == {0, 1, 2}


def test_unknown_architecture_names_the_file(tmp_path):
    path = write_architecture_only(tmp_path / "odd.gguf", "mamba")
    with pytest.raises(UnsupportedModelError, match="odd.gguf.*mamba"):
        load_model(path)


def test_missing_tensor_names_the_file_and_tensor(tmp_path):
    path = tmp_path / "partial.gguf"
    w = GGUFWriter(str(path), "llama")
    for add, value in ((w.add_context_length, 64), (w.add_embedding_length, 32), (w.add_block_count, 1),
                       (w.add_feed_forward_length, 64), (w.add_head_count, 2)):
        add(value)
    w.add_tensor("token_embd.weight", np.zeros((10, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelFileError, match="partial.gguf.*blk.0.attn_q.weight"):
        load_model(path)


def test_rope_freq_factors_and_linear_scaling_load(tmp_path):
    """Llama 3.1's rope_freqs and linear RoPE scaling are read and applied as the reference
    applies them; dividing every frequency by 2 is the same rotation as halving positions."""
    ids = list(range(100, 120))
    plain = load_model(write_tiny_model(tmp_path / "plain.gguf", "llama"))
    factors = load_model(write_tiny_model(tmp_path / "f.gguf", "llama", rope_freq_factors=(2.0,) * 8))
    linear = load_model(write_tiny_model(tmp_path / "l.gguf", "llama", rope_scaling_factor=2.0))
    assert factors.hp.rope_freq_factors == (2.0,) * 8 and linear.hp.rope_scale == 0.5
    assert_agrees(linear.logits(ids), reference_logits(linear, ids))
    assert_agrees(factors.logits(ids), reference_logits(linear, ids))
    assert np.abs(plain.logits(ids) - linear.logits(ids)).max() > 1e-3


def test_context_window_cap(tmp_path):
    model = load_model(write_tiny_model(tmp_path / "m.gguf", "llama"), n_ctx=32)
    assert model.info.context_length == 32
    with pytest.raises(ValueError):
        model.logits(list(range(33)))


# --- the building blocks against the reference's plain versions ----------------------------


@pytest.mark.parametrize("architecture", ["llama", "qwen2"])  # adjacent pairs; NEOX pairs
@pytest.mark.parametrize("hd", [8, 12])  # 12: the last 4 dimensions are not rotated
@pytest.mark.parametrize("scale, factors", [(1.0, None), (0.5, (1.0, 2.0, 1.0, 4.0))])
def test_rope_pairs_and_the_neox_order(architecture, hd, scale, factors):
    """rope_pairs turns adjacent pairs (llama); with NEOX's dimensions reordered by
    neox_pairs_order, it turns NEOX's pairs (i, i + rope_dim/2) as NEOX does; the angles
    (rope_angles) scale positions and divide frequencies by their factors."""
    hp = SimpleNamespace(architecture=architecture, rope_dim=8, rope_base=10000.0, rope_scale=scale,
                         rope_freq_factors=factors)
    rng = np.random.default_rng(0)
    n = 6
    qkv = rng.standard_normal((n, 2 * hd + 5)).astype(np.float32)
    x = qkv[:, : 2 * hd].reshape(n, 2, hd)                     # (n, heads, hd), rows strided as in attention
    cos, sin = rope_angles(np.arange(n), 8, 10000.0, scale, factors)  # (n, 4)
    turns = (cos + 1j * sin).astype(np.complex64)
    if architecture == "llama":
        out = rope_pairs(x, turns)
    else:
        order = neox_pairs_order(hd, 8)
        out = np.empty_like(x)
        out[..., order] = rope_pairs(np.ascontiguousarray(x[..., order]), turns)  # back in the file's order
    np.testing.assert_array_equal(out[..., 8:], x[..., 8:])
    np.testing.assert_allclose(out, reference.rope(x.astype(np.float64), hp, local=False), rtol=0, atol=1e-6)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("block", [128, 2])
@pytest.mark.parametrize("T", [5, 1])  # a chunk of a prompt; one decoding query
@pytest.mark.parametrize("keys_first_min_keys", [1, 10**9])  # one query's scores as keys @ q.T, or not
def test_attend_against_the_reference(window, block, T, keys_first_min_keys, monkeypatch):
    monkeypatch.setattr("engine.tuning.ATTENTION_BLOCK", block)
    monkeypatch.setattr("engine.tuning.KEYS_FIRST_MIN_KEYS", keys_first_min_keys)
    rng = np.random.default_rng(1)
    L, n_head, n_kv, hd = 9, 4, 2, 8
    q = rng.standard_normal((L, n_head, hd))                   # (L, n_head, hd): every position's queries
    k, v = rng.standard_normal((2, L, n_kv, hd))               # (L, n_kv, hd) each
    expected = reference.causal_attention(q, k, v, window)[L - T:]  # (T, n_head, hd): the last T queries
    # keys and values as the cache gives them: the first L positions of a longer buffer
    keys, values = (np.zeros((n_kv, 16, hd), np.float32) for _ in range(2))
    keys[:, :L], values[:, :L] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    out = attend(q[L - T:].astype(np.float32), keys[:, :L], values[:, :L], np.arange(L - T, L), window,
                 1 / np.sqrt(hd))
    np.testing.assert_allclose(out.reshape(T, n_head, hd), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("keys_first_min_keys", [4, 10**9])  # some or no sequence's scores as keys @ q.T
def test_one_query_each_gives_the_floats_of_one_sequence_at_a_time(window, keys_first_min_keys, monkeypatch):
    """A decode step of a batch attends every sequence at once: the same floats as alone."""
    monkeypatch.setattr("engine.tuning.KEYS_FIRST_MIN_KEYS", keys_first_min_keys)
    rng = np.random.default_rng(2)
    n_head, n_kv, hd = 6, 2, 8
    lengths = [1, 7, 2, 12]
    q = rng.standard_normal((len(lengths), n_head, hd)).astype(np.float32)
    caches = [(rng.standard_normal((n_kv, 16, hd)).astype(np.float32)[:, :L],
               rng.standard_normal((n_kv, 16, hd)).astype(np.float32)[:, :L]) for L in lengths]
    positions = np.array(lengths) - 1
    out = attend_one_each(q, caches, positions, window, 0.3)
    for i, (keys, values) in enumerate(caches):
        np.testing.assert_array_equal(out[i: i + 1], attend(q[i: i + 1], keys, values, positions[i: i + 1],
                                                            window, 0.3))


@pytest.mark.parametrize("rows", [3, 600])  # 600 x 512 values: split over the threads in row blocks
def test_gated_activations_and_rms_norm_against_the_reference(rows):
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((rows, 512)) * 4).astype(np.float32)
    gate[0, :4] = [-100.0, -1000.0, 100.0, 0.0]                # exp(-x) overflows, and saturation
    up = rng.standard_normal((rows, 512)).astype(np.float32)
    x, up64 = gate.astype(np.float64), up.astype(np.float64)
    np.testing.assert_allclose(swiglu(gate, up), reference.silu(x) * up64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(geglu(gate, up), reference.gelu_tanh(x) * up64, rtol=1e-5, atol=1e-6)
    weight = rng.standard_normal(512).astype(np.float32)
    np.testing.assert_allclose(rms_norm(gate, weight, 1e-6), reference.rms_norm(x, weight, 1e-6),
                               rtol=1e-5, atol=1e-6)
    # a row alone (decoding: scalar arithmetic) is the very same floats as in a batch
    assert all(np.array_equal(rms_norm(gate[i:i + 1], weight, 1e-6), rms_norm(gate, weight, 1e-6)[i:i + 1])
               for i in range(3))
