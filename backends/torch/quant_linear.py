"""A linear layer whose weight stays quantized in memory: ``QuantLinear`` holds one weight in a kernel-friendly
layout (FP8 ``[N, K]`` with per-row or block scales; 4-bit codes ``[N, K/8]`` with group scales and zero points)
and computes ``y = x @ W.T (+ b)``.  The model's projections hand it to ``linear_rows.rows_linear`` / ``linear``
wherever a weight tensor would go (the one branch of the forward), so fused QKV and gate/up, CUDA graphs, the
batched decode step and prompt chunks all run through ``__call__``.

On CUDA the way a call runs is looked up by (format, rows) in ``PATHS`` (``path_for``):

- ``kernel``: the Triton kernel of cuda_ext/quant_gemv.py, which dequantises the weight tile in registers
  (the GEMV of one decode row; a ``tl.dot`` GEMM for a few rows);
- ``scaled_mm``: FP8 with per-row scales only: ``torch._scaled_mm`` (FP8 tensor cores, Hopper and Ada), the
  activations rounded to FP8 per row by one Triton launch (``act_quant_fp8``);
- ``dequant``: the weight dequantised into a scratch buffer of the model's dtype (one pass over the packed
  weight), then cuBLAS.  The bytes moved are ~1.5x (FP8) / ~1.25x (int4) those of the 16-bit weight, so it
  is slower than 16-bit weights, but at many rows it beats a dequantising GEMM that is not tuned for them.

Anywhere else (the CPU; 8-bit integer codes, kept as the dequantised ``dense`` weight): ``F.linear`` on the
dequantised weight.  ``SWIFTLM_QUANT_PATHS`` overrides table entries (``fp8:16=scaled_mm,int4:1=dequant``: the
rows bound of an existing entry, or a new bound) for A/B runs; scripts/bench_quant_serve.py times every path
and launch configuration on the 8B shapes and prints the table the timings pick.

Every path is free of host synchronisation and keeps shapes static, so a CUDA graph captures it.
``dequantized()`` is the same weight as quant_weights.dequantize_state gives (the reference; tests check it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from swiftlm.cuda_ext import enabled as _kernels_enabled
from swiftlm.quant_config import QuantScheme

from . import quant_unpack as U
from .quant_weights import DROPPED, dequantize_state, quantized_layers

QG = None  # the kernels (Triton): imported where CUDA is, else every call takes the dequantised F.linear
if torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    try:
        from swiftlm.cuda_ext import quant_gemv as QG
    except ImportError:  # pragma: no cover - no triton on this platform
        QG = None

FP8_MAX = 448.0
FP8 = torch.float8_e4m3fn


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] 4-bit codes -> [N, K/8] int32, column 8j+i at bits 4i of word j."""
    N, K = codes.shape
    c = codes.to(torch.int64).reshape(N, K // 8, 8)
    word = torch.zeros(N, K // 8, dtype=torch.int64, device=codes.device)
    for i in range(8):
        word |= c[:, :, i] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)


_KERNELS: dict[str, bool] = {}


def kernels_ok() -> bool:
    """The Triton kernels run on CUDA here (self-checked once per process by ``cuda_ext.enabled``)."""
    ok = _KERNELS.get("cuda")
    if ok is None:
        ok = _KERNELS["cuda"] = QG is not None and _kernels_enabled("cuda")
    return ok


KERNEL, SCALED_MM, DEQUANT = "kernel", "scaled_mm", "dequant"
# (format, rows up to) -> path; the first bound >= the call's rows wins.  From the first H100 run
# (docs/results/quant_formats_h100.json, 8B shapes, us against bf16 cuBLAS):
# - fp8 (per-row): 1 row the GEMV (down 25 vs 43, 1.7x); 16 rows the kernel (gate_up 48 vs 84, down 48 vs 46);
#   more rows _scaled_mm (gate_up 80 vs 90; down 74 vs 54, its activation rounding was seven launches then,
#   one now); a dequantising pass would add ~0.5x of a 16-bit weight read to cuBLAS's time, so never wins here;
# - fp8-block: the kernel at 16 / 128 rows took 318-2783 us (0.03-0.14x): from 2 rows the weight dequantised
#   (est. ~1.5x the bf16 time: read 1 byte, write 2, GEMM reads 2);
# - int4: 16 rows 98-162 us (0.5x), 128 rows 682-889 (0.08-0.10x): the kernel up to 16 rows (now one row block
#   per program), dequant beyond (est. ~1.25x the bf16 time).
PATHS: dict[str, list[tuple[int, str]]] = {
    "fp8": [(16, KERNEL), (1 << 30, SCALED_MM)],
    "fp8-block": [(1, KERNEL), (1 << 30, DEQUANT)],
    "int4": [(16, KERNEL), (1 << 30, DEQUANT)],
}


def set_paths(spec: str) -> None:
    """``fmt:rows=path,...`` into ``PATHS`` (a bound of the table replaced, or a new bound added)."""
    for item in filter(None, (p.strip() for p in spec.split(","))):
        key, path = item.split("=")
        fmt, rows = key.split(":")
        if fmt not in PATHS or path not in (KERNEL, SCALED_MM, DEQUANT) or (path == SCALED_MM and fmt != "fp8"):
            raise ValueError(f"SWIFTLM_QUANT_PATHS: {item!r} is not format:rows=path of {sorted(PATHS)}")
        table = dict(PATHS[fmt])
        table[int(rows)] = path
        PATHS[fmt] = sorted(table.items())


if os.environ.get("SWIFTLM_QUANT_PATHS"):
    set_paths(os.environ["SWIFTLM_QUANT_PATHS"])


def path_for(fmt: str, rows: int) -> str:
    for bound, path in PATHS[fmt]:
        if rows <= bound:
            return path
    return PATHS[fmt][-1][1]


def paths_table() -> str:
    """``PATHS`` as one line per format (printed by the GPU benchmark)."""
    out = []
    for fmt, table in PATHS.items():
        merged: list[list] = []
        for bound, path in table:  # neighbouring bounds of one path as one range
            if merged and merged[-1][1] == path:
                merged[-1][0] = bound
            else:
                merged.append([bound, path])
        lo, parts = 1, []
        for bound, path in merged:
            parts.append(f"{lo}-{bound if bound < 1 << 30 else 'inf'}: {path}")
            lo = bound + 1
        out.append(f"{fmt:9} " + ", ".join(parts))
    return "\n".join(out)


_SCRATCH: list[torch.Tensor] = []


def scratch(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A buffer of at least ``numel`` elements for a dequantised weight, shared by every layer (the calls of
    one stream run one after another).  Buffers are never freed: a CUDA graph that captured a call keeps
    writing into the buffer it captured, so a smaller one that a larger weight outgrew stays allocated."""
    for buf in reversed(_SCRATCH):
        if buf.dtype == dtype and buf.device == device and buf.numel() >= numel:
            return buf[:numel]
    buf = torch.empty(numel, dtype=dtype, device=device)
    _SCRATCH.append(buf)
    return buf


@dataclass
class QuantLinear:
    kind: str  # "fp8" | "int4" | "dense"
    weight: torch.Tensor  # fp8 [N, K] | int32 [N, K/8] | the dequantised weight [N, K]
    scale: torch.Tensor | None = None  # fp8: float32 [N] per row, or [ceil(N/bh), ceil(K/bw)] blocks; int4: [N, K/G]
    zeros: torch.Tensor | None = None  # int4: [N, K/G], codes' domain
    group: int = 0
    block: tuple[int, int] | None = None
    perm: torch.Tensor | None = None  # act-order: x's columns in the weight's order
    dtype: torch.dtype = torch.float32  # the model's: of the dequantised weight and (with x's) of the output

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features), as a weight tensor's."""
        N = self.weight.shape[0]
        return (N, self.weight.shape[1] * 8) if self.kind == "int4" else (N, self.weight.shape[1])

    @property
    def out_features(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.weight, self.scale, self.zeros) if t is not None)

    @property
    def device(self) -> torch.device:
        return self.weight.device

    def to(self, device: torch.device) -> QuantLinear:
        mv = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()}
        return QuantLinear(**mv)

    def describe(self) -> str:
        if self.kind == "fp8":
            return "fp8 e4m3, " + (f"{self.block[0]}x{self.block[1]} block scales" if self.block else "per-row scales")
        return f"int4, group {self.group}" if self.kind == "int4" else "dequantised"

    def with_dtype(self, dtype: torch.dtype) -> QuantLinear:
        mv = dict(vars(self), dtype=dtype)
        if self.kind == "dense":
            mv["weight"] = self.weight.to(dtype)
        return QuantLinear(**mv)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.kind == "fp8":
            w = U.fp8_weight(self.weight, self.scale if self.block else self.scale.reshape(-1, 1), self.block)
        elif self.kind == "int4":
            q = U.unpack_last(self.weight, 4).float()
            g = torch.arange(q.shape[1], device=q.device) // self.group
            w = (q - self.zeros.float()[:, g]) * self.scale.float()[:, g]
        else:
            w = self.weight.float()
        if self.perm is not None:  # back to the checkpoint's column order
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)

    @property
    def fmt(self) -> str:
        """The ``PATHS`` key: ``fp8`` (per-row scales), ``fp8-block`` or ``int4``."""
        return "fp8-block" if self.block is not None else self.kind

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.kind == "dense":
            y = F.linear(x2, self.weight if self.weight.dtype == x.dtype else self.weight.to(x.dtype))
        elif x.is_cuda and kernels_ok():
            if self.perm is not None:
                x2 = x2.index_select(1, self.perm)
            y = self._cuda(x2 if x2.is_contiguous() else x2.contiguous(), path_for(self.fmt, x2.shape[0]))
        else:  # the CPU: the weight dequantised for this call (in the checkpoint's column order)
            y = F.linear(x2, self.dequantized(x.dtype))
        if b is not None:
            y = y + b
        return y if len(shape) == 2 else y.reshape(*shape[:-1], self.out_features)

    def _cuda(self, x: torch.Tensor, path: str) -> torch.Tensor:
        """``x`` [M, K] (contiguous; act-order columns already gathered) through ``path``."""
        if path == SCALED_MM and self.kind == "fp8" and self.block is None and scaled_mm_ok(x.device):
            if self.weight.shape[1] % 16 == 0 == self.weight.shape[0] % 16:
                return fp8_scaled_mm(x, self.weight, self.scale)
        if path == DEQUANT:
            N, K = self.shape
            w = scratch(N * K, x.dtype, x.device).view(N, K)
            if self.kind == "int4":
                QG.int4_dequant(self.weight, self.scale, self.zeros, self.group, w)
            else:
                QG.fp8_dequant(self.weight, self.scale, self.block, w)
            return F.linear(x, w)
        if self.kind == "int4":
            return QG.int4_linear(x, self.weight, self.scale, self.zeros, self.group)
        return QG.fp8_linear(x, self.weight, self.scale, self.block)


class QuantProj(nn.Module):
    """An ``nn.Linear``'s place in the model for a quantized weight: ``weight`` is the ``QuantLinear`` (read by
    ``rows_linear`` / ``out_proj`` like a weight tensor), ``bias`` a tensor or None."""

    def __init__(self, weight: QuantLinear, bias: torch.Tensor | None = None):
        super().__init__()
        self.weight = weight
        self.bias = bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight(x, self.bias)


def weight_bytes(w: torch.Tensor | QuantLinear | QuantParts | None) -> int:
    if w is None:
        return 0
    return w.numel() * w.element_size() if torch.is_tensor(w) else w.nbytes


_SCALED_MM: dict[torch.device, bool] = {}


def scaled_mm_ok(device: torch.device) -> bool:
    """FP8 tensor-core GEMMs here (Ada, Hopper and newer; ``SWIFTLM_SCALED_MM=0`` keeps the Triton kernel)."""
    if device not in _SCALED_MM:
        _SCALED_MM[device] = (
            hasattr(torch, "_scaled_mm")
            and os.environ.get("SWIFTLM_SCALED_MM", "1") != "0"
            and torch.cuda.get_device_capability(device) >= (8, 9)
        )
    return _SCALED_MM[device]


def fp8_scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (16-bit, contiguous) @ (w8 [N, K] * scale [N]).T on FP8 tensor cores: x quantized per row on the
    fly (its absolute maximum to 448; one Triton launch, no host sync), rowwise float32 scales for both
    operands, output in x's dtype."""
    x8, sx = QG.act_quant_fp8(x) if kernels_ok() else _act_quant(x)
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=scale.reshape(1, -1), out_dtype=x.dtype)


def _act_quant(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    sx = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(FP8), sx


def quantize_fp8(w: torch.Tensor) -> QuantLinear:
    """A 16/32-bit weight [N, K] as FP8 e4m3 with one float32 scale per output row (its absolute maximum to 448),
    computed on ``w``'s device (``--quantize fp8``)."""
    wf = w.float()
    s = (wf.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
    w8 = (wf / s[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return QuantLinear("fp8", w8.contiguous(), s.contiguous())


def cat_rows(parts: list[torch.Tensor | QuantLinear]) -> torch.Tensor | QuantLinear:
    """Weights stacked along their output features (fused QKV, gate/up): ``torch.cat`` of tensors; quantized parts
    of one kind concatenated with their scales (block-scaled FP8 where every part but the last fills whole
    blocks, else with its block scales repeated per row; int4 with one group size and one column order); quantized
    parts that cannot share a layout as ``QuantParts``; a mix with dense parts as the dequantised tensor."""
    if all(torch.is_tensor(p) for p in parts):
        return torch.cat(parts)
    qs = [p for p in parts if isinstance(p, QuantLinear)]
    first = qs[0]
    same = len(qs) == len(parts) and all(q.kind == first.kind and q.block == first.block for q in qs)
    if same and first.block is not None and any(q.shape[0] % first.block[0] for q in qs[:-1]):
        qs = [_row_blocks(q) for q in qs]  # a part ends inside a block: one scale row per weight row
        first = qs[0]
    if same and first.kind == "int4":
        same = all(q.group == first.group for q in qs) and all(
            (q.perm is None and first.perm is None) or (q.perm is not None and first.perm is not None and
                                                        torch.equal(q.perm, first.perm))
            for q in qs
        )  # fmt: skip
    if not same and len(qs) == len(parts) and all(q.kind != "dense" for q in qs):
        return QuantParts(qs)  # e.g. act-order parts, each with its own column order: one kernel call each
    if not same or first.kind == "dense":
        dtype = parts[0].dtype
        return torch.cat([p.dequantized(dtype) if isinstance(p, QuantLinear) else p.to(dtype) for p in parts])
    cat = [torch.cat([getattr(q, f) for q in qs]) for f in ("weight", "scale")]
    zeros = torch.cat([q.zeros for q in qs]) if first.kind == "int4" else None
    return QuantLinear(first.kind, cat[0], cat[1], zeros, first.group, first.block, first.perm, first.dtype)


class QuantParts:
    """Quantized weights applied one after another, their outputs side by side: a fused projection whose parts
    cannot share one layout (GPTQ act-order parts, each with its own column order)."""

    def __init__(self, parts: list[QuantLinear]):
        self.parts = parts
        self.dtype = parts[0].dtype

    @property
    def shape(self) -> tuple[int, int]:
        return (sum(p.shape[0] for p in self.parts), self.parts[0].shape[1])

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)

    def dequantized(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        return torch.cat([p.dequantized(dtype) for p in self.parts])

    def __call__(self, x: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        y = torch.cat([p(x) for p in self.parts], dim=-1)
        return y if b is None else y + b


def _row_blocks(q: QuantLinear) -> QuantLinear:
    """Block-scaled FP8 as (1, bw) blocks: each row its own copy of its block's scales (the same weight)."""
    bh, bw = q.block
    scale = q.scale.repeat_interleave(bh, 0)[: q.shape[0]].contiguous()
    return QuantLinear("fp8", q.weight, scale, block=(1, bw), dtype=q.dtype)


def from_checkpoint(tensors: dict[str, torch.Tensor], s: QuantScheme) -> QuantLinear:
    """One layer's checkpoint tensors (local names: ``qweight``, ``weight_scale``, ...) in the kernel layout."""
    if s.kind == "fp8":
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        w8 = tensors["weight"].contiguous()
        N = w8.shape[0]
        if s.block is not None and tuple(scale.shape) != (N, 1):
            return QuantLinear("fp8", w8, scale.float().contiguous(), block=s.block)
        if scale.numel() not in (1, N):
            raise ValueError(f"an fp8 scale of shape {tuple(scale.shape)} for a [{N}, ...] weight")
        return QuantLinear("fp8", w8, scale.float().reshape(-1).expand(N).contiguous())  # per tensor -> per row
    if s.bits != 4:  # 8-bit codes: no kernel here, the dequantised weight
        return QuantLinear("dense", _dequant(tensors, s))
    if s.layout == "awq":
        order = U._awq_columns(tensors["scales"].shape[1], tensors["qweight"].device)
        codes = U.unpack_last(tensors["qweight"], 4)[:, order].t()  # [N, K]
        zeros = U.unpack_last(tensors["qzeros"], 4)[:, order].t()
        scales, perm = tensors["scales"].t(), None
    elif s.layout == "gptq":
        codes = U.unpack_last(tensors["qweight"].t(), 4)  # [N, K]
        N, K = codes.shape
        scales = tensors["scales"].t()  # [N, groups]
        if "qzeros" in tensors:
            zeros = (U.unpack_last(tensors["qzeros"], 4)[:, :N] + s.zero_offset).t()
        else:
            zeros = torch.full_like(scales, 8, dtype=torch.int32)
        g_idx = tensors.get("g_idx")
        perm = None
        if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(K) // (s.group_size or K)):
            perm = torch.argsort(g_idx.long(), stable=True)  # columns grouped contiguously
            if not torch.equal(g_idx.long()[perm], torch.arange(K) // (s.group_size or K)):
                return QuantLinear("dense", _dequant(tensors, s))  # groups of unequal sizes
            codes = codes[:, perm]
    else:  # compressed-tensors pack-quantized: codes stored + 8
        N, K = (int(v) for v in tensors["weight_shape"]) if "weight_shape" in tensors else (None, None)
        codes = U.unpack_last(tensors["weight_packed"], 4)[:, :K] if K else U.unpack_last(tensors["weight_packed"], 4)
        scales = tensors["weight_scale"]
        zp = tensors.get("weight_zero_point")
        zeros = U.unpack_last(zp.t(), 4).t()[: codes.shape[0]] if zp is not None and not s.symmetric else None
        zeros = torch.full_like(scales, 8, dtype=torch.int32) if zeros is None else zeros
        g_idx, perm = tensors.get("weight_g_idx"), None
        if g_idx is not None:
            perm = torch.argsort(g_idx.long(), stable=True)
            codes = codes[:, perm]
    group = s.group_size or codes.shape[1]
    if codes.shape[1] % 8 or group % 8:
        return QuantLinear("dense", _dequant(tensors, s))
    return QuantLinear(
        "int4",
        pack_rows(codes),
        scales.contiguous(),
        zeros.to(scales.dtype).contiguous(),
        group=group,
        perm=perm,
    )


_LAYER_TENSORS = (
    "weight",
    "weight_scale",
    "weight_scale_inv",
    "qweight",
    "qzeros",
    "scales",
    "g_idx",
    "weight_packed",
    "weight_zero_point",
    "weight_g_idx",
    "weight_shape",
)


def quantized_state(state: dict[str, torch.Tensor], scheme: QuantScheme) -> dict:
    """``state`` with each quantized layer's tensors replaced by ``<module>.weight`` -> ``QuantLinear`` (in
    place; returned for chaining); tensors of quantized activations or KV caches dropped (as dequantize_state)."""
    layers = quantized_layers(state, scheme)
    if not layers:  # the same sentence as the dequantising path
        return dequantize_state(state, scheme)
    for m in layers:
        local = {n: state.pop(f"{m}.{n}") for n in _LAYER_TENSORS if f"{m}.{n}" in state}
        state[m + ".weight"] = from_checkpoint(local, scheme)
    for k in [k for k in state if k.rsplit(".", 1)[-1] in DROPPED]:
        del state[k]
    return state


def _dequant(tensors: dict[str, torch.Tensor], s: QuantScheme) -> torch.Tensor:
    state = {f"m.{k}": v for k, v in tensors.items()}
    return dequantize_state(state, s)["m.weight"]
