"""The seam for GPU paths that keep a quantized layer's weight quantized: ``QuantLinear`` holds one layer in a
kernel-friendly layout (FP8 ``[N, K]`` with its scales; 4-bit codes ``[N, K/8]`` with group scales and zero
points) and computes ``y = x @ W.T``:

- on CUDA, rows <= 16 (decode): the Triton kernels of cuda_ext/quant_gemv.py, which dequantise in registers;
- on CUDA, FP8 with per-tensor or per-row scales and more rows: ``torch._scaled_mm`` (FP8 tensor cores, Hopper
  and Ada) with dynamic per-row activation scales;
- anywhere else (the CPU, 8-bit codes, block-scaled FP8 prefill): ``F.linear`` on the dequantised weight.

``dequantized()`` is the same weight as quant_weights.dequantize_state gives (the reference; tests check it).
The native model does not route its projections through this yet: today every layer is dequantised at load.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from swiftlm.quant_config import QuantScheme

from . import quant_unpack as U

FP8_MAX = 448.0


def pack_rows(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] 4-bit codes -> [N, K/8] int32, column 8j+i at bits 4i of word j."""
    N, K = codes.shape
    c = codes.to(torch.int64).reshape(N, K // 8, 8)
    word = torch.zeros(N, K // 8, dtype=torch.int64, device=codes.device)
    for i in range(8):
        word |= c[:, :, i] << (4 * i)
    return (word - ((word >> 31) << 32)).to(torch.int32)


@dataclass
class QuantLinear:
    kind: str  # "fp8" | "int4" | "dense"
    weight: torch.Tensor  # fp8 [N, K] | int32 [N, K/8] | the dequantised weight [N, K]
    scale: torch.Tensor | None = None  # fp8: scalar / [N, 1] / blocks; int4: [N, K/G]
    zeros: torch.Tensor | None = None  # int4: [N, K/G], codes' domain
    group: int = 0
    block: tuple[int, int] | None = None
    perm: torch.Tensor | None = None  # act-order: x's columns in the weight's order

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def to(self, device: torch.device) -> QuantLinear:
        mv = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in vars(self).items()}
        return QuantLinear(**mv)

    def dequantized(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        if self.kind == "fp8":
            w = U.fp8_weight(self.weight, self.scale, self.block)
        elif self.kind == "int4":
            q = U.unpack_last(self.weight, 4).float()
            g = torch.arange(q.shape[1], device=q.device) // self.group
            w = (q - self.zeros.float()[:, g]) * self.scale.float()[:, g]
        else:
            w = self.weight.float()
        if self.perm is not None:  # back to the checkpoint's column order
            w = w[:, torch.argsort(self.perm)]
        return w.to(dtype)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if self.perm is not None:
            x2 = x2.index_select(1, self.perm)
        y = self._gpu(x2) if x.is_cuda else None
        if y is None:
            w = self.dequantized(x.dtype)
            if self.perm is not None:
                w = w[:, self.perm]
            y = F.linear(x2, w)
        return y.reshape(*shape[:-1], self.out_features)

    def _gpu(self, x: torch.Tensor) -> torch.Tensor | None:
        M = x.shape[0]
        x = x.contiguous()
        kernels = M <= 16 and _triton()
        if self.kind == "fp8" and kernels:
            from swiftlm.cuda_ext.quant_gemv import fp8_linear_small_m

            return fp8_linear_small_m(x, self.weight, self.scale, self.block)
        if self.kind == "int4" and kernels:
            from swiftlm.cuda_ext.quant_gemv import int4_linear_small_m

            return int4_linear_small_m(x, self.weight, self.scale, self.zeros, self.group)
        if self.kind == "fp8" and self.block is None and scaled_mm_ok(x.device):
            return fp8_scaled_mm(x, self.weight, self.scale)
        return None


def _triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def scaled_mm_ok(device: torch.device) -> bool:
    return hasattr(torch, "_scaled_mm") and torch.cuda.get_device_capability(device) >= (8, 9)


def fp8_scaled_mm(x: torch.Tensor, w8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (16-bit) @ (w8 [N, K] * scale).T on FP8 tensor cores: x quantized per row on the fly (its
    absolute maximum to 448), rowwise scales for both operands, output in x's dtype."""
    sx = (x.abs().amax(dim=1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    x8 = (x.float() / sx).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    N = w8.shape[0]
    sw = scale.float().reshape(-1)
    sw = (sw.expand(N) if sw.numel() == 1 else sw).reshape(1, N).contiguous()
    return torch._scaled_mm(x8, w8.t(), scale_a=sx, scale_b=sw, out_dtype=x.dtype)


def from_checkpoint(tensors: dict[str, torch.Tensor], s: QuantScheme) -> QuantLinear:
    """One layer's checkpoint tensors (local names: ``qweight``, ``weight_scale``, ...) in the kernel layout."""
    if s.kind == "fp8":
        scale = tensors.get("weight_scale_inv", tensors.get("weight_scale"))
        w8 = tensors["weight"].contiguous()
        if s.block is None and scale.numel() not in (1, w8.shape[0]):
            raise ValueError(f"an fp8 scale of shape {tuple(scale.shape)} for a [{w8.shape[0]}, ...] weight")
        return QuantLinear("fp8", w8, scale.float().contiguous(), block=s.block)
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


def _dequant(tensors: dict[str, torch.Tensor], s: QuantScheme) -> torch.Tensor:
    from .quant_weights import dequantize_state

    state = {f"m.{k}": v for k, v in tensors.items()}
    return dequantize_state(state, s)["m.weight"]
