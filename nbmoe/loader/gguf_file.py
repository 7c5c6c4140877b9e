"""Read a GGUF file: metadata and zero-copy tensor views over one read-only mmap.

GGUF layout (little-endian, version 2 or 3):
    magic "GGUF" | version:u32 | n_tensors:u64 | n_kv:u64
    n_kv    x  key:str | type:u32 | value          (str = len:u64 + utf-8 bytes)
    n_tensors x name:str | n_dims:u32 | ne:u64 * n_dims | ggml_type:u32 | offset:u64
    padding to `general.alignment` (default 32), then the tensor data; each offset is
    relative to that data start. ne[0] is the length of one row (the contiguous axis).

gguf-py's GGUFReader parses every array element into its own numpy object, which takes
seconds for a 150k-token vocabulary; this reader walks the header once with struct and
reads numeric arrays with one np.frombuffer, so opening a multi-GB file costs only the
header. Tensor bytes stay in the page cache until a kernel touches them.
"""
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from nbmoe.errors import NbmoeError

_SCALAR = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}
_NUMPY = {
    GGUFValueType.UINT8: np.uint8, GGUFValueType.INT8: np.int8, GGUFValueType.UINT16: np.uint16,
    GGUFValueType.INT16: np.int16, GGUFValueType.UINT32: np.uint32, GGUFValueType.INT32: np.int32,
    GGUFValueType.FLOAT32: np.float32, GGUFValueType.BOOL: np.bool_, GGUFValueType.UINT64: np.uint64,
    GGUFValueType.INT64: np.int64, GGUFValueType.FLOAT64: np.float64,
}


class TensorShape:
    """What a tensor with `ne` and `ggml_type` tells of itself (file tensors, merged ones)."""

    @property
    def shape(self):
        """numpy order (outermost first), in elements."""
        return tuple(reversed(self.ne))

    @property
    def type_name(self):
        return self.ggml_type.name


@dataclass
class TensorInfo(TensorShape):
    name: str
    ggml_type: GGMLQuantizationType
    ne: tuple          # ggml order: ne[0] = row length
    offset: int        # absolute offset in the file
    n_bytes: int
    data: np.ndarray   # uint8 view [ne[-1], ..., ne[1], row_bytes] over the mmap


class _Cursor:
    def __init__(self, buf, path):
        self.buf, self.pos, self.path = buf, 0, path

    def take(self, n):
        if self.pos + n > len(self.buf):
            raise NbmoeError(f"{self.path}: truncated GGUF file (header ends at byte {len(self.buf)})")
        start = self.pos
        self.pos += n
        return start

    def scalar(self, fmt):
        size = struct.calcsize(fmt)
        return struct.unpack_from(fmt, self.buf, self.take(size))[0]

    def string(self):
        n = self.scalar("<Q")
        if n > len(self.buf):
            raise NbmoeError(f"{self.path}: corrupt GGUF file (string of {n} bytes)")
        start = self.take(n)
        return bytes(self.buf[start:start + n]).decode("utf-8", errors="replace")

    def strings(self, count):
        # The hot loop for vocabularies (150k+ strings): no per-item method calls.
        buf, pos, end, out = self.buf, self.pos, len(self.buf), []
        unpack = struct.Struct("<Q").unpack_from
        for _ in range(count):
            if pos + 8 > end:
                break
            n = unpack(buf, pos)[0]
            pos += 8
            if pos + n > end:
                break
            out.append(buf[pos:pos + n].decode("utf-8", errors="replace"))
            pos += n
        if len(out) < count:
            raise NbmoeError(f"{self.path}: truncated GGUF file (inside a string array)")
        self.pos = pos
        return out

    def value(self, vtype):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            etype, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if count > len(self.buf):
                raise NbmoeError(f"{self.path}: corrupt GGUF file (array of {count} items)")
            if etype in _NUMPY:
                dt = np.dtype(_NUMPY[etype])
                start = self.take(count * dt.itemsize)
                return np.frombuffer(self.buf, dt, count, start).copy()
            if etype == GGUFValueType.STRING:
                return self.strings(count)
            return [self.value(etype) for _ in range(count)]
        return self.scalar(_SCALAR[vtype])


class GGUFFile:
    """An opened GGUF: `meta` (key -> value), `tensors` (name -> TensorInfo)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            with open(self.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        except FileNotFoundError:
            raise NbmoeError(f"{self.path}: no such file") from None
        except (ValueError, OSError) as e:  # empty file, a directory, ...
            raise NbmoeError(f"{self.path}: cannot open as a GGUF file ({e})") from None
        self.size = len(self._mmap)
        try:
            self._parse()
        except (ValueError, struct.error, UnicodeDecodeError) as e:
            raise NbmoeError(f"{self.path}: corrupt GGUF file ({e})") from None

    def _parse(self):
        cur = _Cursor(self._mmap, self.path)
        if self.size < 4 or self._mmap[:4] != b"GGUF":
            raise NbmoeError(f"{self.path}: not a GGUF file (bad magic)")
        cur.take(4)
        self.version = cur.scalar("<I")
        if self.version not in (2, 3):
            raise NbmoeError(f"{self.path}: unsupported GGUF version {self.version} (need 2 or 3)")
        n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
        self.meta = {}
        for _ in range(n_kv):
            key = cur.string()
            self.meta[key] = cur.value(cur.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("<I")
            if n_dims > 4:
                raise NbmoeError(f"{self.path}: corrupt GGUF file (tensor {name} has {n_dims} dims)")
            ne = tuple(cur.scalar("<Q") for _ in range(n_dims))
            infos.append((name, ne, cur.scalar("<I"), cur.scalar("<Q")))
        align = int(self.meta.get("general.alignment", 32))
        data_start = (cur.pos + align - 1) // align * align
        self.tensors = {}
        for name, ne, type_id, rel in infos:
            self.tensors[name] = self._tensor(name, ne, type_id, data_start + rel)

    def _tensor(self, name, ne, type_id, offset):
        try:
            gtype = GGMLQuantizationType(type_id)
            block, type_size = GGML_QUANT_SIZES[gtype]
        except (ValueError, KeyError):
            raise NbmoeError(f"{self.path}: tensor {name} has unknown ggml type id {type_id}") from None
        if ne[0] % block:
            raise NbmoeError(f"{self.path}: tensor {name} row length {ne[0]} is not a multiple of "
                             f"{gtype.name}'s block of {block}")
        row_bytes = ne[0] // block * type_size
        n_rows = int(np.prod(ne[1:], dtype=np.int64)) if len(ne) > 1 else 1
        n_bytes = row_bytes * n_rows
        if offset + n_bytes > self.size:
            raise NbmoeError(f"{self.path}: truncated GGUF file (tensor {name} ends at byte "
                             f"{offset + n_bytes}, file has {self.size})")
        data = np.frombuffer(self._mmap, np.uint8, n_bytes, offset)
        data = data.reshape(tuple(reversed(ne[1:])) + (row_bytes,))
        return TensorInfo(name, gtype, ne, offset, n_bytes, data)

    def drop_pages(self, offset, n_bytes):
        """Let the kernel drop the pages wholly inside bytes offset..offset + n_bytes (a tensor
        copied elsewhere); touching them again re-reads the file."""
        page = mmap.PAGESIZE
        lo, hi = (offset + page - 1) // page * page, (offset + n_bytes) // page * page
        if hi > lo and hasattr(self._mmap, "madvise"):
            self._mmap.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    @property
    def architecture(self):
        return self.meta.get("general.architecture", "")

    def table(self):
        """Rows of (name, type, shape, bytes) for listing."""
        return [(t.name, t.type_name, t.shape, t.n_bytes) for t in self.tensors.values()]
