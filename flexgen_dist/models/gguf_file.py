"""A GGUF file's metadata and tensor table, read in one pass over its header.

The ``gguf`` package's ``GGUFReader`` builds a numpy view for every part of every value: a
tokenizer's 50-150 thousand strings cost it 2-5 s per open (2.2 s for the bundled SmolLM2),
paid on every run before the first weight is read. This reader walks the same header with
``struct`` over the mapped bytes (about 0.1 s for the same file) and offers the subset of
``GGUFReader``'s interface the loader uses: ``fields`` (key -> ``Field`` with ``contents()`` and
``types``) and ``tensors`` (``Tensor`` with ``name``, ``tensor_type``, ``shape`` innermost first,
and ``data``: a read-only view of the mapped file shaped as ``GGUFReader`` shapes it, so
``gguf.dequantize`` takes it unchanged). Values are decoded as ``GGUFReader`` decodes them
(a FLOAT32 key gives the float32 value widened to a Python float)."""
from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

MAGIC = 0x46554747  # "GGUF" read as a little-endian uint32
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32

_SCALARS: dict[GGUFValueType, tuple[str, Any]] = {
    GGUFValueType.UINT8: ("<B", np.uint8), GGUFValueType.INT8: ("<b", np.int8),
    GGUFValueType.UINT16: ("<H", np.uint16), GGUFValueType.INT16: ("<h", np.int16),
    GGUFValueType.UINT32: ("<I", np.uint32), GGUFValueType.INT32: ("<i", np.int32),
    GGUFValueType.FLOAT32: ("<f", np.float32), GGUFValueType.BOOL: ("<?", np.bool_),
    GGUFValueType.UINT64: ("<Q", np.uint64), GGUFValueType.INT64: ("<q", np.int64),
    GGUFValueType.FLOAT64: ("<d", np.float64),
}
_PLAIN = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16,
          GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
          GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
          GGMLQuantizationType.I64: np.int64}


class Field(NamedTuple):
    """One metadata key: its decoded value and its GGUF types (``[ARRAY, sub]`` for arrays)."""

    name: str
    value: Any
    types: list[GGUFValueType]

    def contents(self) -> Any:
        return self.value


class Tensor(NamedTuple):
    name: str
    tensor_type: GGMLQuantizationType
    shape: np.ndarray  # innermost dimension first, as the file stores it
    n_elements: int
    n_bytes: int
    data_offset: int
    data: np.ndarray


class GGUFFile:
    """The header of the GGUF file at ``path`` and read-only views of its tensors (the file
    stays mapped while any view lives). Raises ``ValueError`` naming what is wrong with a file
    that is not GGUF, of an unknown version, big-endian, or cut short."""

    def __init__(self, path: str | Path) -> None:
        with open(path, "rb") as f:
            try:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError as e:  # an empty file cannot be mapped
                raise ValueError("the file is empty") from e
        buf = self._buf = memoryview(self._map)
        self._off = 0
        if len(buf) < 24 or struct.unpack_from("<I", buf, 0)[0] != MAGIC:
            raise ValueError("GGUF magic invalid")
        version = struct.unpack_from("<I", buf, 4)[0]
        if version not in VERSIONS:
            if version & 0xFFFF == 0:
                raise ValueError("the file is big-endian GGUF; convert it as little-endian")
            raise ValueError(f"GGUF version {version} is not supported (supported: 2, 3)")
        n_tensors, n_kv = struct.unpack_from("<QQ", buf, 8)
        self._off = 24
        u32, u64 = [GGUFValueType.UINT32], [GGUFValueType.UINT64]
        self.fields: dict[str, Field] = {"GGUF.version": Field("GGUF.version", version, u32),
                                         "GGUF.tensor_count": Field("GGUF.tensor_count", n_tensors, u64),
                                         "GGUF.kv_count": Field("GGUF.kv_count", n_kv, u64)}
        try:
            for _ in range(n_kv):
                key = self._str()
                vtype = GGUFValueType(self._scalar("<I"))
                if vtype == GGUFValueType.ARRAY:
                    sub = GGUFValueType(self._scalar("<I"))
                    self.fields[key] = Field(key, self._array(sub), [vtype, sub])
                else:
                    self.fields[key] = Field(key, self._value(vtype), [vtype])
            infos = []
            for _ in range(n_tensors):
                name = self._str()
                n_dims = self._scalar("<I")
                dims = np.frombuffer(buf, np.uint64, n_dims, self._off).copy()
                self._off += 8 * n_dims
                ttype = GGMLQuantizationType(self._scalar("<I"))
                infos.append((name, dims, ttype, self._scalar("<Q")))
        except (struct.error, ValueError) as e:
            raise ValueError(f"the header is cut short or corrupt at byte {self._off} ({e})") from e
        align = self.fields.get("general.alignment")
        alignment = DEFAULT_ALIGNMENT if align is None else int(align.value)
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"general.alignment {alignment} is not a power of two")
        start = -(-self._off // alignment) * alignment
        self.data_offset = start
        whole = np.frombuffer(self._map, np.uint8)
        self.tensors: list[Tensor] = []
        seen: set[str] = set()
        for name, dims, ttype, rel in infos:
            if name in seen:
                raise ValueError(f"tensor {name} is listed twice")
            seen.add(name)
            block, type_size = GGML_QUANT_SIZES[ttype]
            n = int(np.prod(dims, dtype=np.int64)) if len(dims) else 1
            nbytes = n * type_size // block
            shape = tuple(int(d) for d in dims[::-1])
            at = start + int(rel)
            if at + nbytes > len(whole):
                raise ValueError(f"tensor {name} runs past the end of the file (truncated download?)")
            raw = whole[at:at + nbytes]
            if ttype in _PLAIN:
                data = raw.view(_PLAIN[ttype]).reshape(shape)
            else:  # packed blocks: rows of bytes, the innermost dimension in bytes
                data = raw.reshape(*shape[:-1], shape[-1] // block * type_size)
            self.tensors.append(Tensor(name, ttype, dims, n, nbytes, at, data))

    def _scalar(self, fmt: str) -> Any:
        v = struct.unpack_from(fmt, self._buf, self._off)[0]
        self._off += struct.calcsize(fmt)
        return v

    def _str(self) -> str:
        n = self._scalar("<Q")
        end = self._off + n
        if end > len(self._buf):
            raise ValueError("a string runs past the end of the file")
        s = str(self._buf[self._off:end], "utf-8")
        self._off = end
        return s

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._str()
        fmt, np_type = _SCALARS[vtype]
        v = self._scalar(fmt)
        return np_type(v).item()  # as GGUFReader gives it: float32 widened, bool as bool

    def _array(self, sub: GGUFValueType) -> list[Any]:
        n = self._scalar("<Q")
        if sub == GGUFValueType.STRING:
            buf, off, out = self._buf, self._off, []
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(n):
                k = unpack(buf, off)[0]
                off += 8
                out.append(str(buf[off:off + k], "utf-8"))
                off += k
            if off > len(buf):
                raise ValueError("a string array runs past the end of the file")
            self._off = off
            return out
        if sub == GGUFValueType.ARRAY:
            raise ValueError("nested arrays are not supported")
        fmt, np_type = _SCALARS[sub]
        a = np.frombuffer(self._buf, np.dtype(np_type).newbyteorder("<"), n, self._off)
        self._off += a.nbytes
        return a.tolist()


def decimal32(x: float) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it: the value the
    config held (1e-6, not 9.99999997e-07)."""
    return float(str(np.float32(x)))
