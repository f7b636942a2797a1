"""A GGUF file's header and tensor table, read straight from the file (memory-mapped, nothing copied).

A GGUF file (llama.cpp's format) is, little-endian throughout:

    "GGUF"  version (u32, 2 or 3)  tensor count (u64)  metadata count (u64)
    metadata: key (string), value type (u32), value        a string is a u64 length + UTF-8 bytes;
                                                           an array is item type (u32), count (u64), items
    tensor table: name (string), n_dims (u32), dims (u64 each, innermost first), type (u32), offset (u64)
    padding to `general.alignment` (32 by default), then the tensor data, each tensor at its offset

The `gguf` package's reader builds a numpy view for every item of every array, which for a tokenizer
of 49,152 tokens and 48,900 merges is most of a model load (about 4 s of 6 on one core). minfer needs
the scalars and the tensor table only, so this reader steps over arrays of strings and keeps the
tensors as byte views of the mapped file.

`dequantize` turns a tensor into float32. The package's own `gguf.quants.dequantize` cuts each
tensor into many small arrays in Python (1.4 s of a 2.9 s load of SmolLM2 on one core); the
formats minfer's model file uses (F32, F16, Q4_1, Q8_0) are decoded here as whole-tensor numpy
operations instead, with the same arithmetic, so the values are bit for bit the package's. Other
types still go through the package.
"""
from __future__ import annotations

import mmap
import struct
from dataclasses import dataclass

import numpy as np

GGUF_MAGIC = b"GGUF"
F32, F16, Q4_1, Q8_0 = 0, 1, 3, 8  # the ggml type numbers decoded here (gguf.GGMLQuantizationType)
Q4_1_GROUP, Q4_1_BLOCK_BYTES = 32, 20  # d (f16), m (f16), 16 bytes of nibbles
Q8_0_BLOCK_BYTES = 34  # d (f16), 32 int8 codes
GGUF_VERSIONS = (2, 3)  # version 1 (2023) had 32-bit lengths; llama.cpp has written 3 since
DEFAULT_ALIGNMENT = 32
STRING, ARRAY = 8, 9  # value types; the others are the fixed-size scalars below
SCALAR_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
                  10: "<Q", 11: "<q", 12: "<d"}
SCALAR_DTYPES = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32,
                 6: np.float32, 7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    type: int  # a ggml type number (gguf.GGMLQuantizationType): 0 F32, 1 F16, 3 Q4_1, 8 Q8_0, ...
    shape: tuple[int, ...]  # outermost first, as in torch: (rows, columns) for a matrix
    data: np.ndarray  # the stored bytes, uint8 [*shape[:-1], bytes per row], a view of the mapped file


@dataclass(frozen=True)
class GGUFFile:
    path: str
    version: int
    # every key; arrays of numbers as numpy arrays, arrays of strings as their length only (minfer
    # reads the tokenizer through transformers, which has its own reader)
    metadata: dict[str, object]
    tensors: dict[str, GGUFTensor]  # in the file's order


class _Cursor:
    """Reads little-endian values from a buffer, front to back."""

    def __init__(self, buffer, path: str):
        self.buffer, self.offset, self.path = buffer, 0, path

    def take(self, fmt: str):
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.offset)
        except struct.error:
            raise ValueError(f"{self.path!r} is not a readable GGUF file: it ends inside its header "
                             f"(byte {self.offset} of {len(self.buffer)})") from None
        self.offset += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.take("<Q")
        if self.offset + length > len(self.buffer):
            raise ValueError(f"{self.path!r} is not a readable GGUF file: a string at byte {self.offset} "
                             f"runs {length} bytes past the end")
        text = bytes(self.buffer[self.offset:self.offset + length]).decode("utf-8", errors="replace")
        self.offset += length
        return text

    def value(self, value_type: int):
        if value_type in SCALAR_FORMATS:
            return self.take(SCALAR_FORMATS[value_type])
        if value_type == STRING:
            return self.string()
        if value_type == ARRAY:
            item_type, count = self.take("<I"), self.take("<Q")
            if item_type == STRING:  # step over the strings: each is its length plus that many bytes
                for _ in range(count):
                    self.offset += 8 + self.take("<Q")
                return count
            if item_type in SCALAR_DTYPES:
                items = np.frombuffer(self.buffer, SCALAR_DTYPES[item_type], count, self.offset).copy()
                self.offset += items.nbytes
                return items
            return [self.value(item_type) for _ in range(count)]  # arrays of arrays: rare, kept whole
        raise ValueError(f"{self.path!r} is not a readable GGUF file: unknown value type {value_type} "
                         f"at byte {self.offset - 4}")


def read_gguf_file(path: str) -> GGUFFile:
    """The header and tensor table of a GGUF file; the tensors stay on disk until read.

    Raises ValueError naming the file for anything that is not a GGUF file of version 2 or 3."""
    import gguf  # for the block sizes of the ggml types

    with open(path, "rb") as f:
        try:
            buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError:  # an empty file cannot be mapped
            raise ValueError(f"{path!r} is not a readable GGUF file: it is empty") from None
    cursor = _Cursor(buffer, path)
    if buffer[:4] != GGUF_MAGIC:
        raise ValueError(f"{path!r} is not a GGUF file: it starts with {bytes(buffer[:4])!r}, not {GGUF_MAGIC!r}")
    cursor.offset = 4
    version = cursor.take("<I")
    if version not in GGUF_VERSIONS:
        raise ValueError(f"{path!r} is GGUF version {version} (or big-endian); minfer reads little-endian "
                         f"versions {GGUF_VERSIONS}")
    tensor_count, metadata_count = cursor.take("<Q"), cursor.take("<Q")
    metadata = {}
    for _ in range(metadata_count):
        key = cursor.string()
        metadata[key] = cursor.value(cursor.take("<I"))
    table = []
    for _ in range(tensor_count):
        name = cursor.string()
        dims = [cursor.take("<Q") for _ in range(cursor.take("<I"))]
        table.append((name, dims, cursor.take("<I"), cursor.take("<Q")))
    alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
    if alignment < 1:
        raise ValueError(f"{path}: general.alignment must be >= 1, got {alignment}")
    data_start = -(-cursor.offset // alignment) * alignment
    tensors = {}
    for name, dims, ggml_type, offset in table:
        if ggml_type not in gguf.GGML_QUANT_SIZES:
            raise ValueError(f"{path!r}: tensor {name!r} has unknown ggml type {ggml_type}")
        block_size, block_bytes = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)]
        shape = tuple(reversed(dims))
        row_bytes = shape[-1] // block_size * block_bytes
        rows = int(np.prod(shape[:-1], dtype=np.int64))
        start = data_start + offset
        if start + rows * row_bytes > len(buffer):
            raise ValueError(f"{path!r} is cut short: tensor {name!r} needs bytes {start}..{start + rows * row_bytes}, "
                             f"the file has {len(buffer)}")
        data = np.frombuffer(buffer, np.uint8, rows * row_bytes, start).reshape(*shape[:-1], row_bytes)
        tensors[name] = GGUFTensor(name, ggml_type, shape, data)
    return GGUFFile(path, version, metadata, tensors)


def q4_1_fields(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 bytes uint8 [..., blocks * 20] -> (codes uint8 [..., blocks * 32] in 0..15, d, m float16 [..., blocks]).

    A block is 32 consecutive weights of a row: d, m, then byte j holds weight j in its low
    nibble and weight j + 16 in its high nibble; weight = d * code + m."""
    blocks = data.reshape(*data.shape[:-1], -1, Q4_1_BLOCK_BYTES)
    d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16)[..., 0]
    m = np.ascontiguousarray(blocks[..., 2:4]).view(np.float16)[..., 0]
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1)  # low nibbles, then high
    return codes.reshape(*data.shape[:-1], -1), d, m


def dequantize(tensor: GGUFTensor) -> np.ndarray:
    """The tensor's values as a new float32 array [*tensor.shape], equal to `gguf.quants.dequantize`'s."""
    data = tensor.data
    if tensor.type == F32:
        values = data.view(np.float32).copy()  # a copy: the file's bytes are mapped read-only
    elif tensor.type == F16:
        values = data.view(np.float16).astype(np.float32)
    elif tensor.type == Q4_1:
        codes, d, m = q4_1_fields(data)
        groups = codes.reshape(*codes.shape[:-1], -1, Q4_1_GROUP).astype(np.float32)
        values = d.astype(np.float32)[..., None] * groups + m.astype(np.float32)[..., None]
    elif tensor.type == Q8_0:
        blocks = data.reshape(*data.shape[:-1], -1, Q8_0_BLOCK_BYTES)
        d = np.ascontiguousarray(blocks[..., 0:2]).view(np.float16).astype(np.float32)
        values = blocks[..., 2:].view(np.int8).astype(np.float32) * d
    else:
        import gguf

        values = gguf.quants.dequantize(data, tensor.type)
    return np.ascontiguousarray(values, dtype=np.float32).reshape(tensor.shape)
