"""Opening GGUF files: the header, metadata, tensor views, and a clear error for every bad file."""

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType as T
from gguf import GGUFEndian, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf import quants as ref_quants

from engine import describe
from engine.errors import ModelFileError, UnsupportedModelError
from engine.gguf_file import GGUFFile, release_pages
from engine.gguf_header import GGUFHeaderError, UnsupportedGGUFError, read_header


def write_gguf(path, tensors, arch="llama"):
    """A small GGUF file: a few metadata keys and the given {name: (array, raw_type)}."""
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(64)
    writer.add_array("tokenizer.ggml.tokens", ["a", "b", "<s>"])
    writer.add_float32("test.eps", 0.5)
    for name, (array, raw_type) in tensors.items():
        writer.add_tensor(name, array, raw_dtype=raw_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


WEIGHT = np.random.default_rng(0).standard_normal((8, 64)).astype(np.float32)


@pytest.fixture
def small_gguf(tmp_path):
    rng = np.random.default_rng(1)
    weight = WEIGHT
    return write_gguf(tmp_path / "small.gguf", {
        "norm.weight": (rng.standard_normal(64).astype(np.float32), None),
        "proj.weight": (weight, None),
        "proj_q.weight": (ref_quants.quantize(weight, T.Q8_0), T.Q8_0),
        "proj_h.weight": (weight.astype(np.float16), None),
    })


def test_metadata_and_tensors(small_gguf):
    f = GGUFFile(small_gguf)
    assert f.path == small_gguf
    assert f.architecture == "llama"
    assert f.get("general.name") == "tiny"
    assert f.get("llama.context_length") == 64
    assert f.get("tokenizer.ggml.tokens") == ["a", "b", "<s>"]
    assert f.get("test.eps") == 0.5
    assert f.get("missing.key", 7) == 7
    assert not any(key.startswith("GGUF.") for key in f.metadata)

    norm, proj, proj_q, proj_h = (f.tensors[n] for n in
                                  ("norm.weight", "proj.weight", "proj_q.weight", "proj_h.weight"))
    assert (norm.type, norm.shape) == (T.F32, (64,))
    assert (proj.type, proj.shape, proj.data.dtype) == (T.F32, (8, 64), np.float32)
    assert (proj_h.type, proj_h.shape, proj_h.data.dtype) == (T.F16, (8, 64), np.float16)
    assert (proj_q.type, proj_q.shape, proj_q.data.shape) == (T.Q8_0, (8, 64), (8, 68))
    np.testing.assert_array_equal(proj.data, WEIGHT)
    np.testing.assert_array_equal(proj_h.data, WEIGHT.astype(np.float16))
    np.testing.assert_array_equal(ref_quants.dequantize(proj_q.data, T.Q8_0),
                                  ref_quants.dequantize(ref_quants.quantize(WEIGHT, T.Q8_0), T.Q8_0))
    # views onto the memory map, not copies
    assert not proj.data.flags.owndata and not proj.data.flags.writeable
    base = proj.data
    while base.base is not None and not isinstance(base, np.memmap):
        base = base.base
    assert isinstance(base, np.memmap)


def test_metadata_of_every_value_type_matches_gguf_reader(tmp_path):
    path = tmp_path / "types.gguf"
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(64)
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -5)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float32("t.f32", 0.1)
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_string("t.empty", "")
    writer.add_array("t.ints", [1, -2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.bools", [True, False])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_array("t.none", [])
    writer.add_tensor("w", np.arange(64, dtype=np.float32).reshape(2, 32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = GGUFFile(path)
    reference = {key: field.contents() for key, field in GGUFReader(path).fields.items()
                 if not key.startswith("GGUF.")}
    # GGUFReader flattens arrays of arrays (a known gguf-py limitation); we keep them nested
    assert f.metadata.pop("t.nested") == [[1, 2], [3]] and reference.pop("t.nested") == [1, 2, 3]
    assert f.metadata == reference
    assert f.get("t.str") == "héllo ✓"
    assert f.get("general.alignment") == 64
    np.testing.assert_array_equal(f.tensors["w"].data, np.arange(64, dtype=np.float32).reshape(2, 32))
    # without arrays (the model listing): each array is its length, every other value the same
    skipped = read_header(path).metadata
    lengths = {"t.ints": 3, "t.floats": 2, "t.bools": 2, "t.strs": 3, "t.nested": 2}
    assert skipped == {**f.metadata, **lengths}


def test_tensor_records_match_gguf_reader(small_gguf):
    """Name, shape (numpy order), ggml type and where the data starts, as gguf-py finds them."""
    header, reader = read_header(small_gguf), GGUFReader(small_gguf)
    assert header.data_offset == reader.data_offset and header.alignment == reader.alignment
    assert [(t.name, t.shape, t.type, t.offset) for t in header.tensors] == [
        (t.name, tuple(reversed(t.shape.tolist())), int(t.tensor_type), t.data_offset) for t in reader.tensors]
    assert header.n_parameters == sum(int(t.n_elements) for t in reader.tensors)


def test_the_type_tables_agree_with_gguf_py():
    """The header's tables (standard library only) name each number as gguf-py's enums do."""
    for number, name in describe.TENSOR_TYPES.items():
        assert T(number).name == name
    for number, name in describe.FILE_TYPES.items():
        assert LlamaFileType(number).name.removeprefix("MOSTLY_").removeprefix("ALL_") == name
    assert set(describe.TENSOR_TYPES) == {int(t) for t in T}  # every tensor type this gguf-py knows


def test_a_file_without_a_file_type_is_named_after_its_matrices(tmp_path):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((4, 32)).astype(np.float32)
    path = write_gguf(tmp_path / "nofiletype.gguf", {
        "norm.weight": (rng.standard_normal(32).astype(np.float32), None),
        "a.weight": (weight, None),
        "b.weight": (ref_quants.quantize(weight, T.Q8_0), T.Q8_0),
        "c.weight": (ref_quants.quantize(weight, T.Q8_0), T.Q8_0),
    })
    assert "general.file_type" not in read_header(path).metadata
    assert describe.quantization(read_header(path)) == "Q8_0"


def _with_u32_replaced(source: Path, after: bytes, skip: int, old: int, new: int, path: Path) -> Path:
    """A copy of `source` whose u32 found `skip` bytes after `after` (which must be `old`) is `new`."""
    data = bytearray(source.read_bytes())
    at = data.index(after) + len(after) + skip
    assert int.from_bytes(data[at : at + 4], "little") == old
    data[at : at + 4] = new.to_bytes(4, "little")
    path.write_bytes(bytes(data))
    return path


def test_unknown_metadata_value_type(small_gguf, tmp_path):
    path = _with_u32_replaced(small_gguf, b"test.eps", 0, GGUFValueType.FLOAT32, 77, tmp_path / "badvalue.gguf")
    with pytest.raises(ModelFileError, match="badvalue.gguf"):
        GGUFFile(path)


def test_missing_file(tmp_path):
    with pytest.raises(ModelFileError, match="no-such.gguf"):
        GGUFFile(tmp_path / "no-such.gguf")


def test_directory_is_not_a_model(tmp_path):
    with pytest.raises(ModelFileError):
        GGUFFile(tmp_path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.gguf"
    path.write_bytes(b"")
    with pytest.raises(ModelFileError, match="empty.gguf"):
        GGUFFile(path)


def test_random_bytes(tmp_path):
    path = tmp_path / "random.gguf"
    path.write_bytes(np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    with pytest.raises(ModelFileError, match="not a GGUF file"):
        GGUFFile(path)


@pytest.mark.parametrize("keep", [0.999, 0.9, 0.5, 0.1, 0.02])
def test_truncated_file(small_gguf, tmp_path, keep):
    data = small_gguf.read_bytes()
    path = tmp_path / "truncated.gguf"
    path.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ModelFileError, match="truncated.gguf"):
        GGUFFile(path)


def test_every_truncation_point_of_the_header(small_gguf, tmp_path):
    """Cut anywhere in the header: always a ModelFileError, never another exception."""
    data = small_gguf.read_bytes()
    path = tmp_path / "cut.gguf"
    for size in range(0, 600, 7):
        path.write_bytes(data[:size])
        with pytest.raises(ModelFileError):
            GGUFFile(path)


@pytest.mark.parametrize("arrays", [False, True], ids=["arrays skipped", "arrays read"])
def test_every_cut_inside_the_header_is_a_header_error(small_gguf, tmp_path, arrays):
    """The model listing reads headers of files that may be anything: never another exception."""
    data = small_gguf.read_bytes()
    header = read_header(small_gguf)
    path = tmp_path / "cut.gguf"
    # every third byte up to where the tensor records may end (3 is prime to the fields' sizes)
    for size in range(0, header.data_offset - header.alignment + 1, 3):
        path.write_bytes(data[:size])
        with pytest.raises(GGUFHeaderError):
            read_header(path, arrays)


def test_damaged_headers_are_refused_or_read(small_gguf, tmp_path):
    """Bytes of the header overwritten at random: a header, or GGUFHeaderError (a ModelFileError
    or UnsupportedModelError when opening the file), never another exception nor a hang."""
    data = small_gguf.read_bytes()
    header_size = read_header(small_gguf).data_offset
    rng = np.random.default_rng(3)
    path = tmp_path / "damaged.gguf"
    for _ in range(300):
        damaged = bytearray(data)
        for at in rng.integers(4, header_size, rng.integers(1, 4)):  # (past the magic: else all are refused)
            damaged[at] = rng.integers(0, 256)
        path.write_bytes(bytes(damaged))
        for arrays in (False, True):
            try:
                read_header(path, arrays)
            except GGUFHeaderError:
                pass
        try:
            GGUFFile(path)
        except (ModelFileError, UnsupportedModelError):
            pass


def test_a_string_length_past_the_end_of_the_file(small_gguf, tmp_path):
    """A vocabulary entry's length (u64 before its bytes) made huge: found, skipped or read."""
    data = small_gguf.read_bytes()
    at = data.index(struct.pack("<Q", 3) + b"<s>")
    path = tmp_path / "long.gguf"
    path.write_bytes(data[:at] + struct.pack("<Q", 2**62) + data[at + 8:])
    for arrays in (False, True):
        with pytest.raises(GGUFHeaderError, match="past the end"):
            read_header(path, arrays)
    with pytest.raises(ModelFileError, match="long.gguf: a string runs past the end"):
        GGUFFile(path)


def test_arrays_nested_too_deeply(tmp_path):
    """Each level of arrays of arrays is one more recursion: 5,000 of them (60 kB) raised
    RecursionError in the engine, where the model listing already refused them."""
    key = b"general.nested"
    nested = struct.pack("<IQ", GGUFValueType.ARRAY, 1) * 5000 + struct.pack("<IQ", GGUFValueType.UINT8, 0)
    path = tmp_path / "nested.gguf"
    path.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
                     + struct.pack("<I", GGUFValueType.ARRAY) + nested)
    with pytest.raises(ModelFileError, match="nested.gguf: arrays nested too deeply"):
        GGUFFile(path)


def test_a_duplicate_key_is_refused(tmp_path):
    writer = GGUFWriter(str(tmp_path / "dup.gguf"), "llama")
    writer.add_float32("test.ep1", 0.5)
    writer.add_float32("test.ep2", 0.25)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    path = tmp_path / "dup.gguf"
    path.write_bytes(path.read_bytes().replace(b"test.ep2", b"test.ep1"))
    with pytest.raises(GGUFHeaderError, match="duplicate metadata key 'test.ep1'"):
        read_header(path)
    with pytest.raises(ModelFileError, match="duplicate metadata key"):
        GGUFFile(path)


def test_a_big_endian_file_is_unsupported(tmp_path):
    path = tmp_path / "big.gguf"
    writer = GGUFWriter(str(path), "llama", endianess=GGUFEndian.BIG)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    with pytest.raises(UnsupportedGGUFError, match="big-endian"):
        read_header(path)
    with pytest.raises(UnsupportedModelError, match="big.gguf: big-endian"):
        GGUFFile(path)


def test_unsupported_tensor_type(tmp_path):
    raw = np.zeros((4, 66), np.uint8)  # 4 rows of one IQ2_XXS block (256 values) each
    path = write_gguf(tmp_path / "iq2.gguf", {"w.weight": (raw, T.IQ2_XXS)})
    with pytest.raises(UnsupportedModelError, match="IQ2_XXS"):
        GGUFFile(path)


def test_unknown_tensor_type(small_gguf, tmp_path):
    """A type number ggml does not define (a corrupt or too-new file)."""
    # tensor info: name length u64 | name | n_dims u32 | dims u64 x n_dims | type u32 | offset u64
    path = _with_u32_replaced(small_gguf, b"norm.weight", 4 + 8 * 1, T.F32, 200, tmp_path / "unknown.gguf")
    with pytest.raises(UnsupportedModelError, match="unknown tensor type"):
        GGUFFile(path)


def test_missing_architecture(tmp_path):
    writer = GGUFWriter(str(tmp_path / "noarch.gguf"), "llama")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    # GGUFWriter always writes general.architecture: remove it by renaming the key
    path = tmp_path / "noarch.gguf"
    data = path.read_bytes().replace(b"general.architecture", b"general.architectur_")
    path.write_bytes(data)
    with pytest.raises(ModelFileError, match="general.architecture"):
        GGUFFile(path).architecture


def test_release_pages_keeps_the_data(small_gguf):
    """Dropped file pages are read back from the file; other arrays are never touched."""
    f = GGUFFile(small_gguf)
    tensor = f.tensors["proj_q.weight"]
    before = tensor.data.copy()
    release_pages(tensor.data)
    np.testing.assert_array_equal(tensor.data, before)

    heap = np.arange(1 << 16, dtype=np.float32)  # anonymous memory: dropping it would zero it
    release_pages(heap)
    np.testing.assert_array_equal(heap, np.arange(1 << 16, dtype=np.float32))
