"""A small, fast GGUF header reader (metadata and tensor table), numpy-free.

gguf-py's GGUFReader builds a numpy view per field, which takes seconds for a 49k-token
vocabulary; the header is a simple sequential format, so we parse it directly and use
gguf-py only for its table of block sizes.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from .errors import CorruptModel

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order (fastest-varying first)
    type_id: int
    type_name: str
    offset: int  # absolute, in the file
    n_elements: int
    n_bytes: int


class _Reader:
    def __init__(self, fh: BinaryIO, path: Path):
        self.fh, self.path = fh, path

    def read(self, n: int) -> bytes:
        b = self.fh.read(n)
        if len(b) != n:
            raise CorruptModel(f"{self.path} is truncated: its header ends early")
        return b

    def unpack(self, fmt: str) -> Any:
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        n = self.unpack("<Q")
        if n > 1 << 24:
            raise CorruptModel(f"{self.path} is corrupt: a metadata string claims {n} bytes")
        return self.read(n).decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype in _SCALARS:
            return self.unpack(_SCALARS[vtype])
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, n = self.unpack("<I"), self.unpack("<Q")
            if n > 1 << 28:
                raise CorruptModel(f"{self.path} is corrupt: a metadata array claims {n} items")
            if itype in _SCALARS:
                fmt = _SCALARS[itype]
                size = struct.calcsize(fmt)
                return list(struct.unpack(f"<{n}{fmt[1]}", self.read(size * n)))
            return [self.value(itype) for _ in range(n)]
        raise CorruptModel(f"{self.path} is corrupt: unknown metadata type {vtype}")


def read_gguf_header(path: Path) -> tuple[dict[str, Any], list[GGUFTensor]]:
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as fh:
        r = _Reader(fh, path)
        if fh.read(4) != b"GGUF":
            raise CorruptModel(f"{path} is not a GGUF file (bad magic)")
        version = r.unpack("<I")
        if version not in (2, 3):
            raise CorruptModel(f"{path}: GGUF version {version} is not supported (2 or 3)")
        n_tensors, n_kv = r.unpack("<Q"), r.unpack("<Q")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            meta[key] = r.value(r.unpack("<I"))
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            ndim = r.unpack("<I")
            if ndim > 8:
                raise CorruptModel(f"{path} is corrupt: tensor {name!r} has {ndim} dimensions")
            shape = tuple(r.unpack("<Q") for _ in range(ndim))
            infos.append((name, shape, r.unpack("<I"), r.unpack("<Q")))
        align = int(meta.get("general.alignment", 32))
        data_start = (fh.tell() + align - 1) // align * align
    tensors = []
    for name, shape, type_id, off in infos:
        try:
            qtype = GGMLQuantizationType(type_id)
            block, tsize = GGML_QUANT_SIZES[qtype]
        except (ValueError, KeyError) as exc:
            raise CorruptModel(f"{path}: tensor {name!r} has unknown type {type_id}") from exc
        n = 1
        for d in shape:
            n *= d
        t = GGUFTensor(name, shape, type_id, qtype.name, data_start + off, n, n // block * tsize)
        if t.offset + t.n_bytes > size:
            raise CorruptModel(
                f"{path} is truncated: tensor {name} ends at byte {t.offset + t.n_bytes} but the file has {size}"
            )
        tensors.append(t)
    return meta, tensors
