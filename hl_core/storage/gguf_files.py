"""A GGUF file's header, read without the ``gguf`` package's reader (which parses every token of the vocabulary:
seconds) and without loading a tensor: the scalar metadata, the length of each array, the tensors' names, types,
shapes and offsets, and whether the file is long enough to hold them all. A file that is not GGUF, of an unknown
version, or cut short is refused by the caller with one paragraph (``GgufProblem`` says which).

The layout (GGUF v2 and v3): ``b"GGUF"``, version ``u32``, tensor count ``u64``, metadata count ``u64``; each
metadata entry a string key, a ``u32`` value type and the value (an array: item type ``u32``, count ``u64``, items);
each tensor a string name, ``u32`` dimensions, ``u64`` sizes, ``u32`` ggml type, ``u64`` offset into the data,
which starts at the next multiple of ``general.alignment`` (32) after the header. Strings are a ``u64`` length and
UTF-8 bytes; everything is little-endian.
"""

from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, NamedTuple, Tuple

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
# value type -> struct format of its scalar (8: string, 9: array are read apart)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_ENTRIES = 1 << 24  # more metadata entries or tensors than any model has: a damaged count


class GgufProblem(ValueError):
    """Why a file is not a readable GGUF file: ``kind`` is ``not_gguf``, ``version`` or ``truncated``."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind = kind


# one tensor's entry in the header: its data starts `offset` bytes into the data section
Tensor = NamedTuple("Tensor", [("name", str), ("shape", Tuple[int, ...]), ("ggml_type", int), ("offset", int)])


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's header: ``metadata`` holds every scalar and string value, and for an array its length (under
    the key, as ``("array", length)``)."""

    version: int
    metadata: Dict[str, object]
    tensors: List[Tensor]
    data_start: int


class _Cursor:
    """Reads little-endian values from a buffer; running past its end is a ``truncated`` problem."""

    def __init__(self, buffer):
        self.buffer, self.at = buffer, 0

    def take(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buffer):
            raise GgufProblem("truncated", f"the header ends at byte {len(self.buffer)}, inside an entry")
        (value,) = struct.unpack_from(fmt, self.buffer, self.at)
        self.at += size
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.at + length > len(self.buffer):
            raise GgufProblem("truncated", f"a string of {length} bytes runs past the end of the file")
        raw = bytes(self.buffer[self.at:self.at + length])
        self.at += length
        return raw.decode("utf-8", errors="replace")

    def value(self, kind: int):
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item, count = self.take("<I"), self.take("<Q")
            if count > len(self.buffer):
                raise GgufProblem("truncated", f"an array claims {count} items, more than the file has bytes")
            if item in _SCALARS:  # a fixed-size item: skip the lot
                self.at += count * struct.calcsize(_SCALARS[item])
                if self.at > len(self.buffer):
                    raise GgufProblem("truncated", "an array runs past the end of the file")
            else:
                for _ in range(count):
                    self.value(item)
            return ("array", count)
        if kind not in _SCALARS:
            raise GgufProblem("not_gguf", f"unknown metadata value type {kind}")
        return self.take(_SCALARS[kind])


def _count(cursor: _Cursor, what: str) -> int:
    count = cursor.take("<Q")
    if count > MAX_ENTRIES:
        raise GgufProblem("not_gguf", f"{count} {what} (a damaged count)")
    return count


def read_header(path: Path) -> GgufHeader:
    """The header of the GGUF file ``path``, checked against the file's length.

    Raises:
        GgufProblem: not a GGUF file (another magic, an unknown value type), a version other than 2 or 3, or a file
            cut short (the header, or a tensor's data, runs past its end).
    """
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # the ggml types' block sizes

    with open(path, "rb") as handle:
        size = Path(path).stat().st_size
        if size < 24:
            raise GgufProblem("not_gguf" if handle.read(4) != MAGIC else "truncated",
                              f"the file has {size} bytes, fewer than a GGUF header")
        with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as buffer:
            if buffer[:4] != MAGIC:
                raise GgufProblem("not_gguf", f"it starts with {bytes(buffer[:4])!r}, not {MAGIC!r}")
            cursor = _Cursor(buffer)
            cursor.at = 4
            version = cursor.take("<I")
            if version not in VERSIONS:
                raise GgufProblem("version", f"GGUF version {version} (this reader knows {VERSIONS})")
            tensor_count, entries = _count(cursor, "tensors"), _count(cursor, "metadata entries")
            metadata = {}
            for _ in range(entries):
                key = cursor.string()
                metadata[key] = cursor.value(cursor.take("<I"))
            tensors = []
            for _ in range(tensor_count):
                name = cursor.string()
                dims = cursor.take("<I")
                if dims > 8:
                    raise GgufProblem("not_gguf", f"tensor `{name}` claims {dims} dimensions")
                shape = tuple(cursor.take("<Q") for _ in range(dims))
                tensors.append(Tensor(name, shape, cursor.take("<I"), cursor.take("<Q")))
            alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
            alignment = alignment if isinstance(alignment, int) and alignment > 0 else DEFAULT_ALIGNMENT
            data_start = -(-cursor.at // alignment) * alignment
    for tensor in tensors:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(tensor.ggml_type)]
        except (ValueError, KeyError):
            raise GgufProblem("not_gguf", f"tensor `{tensor.name}` has an unknown ggml type {tensor.ggml_type}")
        elements = 1
        for dim in tensor.shape:
            elements *= dim
        end = data_start + tensor.offset + elements // block * type_size
        if end > size:
            raise GgufProblem("truncated", f"tensor `{tensor.name}` ends at byte {end}, the file at byte {size}")
    return GgufHeader(version, metadata, tensors, data_start)
