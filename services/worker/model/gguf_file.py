"""A small GGUF reader: metadata as Python values, tensors as numpy views of the memory-mapped file.

gguf.GGUFReader parses the same format but builds numpy views for each of the ~100k vocabulary
strings and merges, which takes seconds per load; this reads them with struct in a fraction of
that. Dequantisation stays with the gguf package.
"""

from __future__ import annotations

import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import quant_shape_to_byte_shape

_MAGIC = b"GGUF"
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_TYPED_TENSORS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}


@dataclass
class GGUFTensor:
    name: str
    type: GGMLQuantizationType
    data: np.ndarray   # typed for F32/F16, else the raw blocks as uint8 [rows, bytes per row]


class GGUFFile:
    """Raises ValueError on anything that is not a well-formed GGUF v2/v3 file."""

    def __init__(self, path: str | Path):
        with open(path, "rb") as f:
            self._buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pos = 0
        try:
            self.metadata, self.tensors = self._parse()
        except (struct.error, UnicodeDecodeError, KeyError, IndexError) as e:
            raise ValueError(f"malformed GGUF file: {e!r}") from e

    def _parse(self) -> tuple[dict, list[GGUFTensor]]:
        if self._buffer[:4] != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        self._pos = 4
        version, tensor_count, kv_count = self._read("<I"), self._read("<Q"), self._read("<Q")
        if version not in (2, 3):
            raise ValueError(f"unsupported GGUF version {version}")
        metadata = {}
        for _ in range(kv_count):
            key = self._read_string()
            metadata[key] = self._read_value(self._read("<I"))
        infos = []
        for _ in range(tensor_count):
            name = self._read_string()
            dims = [self._read("<Q") for _ in range(self._read("<I"))]
            infos.append((name, GGMLQuantizationType(self._read("<I")), dims, self._read("<Q")))
        alignment = metadata.get("general.alignment", 32)
        data_start = -(-self._pos // alignment) * alignment
        return metadata, [self._tensor(name, kind, dims, data_start + offset) for name, kind, dims, offset in infos]

    def _tensor(self, name: str, kind: GGMLQuantizationType, dims: list[int], offset: int) -> GGUFTensor:
        shape = tuple(reversed(dims))   # GGUF lists the fastest-moving dimension first
        block_size, type_size = GGML_QUANT_SIZES[kind]
        num_bytes = math.prod(dims) * type_size // block_size
        if offset + num_bytes > len(self._buffer):
            raise ValueError(f"tensor {name!r} runs past the end of the file (truncated?)")
        raw = np.frombuffer(self._buffer, dtype=np.uint8, count=num_bytes, offset=offset)
        if kind in _TYPED_TENSORS:
            return GGUFTensor(name, kind, raw.view(_TYPED_TENSORS[kind]).reshape(shape))
        return GGUFTensor(name, kind, raw.reshape(quant_shape_to_byte_shape(shape, kind)))

    def _read(self, fmt: str):
        (value,) = struct.unpack_from(fmt, self._buffer, self._pos)
        self._pos += struct.calcsize(fmt)
        return value

    def _read_string(self) -> str:
        length = self._read("<Q")
        text = self._buffer[self._pos:self._pos + length].decode("utf-8")
        self._pos += length
        return text

    def _read_value(self, kind: int):
        if kind == _STRING:
            return self._read_string()
        if kind == _ARRAY:
            item_kind, count = self._read("<I"), self._read("<Q")
            if item_kind in _SCALARS:   # numbers in one go
                fmt = f"<{count}{_SCALARS[item_kind][1]}"
                values = list(struct.unpack_from(fmt, self._buffer, self._pos))
                self._pos += struct.calcsize(fmt)
                return values
            return [self._read_value(item_kind) for _ in range(count)]
        return self._read(_SCALARS[kind])
