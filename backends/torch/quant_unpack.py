"""Dequantisation of one quantized linear weight to a float ``[out, in]`` matrix, per checkpoint layout
(swiftlm/quant_config.py names them and the tensors each one stores).  Plain torch, written for
correctness: the reference every faster path (a GPU GEMM reading the packed weight) is checked against.
All arithmetic in float32; integer codes unpacked to int32."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ GEMM: nibble i of a word holds output column 8*word + AWQ_ORDER[i]
_AWQ_COLUMN_AT = tuple(AWQ_ORDER.index(j) for j in range(8))  # output column j's nibble: 0 4 1 5 2 6 3 7


def unpack_last(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 words ``[..., n]`` -> unsigned ``bits``-bit codes ``[..., n * 32 / bits]``, low bits first."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    codes = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # the mask undoes the sign
    return codes.reshape(*packed.shape[:-1], packed.shape[-1] * (32 // bits))


def fp8_weight(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None = None) -> torch.Tensor:
    """``weight`` (float8 e4m3) times its scale: one number, one per output row (``[out, 1]`` or ``[out]``),
    or one per ``block`` of rows x columns (``[ceil(out/bh), ceil(in/bw)]``, the last block clipped)."""
    w = weight.to(torch.float32)
    s = scale.to(torch.float32)
    out, cols = w.shape
    if block is not None and s.dim() == 2 and s.shape != (out, 1):
        bh, bw = block
        s = s.repeat_interleave(bh, 0)[:out].repeat_interleave(bw, 1)[:, :cols]
    elif s.numel() == out and s.numel() != 1:
        s = s.reshape(out, 1)
    else:
        s = s.reshape(())
    return w * s


def awq_weight(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, group: int) -> torch.Tensor:
    """AutoAWQ GEMM (4-bit): ``qweight [in, out/8]``, ``qzeros [in/g, out/8]``, ``scales [in/g, out]``;
    ``w[o, i] = (q[i, o] - z[i/g, o]) * s[i/g, o]``.  ``group`` 0: one group per row."""
    cols = qweight.shape[0]
    order = _awq_columns(scales.shape[1], qweight.device)
    q = unpack_last(qweight, 4)[:, order]
    z = unpack_last(qzeros, 4)[:, order]
    g = torch.arange(cols, device=qweight.device) // (group or cols)
    return ((q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]).t().contiguous()


def _awq_columns(out: int, device: torch.device) -> torch.Tensor:
    j = torch.arange(out, device=device)
    return (j // 8) * 8 + torch.tensor(_AWQ_COLUMN_AT, device=device)[j % 8]


def gptq_weight(
    qweight: torch.Tensor,
    qzeros: torch.Tensor | None,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    bits: int,
    group: int,
    zero_offset: int,
) -> torch.Tensor:
    """GPTQ: ``qweight [in*bits/32, out]`` (packed along the input dim), ``qzeros [groups, out*bits/32]``,
        ``scales [groups, out]``, ``g_idx [in]`` (each input column's group; act-order permutes it);
        ``w[o, i] = (q[i, o] - z[g_idx[i], o]) * s[g_idx[i], o]``.  The original format stores z - 1
        (``zero_offset`` 1).  Symmetric checkpoints store the mid code 2^(bits-1) as their zero points; without
    qzeros it is assumed."""
    q = unpack_last(qweight.t(), bits).t()  # [in, out]
    cols = q.shape[0]
    if g_idx is None:
        g_idx = torch.arange(cols, device=q.device) // (group or cols)
    g_idx = g_idx.long()
    if qzeros is None:
        z = torch.full_like(scales, 1 << (bits - 1), dtype=torch.int32)
    else:
        z = unpack_last(qzeros, bits)[:, : scales.shape[1]] + zero_offset
    return ((q - z[g_idx]).to(torch.float32) * scales.to(torch.float32)[g_idx]).t().contiguous()


def packed_weight(
    weight_packed: torch.Tensor,
    scale: torch.Tensor,
    shape: tuple[int, int],
    bits: int,
    group: int,
    zero_point: torch.Tensor | None = None,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """compressed-tensors pack-quantized: ``weight_packed [out, ceil(in*bits/32)]`` (codes stored plus
    2^(bits-1), low bits first along the input dim), ``weight_scale [out, groups]``, optional
    ``weight_zero_point [ceil(out*bits/32), groups]`` (packed along the output dim, same offset) and
    ``weight_g_idx [in]``; ``w[o, i] = (q[o, i] - z[o, g(i)]) * s[o, g(i)]``."""
    out, cols = shape
    half = 1 << (bits - 1)
    q = unpack_last(weight_packed, bits)[:, :cols] - half
    if g_idx is None:
        g_idx = torch.arange(cols, device=q.device) // (group or cols)
    g_idx = g_idx.long()
    s = scale.to(torch.float32).reshape(out, -1)[:, g_idx]
    if zero_point is None:
        return q.to(torch.float32) * s
    z = (unpack_last(zero_point.t(), bits).t()[:out] - half)[:, g_idx]
    return (q - z).to(torch.float32) * s
