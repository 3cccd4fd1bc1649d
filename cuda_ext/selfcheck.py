"""Run every kernel once against its reference on random data (used by ``enabled``)."""

from __future__ import annotations

import torch


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


def check_all(
    device: str,
    dtype: torch.dtype,
    H: int = 8,
    KVH: int = 2,
    D: int = 64,
    N: int = 320,
    I: int = 1500,
    C: int = 16,
    seed: int = 0,
) -> dict[str, float]:
    """Relative errors kernel vs reference for each kernel (fresh random inputs)."""
    from .decode_kernels import (
        add_rmsnorm,
        add_rmsnorm_ref,
        rope_kv_write_rows,
        rope_kv_write_rows_ref,
        silu_mul,
        silu_mul_ref,
    )

    g = torch.Generator(device="cpu").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(device=device, dtype=dtype)

    errs = {}
    # batched: 3 rows into slots 2, 0, 3 of a 4-slot pool (+ scratch) at their own positions
    B, S = 3, 5
    qkv = rnd(B, (H + 2 * KVH) * D)
    ang = torch.rand(C, D // 2, generator=g) * 6.28
    ctab = torch.cat([ang.cos(), ang.cos()], -1).to(device=device, dtype=dtype)
    stab = torch.cat([ang.sin(), ang.sin()], -1).to(device=device, dtype=dtype)
    pos, slots = torch.tensor([0, 7, C - 1], device=device), torch.tensor([2, 0, 3], device=device)
    kp, vp = rnd(S, KVH, C, D), rnd(S, KVH, C, D)
    kp2, vp2 = kp.clone(), vp.clone()
    q1 = rope_kv_write_rows(qkv, ctab, stab, pos, slots, kp, vp, H, KVH, D)
    q2 = rope_kv_write_rows_ref(qkv, ctab, stab, pos, slots, kp2, vp2, H, KVH, D)
    errs["rope_kv_write_rows"] = max(_rel(q1, q2), _rel(kp, kp2), _rel(vp, vp2))
    for rows, name in ((1, "add_rmsnorm"), (B, "add_rmsnorm_rows")):
        x, d, w = rnd(rows, N), rnd(rows, N), rnd(N)
        x2 = x.clone()
        y1 = add_rmsnorm(x, d, w, 1e-5)
        y2 = add_rmsnorm_ref(x2, d, w, 1e-5)
        errs[name] = max(_rel(y1, y2), _rel(x, x2))
    for rows, name in ((1, "silu_mul"), (B, "silu_mul_rows")):
        gu = rnd(rows, 2 * I)
        errs[name] = _rel(silu_mul(gu), silu_mul_ref(gu))
    from .paged_attention import selfcheck as paged_selfcheck

    errs["paged_decode_attention"] = paged_selfcheck(device, dtype, seed)
    from .affine_kv_kernels import selfcheck as affine_selfcheck

    # affine kv_bits decode attention (4 and 8 bits) and the row encoder (an inexact code counts as 1.0)
    errs["affine_decode_attention"] = affine_selfcheck(device, dtype, seed)
    from .code_rows import selfcheck as code_rows_selfcheck

    errs["code_rows"] = code_rows_selfcheck(device, dtype, seed)  # compressed rows -> 16-bit rows (prompt chunks)
    from .gemv import linear_small_m, linear_small_m_ref

    x, w = rnd(1, 3 * N), rnd(I, 3 * N) * 0.05  # odd N and K: masked tails
    errs["linear_small_m"] = _rel(linear_small_m(x, w), linear_small_m_ref(x, w))
    from .quant_gemv import selfcheck as quant_selfcheck

    errs["quant_linear"] = quant_selfcheck(device, dtype, seed)  # FP8 (row / block scales) and int4 weights
    from .sample_kernel import draw, draw_ref

    # rows whose draw has one right answer (targets far from any CDF boundary): a greedy row, a biased greedy
    # row, and sampled rows of a few dominant tokens; a different token counts as 1.0
    V = 3 * 4096 + 5
    logits = (rnd(4, V) * 0.5).float()
    logits[:, V - 3], logits[:, 11] = 30.0, 29.0  # two tokens hold ~73% / ~27% of the mass at temperature 1
    inp = torch.tensor(
        [[1.0, 0.5, 1.0, 11.0, 2.0], [1.0, 0.5, 1.0, 5.0, 0.0], [1.0, 0.1, 0.0, 0.0, 0.0], [1.0, 0.9, 0.0, 0.0, 0.0]],
        device=device,
    )
    errs["sample_draw"] = float(not torch.equal(draw(logits.to(dtype), inp).cpu(), draw_ref(logits.to(dtype), inp)))
    return errs


TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def selfcheck(device_type: str) -> tuple[bool, str]:
    try:
        dtype = torch.bfloat16 if device_type == "cuda" else torch.float32
        errs = check_all(device_type, dtype)
    except Exception as exc:  # a kernel that fails to compile or launch
        return False, f"{type(exc).__name__}: {exc}"
    bad = {k: v for k, v in errs.items() if not v <= TOL[dtype]}
    return (not bad), (f"relative errors {bad}" if bad else "ok")
