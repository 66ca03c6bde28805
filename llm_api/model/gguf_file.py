"""Read a GGUF file's header, metadata and tensor table, validated, without copying its tensor data.

Contract: ``GGUFFile.open(path)`` maps the file read-only, parses GGUF versions 2 and 3 (little-endian)
and either returns a ``GGUFFile`` whose every field was checked against the file, or raises ``GGUFError``
(a ``ConfigError``) whose message names the path and the one reason, e.g. ``<path>: truncated: tensor
'blk.0.attn_q.weight' ends at byte 1234567, the file has 1000000``. Names and keys that come from the file
appear in messages escaped (``repr``) and cut to 100 characters, so a message is always safe to print or log.
``metadata`` holds Python values (int, float, bool, str, and lists of them, nested as in the file);
``tensors`` maps names to ``TensorInfo`` in file order, with shapes in torch order (rows first: the reverse
of GGUF's dims) and absolute byte offsets; ``tensor_bytes(name)`` is a read-only uint8 view of the mapped
file (no copy).

Validation (each a ``GGUFError``): the path is a regular, readable file; it starts with ``GGUF`` (else the
first bytes are shown); it holds a whole header; the version is 2 or 3 (a byte-swapped one is named as a
big-endian file); tensor_count and metadata_kv_count fit in the file at the smallest size of their records;
no read runs past the end of the file (every length and count is checked against the bytes left before
anything is allocated for it, so a count of 2**60 costs nothing); keys (at most 65,535 bytes, as the spec
says) and tensor names are strict UTF-8 (string values that are not are decoded with U+FFFD replacements);
value types are known; arrays nest at most 4 deep; bools are 0 or 1; no key or tensor name appears twice;
``general.alignment``, when present, is a uint32 power of two in 1..2**20 (default 32); each tensor has 1..4
dims, none 0, whose product is below 2**63, a ggml type the ``gguf`` package knows, a row length (dims[0])
that is a multiple of the type's block size, and an offset that is a multiple of the alignment; its bytes
lie inside the file; no two tensors' bytes overlap; the metadata arrays hold at most 2**24 elements in all.
Parsing loops are bounded by the file size, so a hostile file costs at most time linear in its size, and
memory of at most ~1 GB of lists plus ~4x its string bytes; nothing but ``GGUFError`` leaves ``open`` for
any file content (tests/model/test_gguf_file.py fuzzes it).

Why hand-written rather than ``gguf.GGUFReader``: the reader builds numpy arrays for every element of every
array (two per string), so the embedded model's file (SmolLM2-135M-Instruct.Q4_1.gguf: 98 MB, 33 keys, 272 tensors, string
arrays of 49,152 tokens and 48,900 merges) takes 3.4-4.6 s to open, and it reports a corrupt file with errors
far from their cause and without the path ("index 0 is out of bounds for axis 0 with size 0" for a string
length of 2**62 or a kv count of 2**60, "cannot reshape array of size 26 into shape (34,)" for a truncated
tensor, a bare UnicodeDecodeError for a bad key). Here the string arrays are walked with
``struct.unpack_from`` over the map and each string is decoded from one slice, and numeric arrays are one
``numpy.frombuffer(...).tolist()``: the same file opens in 0.05 s (median of 9; 0.1 s at worst), its
metadata digest included (2-core AMD EPYC with other load, 2026-11-28; ``GGUFReader`` 3.4 s on the same
machine, 4.6 s under more load). Almost all of that is the ~98,000 strings (about 0.3 us each).

The map stays open until ``close()`` (or the end of a ``with`` block); views from ``tensor_bytes`` keep the
mapping alive past that, and it is unmapped when the last of them is gone. Like any mapped file, the file
must not be truncated while it is open: a read of a page past its new end is a SIGBUS, not an exception.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import stat
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np

from llm_api.model.settings import ConfigError

GGUF_MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_ARRAY_DEPTH = 4  # an array of arrays is depth 2
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535  # the spec's limit for metadata keys
# Elements in all metadata arrays together: over 10x what the largest vocabularies hold (~262,000 tokens with
# their scores and types, and their merges); it bounds the Python lists a hostile file can make to ~1 GB (an
# int8 array costs 36 bytes of list and int per byte of file, a 2-byte string ~60).
MAX_METADATA_ELEMENTS = 1 << 24
_MAX_ELEMENTS = 1 << 63  # ggml counts elements in int64
_SHOWN_CHARS = 100  # how much of a name, key or byte string an error message shows

_HEADER = struct.Struct("<4sIQQ")  # magic, version, tensor_count, metadata_kv_count
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
# The smallest record of each kind, for refusing counts that cannot fit before looping over them:
# a kv pair: empty key (8) + value type (4) + a 1-byte value; a tensor: empty name (8) + n_dims (4) + one dim (8)
# + type (4) + offset (8).
_MIN_KV_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8

# Metadata value types (gguf_metadata_value_type).
_UINT8, _INT8, _UINT16, _INT16, _UINT32, _INT32, _FLOAT32, _BOOL, _STRING, _ARRAY, _UINT64, _INT64, _FLOAT64 = range(13)
_VALUE_TYPE_NAMES = ("uint8", "int8", "uint16", "int16", "uint32", "int32", "float32", "bool", "string", "array",
                     "uint64", "int64", "float64")
# Fixed-size types: (struct for one value, numpy dtype for an array of them). Bool is read as uint8 and checked.
_FIXED: dict[int, tuple[struct.Struct, np.dtype]] = {
    _UINT8: (struct.Struct("<B"), np.dtype("u1")),
    _INT8: (struct.Struct("<b"), np.dtype("i1")),
    _UINT16: (struct.Struct("<H"), np.dtype("<u2")),
    _INT16: (struct.Struct("<h"), np.dtype("<i2")),
    _UINT32: (struct.Struct("<I"), np.dtype("<u4")),
    _INT32: (struct.Struct("<i"), np.dtype("<i4")),
    _FLOAT32: (struct.Struct("<f"), np.dtype("<f4")),
    _BOOL: (struct.Struct("<B"), np.dtype("u1")),
    _UINT64: (struct.Struct("<Q"), np.dtype("<u8")),
    _INT64: (struct.Struct("<q"), np.dtype("<i8")),
    _FLOAT64: (struct.Struct("<d"), np.dtype("<f8")),
}
# The fewest bytes one array element of each type takes (a string: its length; an array: its type and count).
_MIN_ELEMENT_BYTES = {**{t: s.size for t, (s, _) in _FIXED.items()}, _STRING: 8, _ARRAY: 4 + 8}


def _ggml_types() -> tuple[dict[int, tuple[int, int]], dict[int, str]]:
    """ggml type number -> (block size in elements, block size in bytes), and -> name: the gguf package's table,
    so a type it learns in a new release is read here too."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    sizes = {int(t): (int(block), int(nbytes)) for t, (block, nbytes) in GGML_QUANT_SIZES.items()}
    names = {int(t): t.name for t in GGMLQuantizationType}
    return sizes, names


_TYPE_SIZES, _TYPE_NAMES = _ggml_types()


def type_name(type_id: int) -> str:
    """The ggml type's name ("Q4_K", "F32"), or ``"type N"`` for a number the gguf package does not know."""
    return _TYPE_NAMES.get(type_id, f"type {type_id}")


class GGUFError(ConfigError):
    """A GGUF file cannot be read: the message names the file and the reason."""


@dataclass(frozen=True)
class TensorInfo:
    """One entry of the tensor table. ``shape`` is in torch order (rows first, the reverse of GGUF's dims);
    ``offset`` is absolute in the file; ``nbytes`` is product(shape) / block size * block bytes of its type."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int
    nbytes: int


def _shown(value: str | bytes) -> str:
    """A name, key or byte string from the file as an error message shows it: escaped, at most ~100 characters."""
    if len(value) <= _SHOWN_CHARS:
        return repr(value)
    return repr(value[:_SHOWN_CHARS]) + f"... ({len(value)} {'characters' if isinstance(value, str) else 'bytes'})"


class _Parser:
    """A cursor over the mapped file; every read is checked against the bytes left first."""

    __slots__ = ("buf", "size", "pos", "path", "elements")

    def __init__(self, buf: mmap.mmap, size: int, path: Path, pos: int) -> None:
        self.buf, self.size, self.path, self.pos = buf, size, path, pos
        self.elements = 0  # metadata array elements read so far

    def error(self, reason: str) -> GGUFError:
        return GGUFError(f"{self.path}: {reason}")

    def need(self, nbytes: int, what: str) -> None:
        if nbytes > self.size - self.pos:
            raise self.error(f"truncated: {what} at byte {self.pos} needs {nbytes} bytes, the file has {self.size}")

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def raw_string(self, what: str) -> bytes:
        length = self.u64(f"{what} (its length)")
        self.need(length, f"{what} ({length} bytes)")
        raw = self.buf[self.pos:self.pos + length]
        self.pos += length
        return raw

    def name(self, what: str, max_bytes: int | None = None) -> str:
        """A key or tensor name: strict UTF-8 (a name that decodes two ways could not be looked up reliably)."""
        start = self.pos
        raw = self.raw_string(what)
        if max_bytes is not None and len(raw) > max_bytes:
            raise self.error(f"{what} at byte {start} is {len(raw)} bytes long, more than {max_bytes}: {_shown(raw)}")
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.error(f"{what} at byte {start} is not UTF-8: {_shown(raw)}") from None

    def value(self, value_type: int, what: str, depth: int = 0) -> Any:
        """One metadata value of ``value_type`` (already read); arrays recursively, ``depth`` arrays deep."""
        fixed = _FIXED.get(value_type)
        if fixed is not None:
            unpacker, _ = fixed
            self.need(unpacker.size, what)
            (value,) = unpacker.unpack_from(self.buf, self.pos)
            if value_type == _BOOL:
                value = self.bool_value(value, what)
            self.pos += unpacker.size
            return value
        if value_type == _STRING:
            # Values are text for people or tokenizers: a bad byte becomes U+FFFD rather than failing the model.
            return self.raw_string(what).decode("utf-8", "replace")
        if value_type == _ARRAY:
            return self.array(what, depth + 1)
        raise self.error(f"{what} at byte {self.pos - 4} has an unknown value type {value_type}")

    def bool_value(self, value: int, what: str) -> bool:
        if value > 1:
            raise self.error(f"{what} at byte {self.pos} is a bool of value {value}, not 0 or 1")
        return bool(value)

    def array(self, what: str, depth: int) -> list[Any]:
        if depth > MAX_ARRAY_DEPTH:
            raise self.error(f"{what} at byte {self.pos} nests arrays more than {MAX_ARRAY_DEPTH} deep")
        element_type = self.u32(f"{what} (its element type)")
        if element_type not in _MIN_ELEMENT_BYTES:
            raise self.error(f"{what} at byte {self.pos - 4} has an unknown element type {element_type}")
        count = self.u64(f"{what} (its element count)")
        element_size = _MIN_ELEMENT_BYTES[element_type]
        # Refused before anything is allocated or looped over: a count of 2**61 is only a number here.
        self.need(count * element_size, f"{what} (array of {count} {_VALUE_TYPE_NAMES[element_type]})")
        self.elements += count
        if self.elements > MAX_METADATA_ELEMENTS:
            raise self.error(f"{what} at byte {self.pos}: the metadata arrays hold more than {MAX_METADATA_ELEMENTS} "
                             f"elements in all")
        if element_type == _STRING:
            return self.string_array(count, what)
        if element_type == _ARRAY:
            return [self.array(f"{what}[{i}]", depth + 1) for i in range(count)]
        nbytes = count * element_size
        # A copy of the bytes rather than a view of the map: nothing may hold the map when close() unmaps it.
        raw = self.buf[self.pos:self.pos + nbytes]
        if element_type == _BOOL and raw.translate(None, b"\x00\x01"):
            bad = next(b for b in raw if b > 1)
            raise self.error(f"{what} at byte {self.pos} holds a bool of value {bad}, not 0 or 1")
        self.pos += nbytes
        values = np.frombuffer(raw, dtype=_FIXED[element_type][1]).tolist()
        return [bool(v) for v in values] if element_type == _BOOL else values

    def string_array(self, count: int, what: str) -> list[str]:
        """``count`` strings: the hot loop of a tokenizer's vocabulary (~100,000 strings), kept to locals."""
        buf, size, pos = self.buf, self.size, self.pos
        unpack = _U64.unpack_from
        out: list[str] = []
        append = out.append
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                self.need(8, f"{what}[{i}] (its length)")
            (length,) = unpack(buf, pos)
            pos += 8
            if length > size - pos:
                self.pos = pos
                self.need(length, f"{what}[{i}] ({length} bytes)")
            append(buf[pos:pos + length].decode("utf-8", "replace"))
            pos += length
        self.pos = pos
        return out


class GGUFFile:
    """A validated GGUF file, mapped read-only: build it with ``GGUFFile.open(path)``; a context manager."""

    path: Path
    version: int
    alignment: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data_offset: int

    def __init__(self, path: Path, file_map: mmap.mmap, version: int, alignment: int, metadata: dict[str, Any],
                 tensors: dict[str, TensorInfo], data_offset: int, metadata_sha256: str) -> None:
        """Internal: use ``open``, which parses and validates what is passed here."""
        self.path, self.version, self.alignment = path, version, alignment
        self.metadata, self.tensors, self.data_offset = metadata, tensors, data_offset
        self._map: mmap.mmap | None = file_map
        self._metadata_sha256 = metadata_sha256

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> GGUFFile:
        """Map and parse ``path``; ``GGUFError`` (naming the path and the reason) for anything that does not
        check out (see the module docstring). The returned file holds the map until ``close()``."""
        path = Path(path)
        file_map, size = _map_file(path)
        try:
            return cls._parse(path, file_map, size)
        except BaseException:
            _unmap(file_map)
            raise

    @classmethod
    def _parse(cls, path: Path, buf: mmap.mmap, size: int) -> GGUFFile:
        magic, version, tensor_count, kv_count = _HEADER.unpack_from(buf, 0)
        if magic != GGUF_MAGIC:
            raise GGUFError(f"{path}: not a GGUF file: it starts with {_shown(buf[:8])}, not {GGUF_MAGIC!r}")
        if version not in SUPPORTED_VERSIONS:
            swapped = int.from_bytes(version.to_bytes(4, "little"), "big")
            hint = " (a big-endian file, which is not supported)" if swapped in SUPPORTED_VERSIONS else ""
            raise GGUFError(f"{path}: GGUF version {version} is not supported{hint}; supported: 2 and 3")
        left = size - _HEADER.size
        if tensor_count > left // _MIN_TENSOR_BYTES:
            raise GGUFError(f"{path}: truncated or corrupt: tensor_count {tensor_count} cannot fit in a file of {size} bytes "
                            f"(a tensor record takes at least {_MIN_TENSOR_BYTES} bytes)")
        if kv_count > left // _MIN_KV_BYTES:
            raise GGUFError(f"{path}: truncated or corrupt: metadata_kv_count {kv_count} cannot fit in a file of {size} bytes "
                            f"(a key-value pair takes at least {_MIN_KV_BYTES} bytes)")
        parser = _Parser(buf, size, path, _HEADER.size)

        metadata: dict[str, Any] = {}
        value_types: dict[str, int] = {}
        for i in range(kv_count):
            key_at = parser.pos
            key = parser.name(f"metadata key #{i}", MAX_KEY_BYTES)
            if key in metadata:
                raise parser.error(f"metadata key {_shown(key)} at byte {key_at} appears twice")
            value_type = parser.u32(f"the value type of key {_shown(key)}")
            metadata[key] = parser.value(value_type, f"the value of key {_shown(key)}")
            value_types[key] = value_type
        metadata_end = parser.pos
        with memoryview(buf) as view, view[:metadata_end] as header_and_metadata:
            metadata_sha256 = hashlib.sha256(header_and_metadata).hexdigest()

        alignment = DEFAULT_ALIGNMENT
        if "general.alignment" in metadata:
            alignment = metadata["general.alignment"]
            if value_types["general.alignment"] != _UINT32:
                raise parser.error(f"general.alignment is a {_VALUE_TYPE_NAMES[value_types['general.alignment']]}, "
                                   f"not a uint32")
            if alignment == 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
                raise parser.error(f"general.alignment {alignment} is not a power of two in 1..{MAX_ALIGNMENT}")

        infos = [_read_tensor_info(parser, i, alignment) for i in range(tensor_count)]
        data_offset = -(-parser.pos // alignment) * alignment
        if infos and data_offset > size:
            raise parser.error(f"truncated: the tensor data starts at byte {data_offset} (after padding to the "
                               f"alignment, {alignment}), the file has {size}")
        tensors: dict[str, TensorInfo] = {}
        for name, shape, type_id, relative, nbytes in infos:
            if name in tensors:
                raise parser.error(f"tensor name {_shown(name)} appears twice")
            tensors[name] = TensorInfo(name, shape, type_id, data_offset + relative, nbytes)
        _check_ranges(parser, tensors.values())
        return cls(path, buf, version, alignment, metadata, tensors, data_offset, metadata_sha256)

    def tensor_bytes(self, name: str) -> np.ndarray:
        """The tensor's bytes: a read-only uint8 view of the mapped file (no copy). KeyError for an unknown name;
        ValueError after ``close()``."""
        info = self.tensors[name]
        if self._map is None:
            raise ValueError(f"{self.path}: the GGUF file is closed")
        return np.frombuffer(self._map, dtype=np.uint8, count=info.nbytes, offset=info.offset)

    def metadata_digest(self) -> str:
        """sha256 (hex) of the raw bytes from the header through the last key-value pair: identifies what
        ``metadata`` was parsed from (a cache key for what is derived from it, such as the tokenizer)."""
        return self._metadata_sha256

    def close(self) -> None:
        """Release the map (idempotent). Views from ``tensor_bytes`` stay valid: they keep the mapping alive."""
        file_map, self._map = self._map, None
        if file_map is not None:
            _unmap(file_map)

    def __enter__(self) -> GGUFFile:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"GGUFFile({str(self.path)!r}, version={self.version}, {len(self.metadata)} keys, {len(self.tensors)} tensors)"


def _map_file(path: Path) -> tuple[mmap.mmap, int]:
    """Map ``path`` read-only; GGUFError when it is not a readable regular file or too short for a header."""
    try:
        # O_NONBLOCK: opening a FIFO by mistake must fail below, not wait for a writer.
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        raise GGUFError(f"{path}: cannot open: {exc.strerror or exc}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise GGUFError(f"{path}: not a regular file")
        size = info.st_size
        if size < _HEADER.size:
            head = os.pread(fd, 8, 0)
            if len(head) >= 4 and head[:4] != GGUF_MAGIC:
                raise GGUFError(f"{path}: not a GGUF file: it starts with {_shown(head)}, not {GGUF_MAGIC!r}")
            raise GGUFError(f"{path}: truncated: the header needs {_HEADER.size} bytes, the file has {size}")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ), size
    except OSError as exc:
        raise GGUFError(f"{path}: cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)  # the map keeps its own handle


def _unmap(file_map: mmap.mmap) -> None:
    try:
        file_map.close()
    except BufferError:
        pass  # views from tensor_bytes still use it: the mapping goes with the last of them


def _read_tensor_info(parser: _Parser, index: int, alignment: int) -> tuple[str, tuple[int, ...], int, int, int]:
    """Tensor record ``index``: (name, torch-order shape, ggml type, offset relative to the data, nbytes)."""
    name = parser.name(f"the name of tensor #{index}")
    shown = f"tensor {_shown(name)}"
    n_dims = parser.u32(f"the n_dims of {shown}")
    if not 1 <= n_dims <= MAX_DIMS:
        raise parser.error(f"{shown} has {n_dims} dimensions, not 1..{MAX_DIMS}")
    parser.need(8 * n_dims, f"the dims of {shown}")
    dims = struct.unpack_from(f"<{n_dims}Q", parser.buf, parser.pos)
    parser.pos += 8 * n_dims
    elements = 1
    for dim in dims:
        elements *= dim
    if 0 in dims or elements >= _MAX_ELEMENTS:
        raise parser.error(f"{shown} has dims {list(dims)}: {'a dimension of 0' if 0 in dims else 'over 2**63 elements'}")
    type_id = parser.u32(f"the type of {shown}")
    sizes = _TYPE_SIZES.get(type_id)
    if sizes is None:
        raise parser.error(f"{shown} has an unknown ggml type {type_id}")
    block, block_bytes = sizes
    if dims[0] % block:
        raise parser.error(f"{shown} has rows of {dims[0]} values, not a multiple of {type_name(type_id)}'s "
                           f"block size {block}")
    relative = parser.u64(f"the offset of {shown}")
    if relative % alignment:
        raise parser.error(f"{shown} has offset {relative}, not a multiple of the alignment {alignment}")
    return name, tuple(reversed(dims)), type_id, relative, elements // block * block_bytes


def _check_ranges(parser: _Parser, tensors: Iterable[TensorInfo]) -> None:
    """Every tensor's bytes lie inside the file and no two overlap. In offset order, so that in a truncated
    file the tensor the cut went through is the one named."""
    size = parser.size
    previous: TensorInfo | None = None
    for info in sorted(tensors, key=lambda t: t.offset):
        end = info.offset + info.nbytes
        if info.offset >= size:
            raise parser.error(f"truncated, or a bad offset: tensor {_shown(info.name)} starts at byte {info.offset}, "
                               f"past the end of the file ({size} bytes)")
        if end > size:
            raise parser.error(f"truncated: tensor {_shown(info.name)} ends at byte {end}, the file has {size}")
        if previous is not None and info.offset < previous.offset + previous.nbytes:
            raise parser.error(f"tensors {_shown(previous.name)} (bytes {previous.offset}..{previous.offset + previous.nbytes}) "
                               f"and {_shown(info.name)} (bytes {info.offset}..{end}) overlap")
        previous = info
