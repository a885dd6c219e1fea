"""Forward passes of the tiny random-weight models: the code paths agree with each other.

Every way of running the same tokens (one long prefill, prefill then decode one
token at a time, chunked prefill, several sequences in one batch, a forked
cache) must give the same logits, up to float32 rounding.
"""

import numpy as np
import pytest
from gguf import GGUFWriter
from gguf.quants import dequantize

from engine import ModelFileError, ModelInfo, SamplingParams, UnsupportedModelError, load_model
from engine.architectures import (attend, attend_one_each, geglu, neox_pairs_order, rms_norm, rope_angles, rope_pairs,
                                  swiglu)
from engine.sampling import Sampler
from tiny import ARCHITECTURES, write_tiny_model

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


def assert_close(a, b):
    scale = max(1.0, float(np.abs(b).max()))
    np.testing.assert_allclose(a, b, rtol=0, atol=1e-4 * scale)


def test_logits_shape_and_fresh_context(model, ids):
    first = model.logits(ids)
    assert first.dtype == np.float32 and first.shape == (len(ids), model.info.n_vocab)
    assert np.isfinite(first).all()
    np.testing.assert_array_equal(model.logits(ids), first)


def test_prefill_then_decode_equals_one_prefill(model, ids):
    full = model.logits(ids)                                   # (n, V)
    seq = model.new_sequence(ids[:5])
    rows = [model.step([seq], all_logits=True)[0]]             # (5, V)
    for token in ids[5:]:
        seq.append(token)
        rows.append(model.step([seq])[0])                      # (1, V)
    assert_close(np.concatenate(rows), full)


def test_chunked_prefill_equals_one_shot(model, ids):
    full = model.logits(ids)
    seq = model.new_sequence(ids)
    rows = []
    while seq.n_pending:
        rows.append(model.step([seq], all_logits=True, chunk=6)[0])
    assert len(rows) > 2
    assert_close(np.concatenate(rows), full)


@pytest.mark.parametrize("all_logits", [True, False])
def test_batched_sequences_equal_each_alone(model, ids, all_logits):
    """Without all_logits the last block computes each sequence's last row only, but it
    still stores every token's keys and values: the decode step after it sees them all."""
    a, b = ids, ids[3:12]
    seqs = [model.new_sequence(a), model.new_sequence(b)]
    together = model.step(seqs, all_logits=all_logits)
    rows = slice(None) if all_logits else slice(-1, None)
    assert_close(together[0], model.logits(a)[rows])
    assert_close(together[1], model.logits(b)[rows])
    # then one decode step for both at once
    seqs[0].append(7)
    seqs[1].append(9)
    last = model.step(seqs)
    assert_close(last[0], model.logits(a + [7])[-1:])
    assert_close(last[1], model.logits(b + [9])[-1:])


def test_forked_cache_continues_like_a_fresh_one(model, ids):
    seq = model.new_sequence(ids[:12])
    model.step([seq])
    fork = seq.fork(8)
    assert fork.cache.length == 8
    fork.tokens.extend(ids[8:15])
    out = model.step([fork], all_logits=True)[0]
    assert_close(out, model.logits(ids[:15])[8:])


def test_cache_grows_past_its_initial_capacity(model, ids):
    seq = model.new_sequence(ids[:2], capacity=2)
    model.step([seq])
    for token in ids[2:]:
        seq.append(token)
        model.step([seq])
    assert seq.cache.length == len(ids) and seq.cache.capacity >= len(ids)
    seq.cache.truncate(4)
    seq.tokens[4:] = [ids[4]]
    assert_close(model.step([seq])[0], model.logits(ids[:5])[-1:])


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
    path = tmp_path / "odd.gguf"
    w = GGUFWriter(str(path), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
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
    """Dividing every frequency by 2 (rope_freqs) is the same rotation as halving positions (linear 2x)."""
    ids = list(range(100, 120))
    plain = load_model(write_tiny_model(tmp_path / "plain.gguf", "llama"))
    factors = load_model(write_tiny_model(tmp_path / "f.gguf", "llama", rope_freq_factors=(2.0,) * 8))
    linear = load_model(write_tiny_model(tmp_path / "l.gguf", "llama", rope_scaling_factor=2.0))
    assert factors.hp.rope_freq_factors == (2.0,) * 8 and linear.hp.rope_scale == 0.5
    assert_close(factors.logits(ids), linear.logits(ids))
    assert np.abs(plain.logits(ids) - linear.logits(ids)).max() > 1e-3


def test_context_window_cap(tmp_path):
    model = load_model(write_tiny_model(tmp_path / "m.gguf", "llama"), n_ctx=32)
    assert model.info.context_length == 32
    with pytest.raises(ValueError):
        model.logits(list(range(33)))


# --- the building blocks against plain references ------------------------------------------


@pytest.mark.parametrize("hd", [8, 12])  # 12: the last 4 dimensions are not rotated
def test_rope_pairs_and_the_neox_order(hd):
    """rope_pairs turns adjacent pairs (llama); with NEOX's dimensions reordered by
    neox_pairs_order, it turns NEOX's pairs (i, i + rope_dim/2) as NEOX does."""
    rng = np.random.default_rng(0)
    qkv = rng.standard_normal((3, 2 * hd + 5)).astype(np.float32)
    x = qkv[:, : 2 * hd].reshape(3, 2, hd)                     # (n, heads, hd), rows strided as in attention
    pos = np.array([0, 1, 5])
    angles = pos[:, None] * 10000.0 ** (-np.arange(0, 8, 2) / 8)  # (n, 4): rope_dim 8
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    turns = (cos + 1j * sin).astype(np.complex64)
    norm = rope_pairs(x, turns)
    order = neox_pairs_order(hd, 8)
    neox = np.empty_like(x)
    neox[..., order] = rope_pairs(np.ascontiguousarray(x[..., order]), turns)  # back in the file's order
    np.testing.assert_array_equal(norm[..., 8:], x[..., 8:])
    np.testing.assert_array_equal(neox[..., 8:], x[..., 8:])
    for t in range(3):
        for i in range(4):
            c, s = cos[t, i], sin[t, i]
            a, b = x[t, :, 2 * i], x[t, :, 2 * i + 1]          # adjacent pair (llama)
            np.testing.assert_allclose(norm[t, :, 2 * i], a * c - b * s, atol=1e-6)
            np.testing.assert_allclose(norm[t, :, 2 * i + 1], a * s + b * c, atol=1e-6)
            a, b = x[t, :, i], x[t, :, i + 4]                  # split halves (neox)
            np.testing.assert_allclose(neox[t, :, i], a * c - b * s, atol=1e-6)
            np.testing.assert_allclose(neox[t, :, i + 4], a * s + b * c, atol=1e-6)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3"])
def test_neox_q_and_k_are_reordered_at_load_with_their_biases_and_norms(tmp_path, architecture):
    model = load_model(write_tiny_model(tmp_path / "m.gguf", architecture))
    hp, blk, tensors = model.hp, model.weights.blocks[0], model.file.tensors
    order = neox_pairs_order(hp.head_dim, hp.rope_dim)
    n_q, n_k = hp.n_head * hp.head_dim, hp.n_head_kv * hp.head_dim

    def file_rows(name: str, n_heads: int) -> np.ndarray:  # (n_heads * hd, ...) reordered head by head
        t = tensors[f"blk.0.{name}"]
        a = dequantize(t.data, t.type).reshape(n_heads, hp.head_dim, -1)
        return a[:, order].reshape(n_heads * hp.head_dim, -1)

    qkv = blk.qkv.dequantize()
    np.testing.assert_allclose(qkv[:n_q], file_rows("attn_q.weight", hp.n_head), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(qkv[n_q:n_q + n_k], file_rows("attn_k.weight", hp.n_head_kv), rtol=1e-6, atol=1e-6)
    if architecture == "qwen2":
        np.testing.assert_array_equal(blk.qkv_bias[:n_q], file_rows("attn_q.bias", hp.n_head)[:, 0])
    else:
        np.testing.assert_array_equal(blk.qk_norm[0], file_rows("attn_q_norm.weight", 1)[:, 0])


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("block", [128, 2])
@pytest.mark.parametrize("T", [5, 1])  # a chunk of a prompt; one decoding query
@pytest.mark.parametrize("keys_first_min_keys", [1, 10**9])  # one query's scores as keys @ q.T, or not
def test_attend_matches_a_loop(window, block, T, keys_first_min_keys, monkeypatch):
    monkeypatch.setattr("engine.architectures.ATTENTION_BLOCK", block)
    monkeypatch.setattr("engine.architectures.KEYS_FIRST_MIN_KEYS", keys_first_min_keys)
    rng = np.random.default_rng(1)
    L, n_head, n_kv, hd = 9, 4, 2, 8
    q = rng.standard_normal((T, n_head, hd)).astype(np.float32)
    # keys and values as the cache gives them: the first L positions of a longer buffer
    keys = rng.standard_normal((n_kv, 16, hd)).astype(np.float32)[:, :L]
    values = rng.standard_normal((n_kv, 16, hd)).astype(np.float32)[:, :L]
    positions = np.arange(L - T, L)
    out = attend(q, keys, values, positions, window, 0.3).reshape(T, n_head, hd)
    for t, p in enumerate(positions):
        for h in range(n_head):
            kv = h // (n_head // n_kv)
            seen = [j for j in range(L) if j <= p and (not window or p - j < window)]
            s = np.array([q[t, h] @ keys[kv, j] * 0.3 for j in seen])
            w = np.exp(s - s.max())
            w /= w.sum()
            np.testing.assert_allclose(out[t, h], w @ values[kv, seen], atol=1e-5)


@pytest.mark.parametrize("window", [0, 3])
@pytest.mark.parametrize("keys_first_min_keys", [4, 10**9])  # some or no sequence's scores as keys @ q.T
def test_one_query_each_gives_the_floats_of_one_sequence_at_a_time(window, keys_first_min_keys, monkeypatch):
    """A decode step of a batch attends every sequence at once: the same floats as alone."""
    monkeypatch.setattr("engine.architectures.KEYS_FIRST_MIN_KEYS", keys_first_min_keys)
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


def test_rope_angles_scaling_and_frequency_factors():
    cos, sin = rope_angles(np.array([3]), 4, 100.0, scale=0.5, freq_factors=(1.0, 2.0))
    angles = 0.5 * 3 * np.array([1.0, 0.1 / 2.0])              # base^(-2i/4) / factor_i
    np.testing.assert_allclose(cos[0], np.cos(angles), rtol=1e-6)
    np.testing.assert_allclose(sin[0], np.sin(angles), rtol=1e-6)


@pytest.mark.parametrize("rows", [3, 600])  # 600 x 512 values: split over the threads in row blocks
def test_gated_activations_and_rms_norm_against_plain_formulas(rows):
    rng = np.random.default_rng(1)
    gate = (rng.standard_normal((rows, 512)) * 4).astype(np.float32)
    gate[0, :4] = [-100.0, -1000.0, 100.0, 0.0]                # exp(-x) overflows, and saturation
    up = rng.standard_normal((rows, 512)).astype(np.float32)
    x, up64 = gate.astype(np.float64), up.astype(np.float64)
    silu = x / (1 + np.exp(np.minimum(-x, 700)))
    gelu = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(swiglu(gate, up), silu * up64, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(geglu(gate, up), gelu * up64, rtol=1e-5, atol=1e-6)
    weight = rng.standard_normal(512).astype(np.float32)
    norm = x / np.sqrt((x ** 2).mean(axis=1, keepdims=True) + 1e-6) * weight
    np.testing.assert_allclose(rms_norm(gate, weight, 1e-6), norm, rtol=1e-5, atol=1e-6)
    # a row alone (decoding: scalar arithmetic) is the very same floats as in a batch
    assert all(np.array_equal(rms_norm(gate[i:i + 1], weight, 1e-6), rms_norm(gate, weight, 1e-6)[i:i + 1])
               for i in range(3))
