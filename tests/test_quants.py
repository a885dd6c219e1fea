"""Every weight format and kernel against gguf-py's reference dequantization, plain and
shared out over threads (engine/accel)."""

import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf import quants as ref_quants

from engine import accel, quants, tuning
from engine.accel import threads
from engine.gguf_file import SUPPORTED_TYPES, GGUFFile, Tensor
from engine.quants import concat_weights, load_weight

QUANT_TYPES = [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]
ALL_TYPES = [T.F32, T.F16, T.BF16, *QUANT_TYPES]
# byte offsets of the float16 fields (d, m, dmin) inside one block of each format
F16_FIELDS = {
    T.Q8_0: [0], T.Q4_0: [0], T.Q4_1: [0, 2], T.Q5_0: [0], T.Q5_1: [0, 2],
    T.Q2_K: [80, 82], T.Q3_K: [108], T.Q4_K: [0, 2], T.Q5_K: [0, 2], T.Q6_K: [208],
}
N_OUT, N_IN = 48, 512
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the checkout, where `engine` imports from


def random_raw(qtype: T, n_out: int, n_in: int, rng: np.random.Generator) -> np.ndarray:
    """Random valid data of a format: random bytes for every code and sub-block scale,
    small finite float16 values for the block scales. uint8 (n_out, bytes_per_row),
    or float32 / float16 (n_out, n_in) for F32 / F16."""
    if qtype == T.F32:
        return rng.standard_normal((n_out, n_in)).astype(np.float32)
    if qtype == T.F16:
        return rng.standard_normal((n_out, n_in)).astype(np.float16)
    if qtype == T.BF16:
        return ref_quants.quantize(rng.standard_normal((n_out, n_in)).astype(np.float32), T.BF16)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (n_out, n_in // block_size, type_size), dtype=np.uint8)
    for offset in F16_FIELDS[qtype]:
        d = (rng.standard_normal(raw.shape[:2]) * 0.01).astype(np.float16)
        raw[..., offset : offset + 2] = d.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw.reshape(n_out, -1)


def weight_and_reference(qtype, n_out=N_OUT, n_in=N_IN, seed=0):
    raw = random_raw(qtype, n_out, n_in, np.random.default_rng(seed))
    reference = ref_quants.dequantize(raw, qtype).reshape(n_out, n_in)
    return load_weight(Tensor("w", qtype, (n_out, n_in), raw)), reference


def assert_matmul_close(y, expected):
    scale = np.abs(expected).max()
    np.testing.assert_allclose(y, expected, rtol=0, atol=1e-5 * scale)


def test_every_supported_type_has_a_loader():
    assert set(ALL_TYPES) == SUPPORTED_TYPES


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_gguf(qtype):
    weight, reference = weight_and_reference(qtype)
    assert weight.shape == (N_OUT, N_IN)
    np.testing.assert_array_equal(weight.dequantize(), reference)


@pytest.mark.parametrize("qtype", [T.Q8_0, T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.BF16], ids=lambda t: t.name)
def test_dequantize_matches_gguf_on_quantized_data(qtype):
    """Data as gguf-py's quantizer writes it (realistic scales, every code used)."""
    data = np.random.default_rng(1).standard_normal((N_OUT, N_IN)).astype(np.float32)
    raw = ref_quants.quantize(data, qtype)
    weight = load_weight(Tensor("w", qtype, (N_OUT, N_IN), raw))
    np.testing.assert_array_equal(weight.dequantize(), ref_quants.dequantize(raw, qtype))


@pytest.mark.parametrize("n", [1, 2, 7, tuning.DECODE_MAX_ROWS, tuning.DECODE_MAX_ROWS + 1])
@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_matmul_matches_reference(qtype, n):
    weight, reference = weight_and_reference(qtype)
    x = np.random.default_rng(2).standard_normal((n, N_IN)).astype(np.float32)
    y = weight.matmul(x)
    assert y.shape == (n, N_OUT) and y.dtype == np.float32
    assert_matmul_close(y, x @ reference.T)


@pytest.mark.parametrize("qtype", ALL_TYPES, ids=lambda t: t.name)
def test_rows_matches_reference(qtype):
    weight, reference = weight_and_reference(qtype)
    ids = [5, 0, 47, 5]
    np.testing.assert_array_equal(weight.rows(ids), reference[ids])
    assert weight.rows([]).shape == (0, N_IN)
    with pytest.raises(IndexError):
        weight.rows([N_OUT])


def test_resident_bytes():
    """Bytes per weight as documented in engine/quants.py."""
    expected = {T.F32: 4, T.F16: 2, T.BF16: 2, T.Q8_0: 1.125, T.Q4_0: 1.125, T.Q5_0: 1.125,
                T.Q4_1: 1.25, T.Q5_1: 1.25, T.Q4_K: 1.25, T.Q5_K: 1.25, T.Q3_K: 1.25,
                T.Q6_K: 1.25, T.Q2_K: 1.5}
    for qtype, per_weight in expected.items():
        weight, _ = weight_and_reference(qtype)
        assert weight.nbytes == per_weight * N_OUT * N_IN, qtype.name


@pytest.fixture
def two_threads(monkeypatch):
    """An accelerator of two threads that splits matmuls whatever the machine's load, in many
    small chunks (its `wrap` gives a weight whose matmul is shared out)."""
    monkeypatch.setattr(tuning, "CHUNK_VALUES", 1 << 17)
    monkeypatch.setattr(tuning, "DECODE_PARALLEL_MIN_WORK", 1 << 16)
    with accel.Accelerator(n_threads=2) as accelerator:
        yield accelerator


@pytest.mark.parametrize("n_out", [1001, 1013])  # 1013: tiles of 169 rows, the last one padded
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q8_0, T.F16, T.F32], ids=lambda t: t.name)
def test_large_matrix_uses_tiles_and_threads(qtype, n_out, two_threads):
    """Bigger than a tile, a thread chunk and the threading threshold, odd sizes. Quantized:
    the same floats on two threads as on one (a tile is computed the same wherever it runs)."""
    plain, reference = weight_and_reference(qtype, n_out=n_out, n_in=768)
    weight = two_threads.wrap(plain)
    assert weight is not plain and weight.shape == plain.shape and weight.nbytes == plain.nbytes
    for n in (1, 3, 65):
        x = np.random.default_rng(n).standard_normal((n, 768)).astype(np.float32)
        y = weight.matmul(x)
        assert_matmul_close(y, x @ reference.T)
        if isinstance(plain, quants.QuantWeight):
            np.testing.assert_array_equal(y, plain.matmul(x))
    ids = [n_out - 1, 0, 500]
    np.testing.assert_allclose(weight.rows(ids), reference[ids], rtol=1e-6, atol=0)


def test_concurrent_matmuls_from_several_threads(two_threads):
    weights = [weight_and_reference(qtype, n_out=600, n_in=512, seed=i)
               for i, qtype in enumerate([T.Q4_1, T.Q6_K, T.F16, T.Q8_0])]
    weights += [(two_threads.wrap(w), reference) for w, reference in weights]
    x = np.random.default_rng(3).standard_normal((1, 512)).astype(np.float32)
    errors = []

    def run(weight, reference):
        for _ in range(20):
            try:
                assert_matmul_close(weight.matmul(x), x @ reference.T)
            except AssertionError as e:
                errors.append(e)

    callers = [threading.Thread(target=run, args=wr) for wr in weights]
    for t in callers:
        t.start()
    for t in callers:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in callers)


def test_a_threads_scratch_buffer_is_kept_between_calls_and_never_another_threads():
    first = quants.scratch("test", (4, 8))
    again = quants.scratch("test", (2, 8))   # smaller: the same memory
    grown = quants.scratch("test", (8, 8))   # bigger: a new buffer, kept from now on
    elsewhere = []
    worker = threading.Thread(target=lambda: elsewhere.append(quants.scratch("test", (8, 8))))
    worker.start()
    worker.join(timeout=10)
    assert np.shares_memory(first, again) and again.shape == (2, 8)
    assert np.shares_memory(grown, quants.scratch("test", (8, 8)))
    assert not np.shares_memory(grown, elsewhere[0])


@pytest.mark.parametrize("types", [
    [T.Q5_0, T.Q5_0, T.Q8_0],   # gemma3's q, k, v
    [T.Q4_K, T.Q4_K, T.Q6_K],   # a Q4_K_M q, k, v: group sizes 32 and 16, with and without mins
    [T.Q4_1, T.Q4_1],
    [T.F16, T.F16],
    [T.Q4_K, T.F16, T.Q8_0],    # mixed kinds are kept apart
    [T.F32, T.F16],
], ids=lambda ts: "+".join(t.name for t in ts))
def test_concat_weights(types):
    parts = [weight_and_reference(t, n_out=16 * (i + 1), seed=i) for i, t in enumerate(types)]
    merged = concat_weights([w for w, _ in parts])
    reference = np.concatenate([r for _, r in parts])
    assert merged.shape == reference.shape
    np.testing.assert_allclose(merged.dequantize(), reference, rtol=1e-6, atol=0)
    ids = [len(reference) - 1, 0, 17, 16, 3]
    np.testing.assert_allclose(merged.rows(ids), reference[ids], rtol=1e-6, atol=0)
    for n in (1, 3, 40):
        x = np.random.default_rng(n).standard_normal((n, N_IN)).astype(np.float32)
        assert_matmul_close(merged.matmul(x), x @ reference.T)
    kinds = {w.kind if isinstance(w, quants.DenseWeight) else "quantized" for w, _ in parts}
    assert isinstance(merged, quants.StackedWeight) == (len(kinds) > 1)


def test_concat_weights_needs_the_same_input_size():
    a, _ = weight_and_reference(T.Q8_0)
    b, _ = weight_and_reference(T.Q8_0, n_in=256)
    with pytest.raises(ValueError):
        concat_weights([a, b])


@pytest.mark.parametrize("qtype", [T.Q4_K, T.F16, T.F32], ids=lambda t: t.name)
def test_matmul_of_no_rows(qtype):
    weight, _ = weight_and_reference(qtype)
    assert weight.matmul(np.zeros((0, N_IN), np.float32)).shape == (0, N_OUT)


def test_matmul_checks_the_input_shape():
    weight, _ = weight_and_reference(T.Q8_0)
    with pytest.raises(ValueError):
        weight.matmul(np.zeros((1, N_IN + 1), np.float32))


def test_an_error_in_any_chunk_reaches_the_caller(two_threads):
    seen = []

    def fn(r0, r1):
        seen.append((r0, r1))
        if r0 > 0:
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        two_threads.pool.parallel_for(fn, 100, 1 << 20)
    assert sorted(seen)[0][0] == 0 and sorted(seen)[-1][1] == 100  # every chunk ran
    weight, reference = weight_and_reference(T.Q8_0, n_out=1024)
    x = np.ones((1, N_IN), np.float32)
    assert_matmul_close(two_threads.wrap(weight).matmul(x), x @ reference.T)  # the workers are still there


def test_a_closed_accelerator_joins_its_threads_and_computes_on_the_caller(monkeypatch):
    monkeypatch.setattr(tuning, "DECODE_PARALLEL_MIN_WORK", 1 << 16)
    before = set(threading.enumerate())
    accelerator = accel.Accelerator(n_threads=3)
    workers = set(threading.enumerate()) - before
    assert len(workers) == 2
    plain, reference = weight_and_reference(T.Q5_K, n_out=512, n_in=1024)
    weight = accelerator.wrap(plain)
    x = np.random.default_rng(5).standard_normal((2, 1024)).astype(np.float32)
    y = weight.matmul(x)
    accelerator.close()
    accelerator.close()  # idempotent
    assert not any(t.is_alive() for t in workers)
    np.testing.assert_array_equal(weight.matmul(x), y)  # the same floats, now on this thread alone
    np.testing.assert_array_equal(plain.matmul(x), y)


def test_an_accelerator_dropped_without_close_ends_its_threads():
    import gc

    before = set(threading.enumerate())
    accelerator = accel.Accelerator(n_threads=2)
    (worker,) = set(threading.enumerate()) - before
    del accelerator
    gc.collect()
    worker.join(timeout=30)
    assert not worker.is_alive()


def test_a_stacked_weight_is_shared_out_part_by_part(two_threads):
    parts = [weight_and_reference(t, n_out=600, seed=i) for i, t in enumerate([T.Q4_K, T.F16, T.Q8_0])]
    plain = concat_weights([w for w, _ in parts])
    assert isinstance(plain, quants.StackedWeight)
    wrapped = two_threads.wrap(plain)
    assert isinstance(wrapped, quants.StackedWeight)
    assert all(isinstance(part, accel.Accelerated) for part in wrapped.parts)
    x = np.random.default_rng(7).standard_normal((2, N_IN)).astype(np.float32)
    assert_matmul_close(wrapped.matmul(x), x @ np.concatenate([r for _, r in parts]).T)
    np.testing.assert_array_equal(wrapped.rows([0, 700, 1799]), plain.rows([0, 700, 1799]))


def test_one_thread_installs_nothing(tmp_path, monkeypatch):
    from engine import load_model
    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    monkeypatch.setenv("LMSP_THREADS", "1")
    model = load_model(path)
    assert model.accel is None and not isinstance(model.weights.blocks[0].ffn_down, accel.Accelerated)
    monkeypatch.setenv("LMSP_THREADS", "2")
    model = load_model(path)
    assert model.accel is not None and model.accel.n_threads == 2 and model.accel.helper is None  # tiny
    model.accel.close()


def test_a_model_loaded_with_threads_shares_the_work_between_matmuls_out_too(tmp_path, monkeypatch):
    """Attention's query blocks and the position-wise ops run on the accelerator's threads:
    the plain engine runs them on the calling thread until `install` hands it the pool's."""
    from engine import architectures, load_model
    from tiny import write_tiny_model

    monkeypatch.setattr(architectures, "parallel_for", architectures.on_this_thread)
    monkeypatch.setenv("LMSP_THREADS", "2")
    model = load_model(write_tiny_model(tmp_path / "tiny.gguf", "llama"))
    assert architectures.parallel_for is accel.parallel_for
    model.accel.close()


def test_import_leaves_blas_alone_and_loading_a_model_keeps_it_to_one_thread(tmp_path):
    """We split matmuls over our threads ourselves (engine/accel/threads.py says why); that is
    set when a model is loaded, not by importing the engine."""
    from tiny import write_tiny_model

    path = write_tiny_model(tmp_path / "tiny.gguf", "llama")
    code = ("import sys, numpy; from threadpoolctl import threadpool_info\n"
            "def blas(): return [lib['num_threads'] for lib in threadpool_info() if lib['user_api'] == 'blas']\n"
            "before = blas(); import engine, engine.accel; imported = blas()\n"
            "engine.load_model(sys.argv[1]); print(before == imported, blas())\n")
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "2"}
    done = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=120,
                          env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split(None, 1) == ["True", "[1]\n"]


def test_blas_kernel_names_the_kernels_openblas_runs():
    """numpy's wheels bring OpenBLAS: its kernels have a name, the one OPENBLAS_CORETYPE
    asks for when that is set (some machines set it; see benchmarks/perf.py)."""
    kernel = accel.blas_kernel()
    assert isinstance(kernel, str) and kernel
    if os.environ.get("OPENBLAS_CORETYPE"):
        assert kernel.lower() == os.environ["OPENBLAS_CORETYPE"].lower()


def _cpu_flags_from_cpuinfo() -> set[str]:
    try:
        text = open("/proc/cpuinfo").read()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


@pytest.mark.skipif("avx2" not in _cpu_flags_from_cpuinfo(), reason="Haswell's kernels need AVX2")
def test_kernels_an_environment_holds_below_the_cpu_are_told_from_those_openblas_picks():
    """OPENBLAS_CORETYPE=Haswell holds OpenBLAS to AVX2 kernels: below the CPU exactly when
    /proc/cpuinfo lists AVX-512; what OpenBLAS picks itself never is."""
    code = "import engine; print(engine.blas_kernel(), engine.blas_kernel_below_cpu())"
    base = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")}
    avx512 = {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= _cpu_flags_from_cpuinfo()
    for extra, below in (({"OPENBLAS_CORETYPE": "Haswell"}, avx512), ({}, False)):
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                              env={**base, **extra}, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        kernel, said = done.stdout.split()
        assert said == str(below), (extra, kernel)


def test_decode_floats_do_not_depend_on_how_the_tiles_are_shared(monkeypatch):
    """Threads, and the helper process with the tiles it gives back as it goes, share a
    decode matmul's tiles out differently from call to call (through the plain kernel's
    tile ranges): every way gives the same
    floats (the mins' part too, which BLAS may sum differently by where a column falls
    in a product: it is added once, over every column)."""
    monkeypatch.setattr(tuning, "TILE_VALUES", 1 << 17)
    weight, _ = weight_and_reference(T.Q4_1, n_out=576, n_in=1536)
    assert (weight.n_tiles, weight.tile_rows) == (8, 72)  # tiles that do not start at multiples of 16
    x = np.random.default_rng(6).standard_normal((3, 1536)).astype(np.float32)
    whole = weight.matmul(x)
    for cuts in ([1], [3], [5], [1, 6], [2, 3, 7]):
        y = np.zeros((3, 576), np.float32)
        for b0, b1 in zip([0, *cuts], [*cuts, 8]):
            weight._decode_tiles(x, y, b0, b1)
        y += weight._mins_part(x)
        np.testing.assert_array_equal(y, whole)


def _rss_anon_mib() -> float:
    with open("/proc/self/status") as f:
        return int(dict(line.split(":", 1) for line in f)["RssAnon"].split()[0]) / 1024


@pytest.mark.skipif(threads._malloc_trim is None or not os.path.exists("/proc/self/status"),
                    reason="glibc's malloc_trim and Linux's /proc are what this checks")
def test_memory_a_thread_freed_goes_back_to_the_os():
    kept = []

    def work():
        arrays = [np.ones(12_500) for _ in range(4000)]  # 100 KB each: from this thread's malloc arena
        kept.extend(arrays[::50])  # a few survivors keep the freed pages below them from being returned

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    before = _rss_anon_mib()
    accel.release_freed_memory()
    assert before - _rss_anon_mib() > 200  # of the 400 MB freed


def _check_real_model(path):
    gguf_file = GGUFFile(path)
    rng = np.random.default_rng(0)
    for tensor in gguf_file.tensors.values():
        if len(tensor.shape) != 2:
            continue
        weight = load_weight(tensor)
        ids = rng.integers(0, tensor.shape[0], 4)
        reference = ref_quants.dequantize(tensor.data[ids], tensor.type).reshape(4, -1)
        np.testing.assert_array_equal(weight.rows(ids), reference, err_msg=tensor.name)
        x = rng.standard_normal((1, tensor.shape[1])).astype(np.float32)
        np.testing.assert_allclose(weight.matmul(x)[0, ids], x[0] @ reference.T,
                                   rtol=0, atol=1e-4 * np.abs(x[0] @ reference.T).max())


@pytest.mark.slow
def test_every_tensor_of_smollm2(smollm2_path):
    _check_real_model(smollm2_path)


@pytest.mark.slow
def test_every_tensor_of_gemma3(gemma3_path):
    _check_real_model(gemma3_path)
