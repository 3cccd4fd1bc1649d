"""Where every MoE expert's weights lie on disk, read from the safetensors headers alone.

Two layouts are recognised, 16-bit or MLX-quantized (``weight`` + ``scales`` + ``biases``):

- per-expert tensors (Hugging Face qwen2_moe / qwen3_moe / mixtral):
  ``model.layers.L.mlp.experts.E.gate_proj.weight``, ``...block_sparse_moe.experts.E.w1.weight``
- stacked ``[E, out, in]`` tensors (mlx-lm's converted checkpoints):
  ``model.layers.L.mlp.switch_mlp.gate_proj.weight``; expert E's slab is the E-th contiguous
  ``nbytes / E`` bytes of the tensor.

Projections are named gate / up / down (mixtral's w1 / w3 / w2).
"""

from __future__ import annotations

import json
import logging
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

PROJECTIONS = ("gate", "up", "down")
_PROJ = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down", "w1": "gate", "w3": "up", "w2": "down"}
_PER_EXPERT = re.compile(
    r"^(?P<pre>(?:.*\.)?layers\.(?P<L>\d+)\.(?:mlp|block_sparse_moe))\.experts\.(?P<E>\d+)\."
    r"(?P<p>gate_proj|up_proj|down_proj|w1|w2|w3)\.(?P<c>weight|scales|biases)$"
)
_STACKED = re.compile(
    r"^(?P<pre>(?:.*\.)?layers\.(?P<L>\d+)\.(?:mlp|block_sparse_moe))\.switch_mlp\."
    r"(?P<p>gate_proj|up_proj|down_proj)\.(?P<c>weight|scales|biases)$"
)
DTYPE_BYTES = {"BF16": 2, "F16": 2, "F32": 4, "U32": 4, "I32": 4, "U8": 1, "I8": 1, "F64": 8, "I64": 8}


@dataclass(frozen=True)
class ExpertSlab:
    """One expert's part of one tensor: ``nbytes`` at absolute ``offset`` in ``files[file]``."""

    file: int
    offset: int
    nbytes: int
    shape: tuple[int, ...]  # one expert's shape, e.g. (out, in) or (out, in // 8) packed
    dtype: str  # safetensors dtype: BF16, F16, F32, U32


@dataclass
class ExpertLayout:
    files: list[Path]
    num_experts: int
    style: str  # "per_expert" or "stacked"
    # layer -> (projection, component) -> per-expert slabs
    slabs: dict[int, dict[tuple[str, str], list[ExpertSlab]]] = field(default_factory=dict)
    module_prefix: dict[int, str] = field(default_factory=dict)  # layer -> "model.layers.L.mlp"
    expert_tensors: set[str] = field(default_factory=set)  # names never loaded when streaming
    total_bytes: int = 0  # every tensor in the files
    expert_bytes_total: int = 0

    @property
    def layers(self) -> list[int]:
        return sorted(self.slabs)

    @property
    def quantized(self) -> bool:
        return any(c == "scales" for parts in self.slabs.values() for (_, c) in parts)

    def bytes_per_expert(self, layer: int | None = None) -> int:
        """Bytes of one expert of one layer (all projections and components)."""
        parts = self.slabs[self.layers[0] if layer is None else layer]
        return sum(s[0].nbytes for s in parts.values())

    @property
    def resident_bytes(self) -> int:
        """Tensor bytes that are not experts (what a streaming run keeps loaded, as stored)."""
        return self.total_bytes - self.expert_bytes_total

    def bytes_per_token(self, experts_per_token: int) -> int:
        """Expected expert bytes one decoded token reads: layers x k x bytes per expert."""
        return sum(experts_per_token * self.bytes_per_expert(li) for li in self.layers)


def clamp_top_k(requested: int, native: int) -> int:
    """Experts per token to use for ``--expert-top-k requested`` (0: the model's ``native``);
    larger values are clamped to the model's, with a warning.  Logs a change."""
    if not requested:
        return native
    used = max(1, min(requested, native))
    if requested > native:
        log.warning("--expert-top-k %d is above the model's %d experts per token; using %d", requested, native, used)
    elif used != native:
        log.info("experts per token: %d (the model's %d; --expert-top-k)", used, native)
    return used


def read_header(path: Path) -> tuple[int, dict]:
    """(byte offset where the data starts, header dict) of a safetensors file."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        if n > 100_000_000:
            raise ValueError(f"{path}: not a safetensors file (header length {n})")
        header = json.loads(f.read(n))
    return 8 + n, header


def scan_experts(weight_files: Iterable[Path]) -> ExpertLayout | None:
    """The expert layout of a checkpoint, or None when it has no expert tensors we recognise."""
    files = [Path(f) for f in weight_files]
    found: dict[tuple[int, str, str], dict[int, ExpertSlab]] = {}
    prefix: dict[int, str] = {}
    names: set[str] = set()
    total = expert_total = 0
    num_experts = 0
    style = ""
    for fi, path in enumerate(files):
        if path.suffix != ".safetensors":
            return None
        base, header = read_header(path)
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            start, end = meta["data_offsets"]
            total += end - start
            m = _PER_EXPERT.match(name)
            if m:
                style = style or "per_expert"
                key = (int(m["L"]), _PROJ[m["p"]], m["c"])
                e = int(m["E"])
                found.setdefault(key, {})[e] = ExpertSlab(
                    fi, base + start, end - start, tuple(meta["shape"]), meta["dtype"]
                )
                num_experts = max(num_experts, e + 1)
            else:
                m = _STACKED.match(name)
                if not m:
                    continue
                style = style or "stacked"
                key = (int(m["L"]), _PROJ[m["p"]], m["c"])
                n_e = int(meta["shape"][0])
                size = (end - start) // n_e
                found[key] = {
                    e: ExpertSlab(fi, base + start + e * size, size, tuple(meta["shape"][1:]), meta["dtype"])
                    for e in range(n_e)
                }
                num_experts = max(num_experts, n_e)
            names.add(name)
            expert_total += end - start
            prefix[int(m["L"])] = m["pre"]
    if not found:
        return None
    layout = ExpertLayout(
        files=files,
        num_experts=num_experts,
        style=style,
        module_prefix=prefix,
        expert_tensors=names,
        total_bytes=total,
        expert_bytes_total=expert_total,
    )
    for (li, proj, comp), per in found.items():
        missing = [e for e in range(num_experts) if e not in per]
        if missing:
            raise ValueError(f"layer {li} {proj}.{comp}: experts {missing[:8]} have no tensor")
        layout.slabs.setdefault(li, {})[(proj, comp)] = [per[e] for e in range(num_experts)]
    for li, parts in layout.slabs.items():
        if {p for p, _ in parts} != set(PROJECTIONS):
            raise ValueError(
                f"layer {li}: expert projections {sorted({p for p, _ in parts})}, expected gate, up and down"
            )
    return layout
