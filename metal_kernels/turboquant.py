"""Decode attention over TurboQuant-packed keys and values: a Metal kernel and its MLX reference.

Contract (both): for the compressed rows ``[0, n)`` of one sequence's layer, with queries already
rotated and scaled (``q_rot`` [KVH, M, D], M = query heads per KV head x rows), return the online-
softmax partials ``m`` [KVH, M, 1] (max score), ``l`` [KVH, M, 1] (Σ exp(s - m)) and ``acc``
[KVH, M, D] (Σ exp(s - m) ‖v‖ c[v], still in the value rotation's domain).  The caller merges them
with the 16-bit window and rotates ``acc`` back once.

The kernel: one 32-thread simdgroup per query head; each lane walks rows lane, lane + 32, ...,
unpacking key codes from the bit planes (``swiftlm.turboquant.packing``), scoring against centroids
times the fp16 norm, and keeping its own running max / sum / accumulator; the lanes are merged with
``simd_max`` / ``simd_sum``.  QJL keys use the reference (the estimator needs the sketch matrix).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import mlx.core as mx
import numpy as np

log = logging.getLogger(__name__)

BLOCK = 2048

HEADER = """
template <int W0, int W1>
inline uint tq_code(const device uint8_t* p0, const device uint8_t* p1, uint row, uint d, uint D) {
    constexpr uint per0 = 8 / W0;
    uint rb0 = D * W0 / 8;
    uint c = (uint(p0[row * rb0 + d / per0]) >> ((d % per0) * W0)) & ((1u << W0) - 1u);
    if (W1 > 0) {
        constexpr uint per1 = W1 > 0 ? 8 / W1 : 1;
        uint rb1 = D * W1 / 8;
        c |= ((uint(p1[row * rb1 + d / per1]) >> ((d % per1) * W1)) & ((1u << W1) - 1u)) << W0;
    }
    return c;
}
"""

SOURCE = """
    uint h = threadgroup_position_in_grid.x;      // query head
    uint lane = thread_index_in_simdgroup;
    uint g = h / REP;                              // its KV head
    uint N = n_rows[0];
    uint cap = kn_shape[1];
    float q[D];
    for (uint d = 0; d < D; d++) q[d] = q_rot[h * D + d];
    float m = -INFINITY, l = 0.0f;
    float acc[D];
    for (uint d = 0; d < D; d++) acc[d] = 0.0f;
    for (uint n = lane; n < N; n += 32) {
        uint row = g * cap + n;
        float s = 0.0f;
        for (uint d = 0; d < D; d++) s += q[d] * kc[tq_code<KW0, KW1>(kp0, kp1, row, d, D)];
        s *= float(kn[row]);
        float m_new = metal::max(m, s);
        float alpha = metal::exp(m - m_new);
        float p = metal::exp(s - m_new);
        l = l * alpha + p;
        float pv = p * float(vn[row]);
        for (uint d = 0; d < D; d++) acc[d] = acc[d] * alpha + pv * vc[tq_code<VW0, VW1>(vp0, vp1, row, d, D)];
        m = m_new;
    }
    float M = simd_max(m);
    float sc = (m == -INFINITY) ? 0.0f : metal::exp(m - M);
    float L = simd_sum(l * sc);
    for (uint d = 0; d < D; d++) {
        float a = simd_sum(acc[d] * sc);
        if (lane == 0) out_acc[h * D + d] = a;
    }
    if (lane == 0) { out_m[h] = M; out_l[h] = L; }
"""

_PLANES = {1: (1, 0), 2: (2, 0), 3: (2, 1), 4: (4, 0)}
_KERNEL: Any = None
_STATE: dict[str, bool] = {}


def partials_ref(
    q_rot: mx.array, codes: dict[str, Any], n: int, kc: Any, vc: Any, sq: mx.array | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """Pure MLX, block by block (never more than BLOCK decoded rows at a time)."""
    m = l = acc = None
    for s0 in range(0, n, BLOCK):
        e = min(n, s0 + BLOCK)
        s = q_rot @ kc.unit([p[:, s0:e] for p in codes["kp"]]).transpose(0, 2, 1)
        if sq is not None:
            qj = sq @ kc.signs(codes["ks"][:, s0:e]).transpose(0, 2, 1)
            s = s + qj * (codes["kr"][:, s0:e].astype(mx.float32) * kc.qjl_scale)[:, None, :]
        s = s * codes["kn"][:, s0:e].astype(mx.float32)[:, None, :]
        vu = vc.unit([p[:, s0:e] for p in codes["vp"]]) * codes["vn"][:, s0:e].astype(mx.float32)[..., None]
        bm = s.max(-1, keepdims=True)
        m_new = bm if m is None else mx.maximum(m, bm)
        p = mx.exp(s - m_new)
        if m is None:
            l, acc = p.sum(-1, keepdims=True), p @ vu
        else:
            alpha = mx.exp(m - m_new)
            l = l * alpha + p.sum(-1, keepdims=True)
            acc = acc * alpha + p @ vu
        m = m_new
    return m, l, acc


def _kernel() -> Any:
    global _KERNEL
    if _KERNEL is None:
        _KERNEL = mx.fast.metal_kernel(
            name="swiftlm_tq_decode_attention",
            input_names=["q_rot", "kp0", "kp1", "kn", "kc", "vp0", "vp1", "vn", "vc", "n_rows"],
            output_names=["out_m", "out_l", "out_acc"],
            source=SOURCE,
            header=HEADER,
        )
    return _KERNEL


def partials_metal(
    q_rot: mx.array, codes: dict[str, Any], n: int, kc: Any, vc: Any, sq: mx.array | None = None
) -> tuple[mx.array, mx.array, mx.array]:
    """The fused kernel (single query row per head: M == heads per KV head)."""
    if sq is not None:
        raise ValueError("the Metal kernel does not implement QJL keys")
    KVH, M, D = q_rot.shape
    H = KVH * M
    kw0, kw1 = _PLANES[kc.mse_bits]
    vw0, vw1 = _PLANES[vc.mse_bits]
    kp, vp = codes["kp"], codes["vp"]
    m, l, acc = _kernel()(
        inputs=[
            q_rot.reshape(H, D).astype(mx.float32),
            kp[0],
            kp[1] if kw1 else kp[0],
            codes["kn"],
            kc.centroids,
            vp[0],
            vp[1] if vw1 else vp[0],
            codes["vn"],
            vc.centroids,
            mx.array([n], dtype=mx.uint32),
        ],
        template=[("D", D), ("REP", M), ("KW0", kw0), ("KW1", kw1), ("VW0", vw0), ("VW1", vw1)],
        grid=(H * 32, 1, 1),
        threadgroup=(32, 1, 1),
        output_shapes=[(H,), (H,), (H, D)],
        output_dtypes=[mx.float32, mx.float32, mx.float32],
    )
    return m.reshape(KVH, M, 1), l.reshape(KVH, M, 1), acc.reshape(KVH, M, D)


def metal_available() -> bool:
    try:
        return bool(mx.metal.is_available())
    except Exception:
        return False


def selfcheck(kernel: Callable[..., tuple] = partials_metal) -> bool:
    """Run ``kernel`` and the reference on random packed data (4-bit keys / 3-bit values, GQA,
    a row count that is not a multiple of 32); True if they agree to fp32 accumulation error."""
    from swiftlm.backends.mlx.turbo_cache import Codec

    rng = np.random.default_rng(0)
    kvh, rep, d, n = 2, 3, 64, 173
    kc, vc = Codec(d, 4, 1), Codec(d, 3, 2)
    k = kc.encode(mx.array(rng.standard_normal((kvh, n, d)).astype(np.float32)))
    v = vc.encode(mx.array(rng.standard_normal((kvh, n, d)).astype(np.float32)))
    codes = {"kp": k["planes"], "kn": k["norms"], "vp": v["planes"], "vn": v["norms"]}
    q = mx.array(rng.standard_normal((kvh, rep, d)).astype(np.float32) * 0.125)
    try:
        got = kernel(q, codes, n, kc, vc)
        mx.eval(got)
    except Exception as exc:  # noqa: BLE001 - any failure to build or run means: use the reference
        log.warning("TurboQuant Metal kernel failed to run (%s); using the pure-MLX attention", exc)
        return False
    want = partials_ref(q, codes, n, kc, vc)
    for a, b, name in zip(got, want, ("max", "sum", "acc")):
        if a.shape != b.shape or not mx.allclose(a, b, rtol=1e-4, atol=1e-4).item():
            log.warning("TurboQuant Metal kernel disagrees with the pure-MLX reference (%s); using the reference", name)
            return False
    return True


def use_kernel() -> bool:
    """Use the Metal kernel?  Only on a Metal device, after the self-check passed (once per process)."""
    if "ok" not in _STATE:
        _STATE["ok"] = metal_available() and selfcheck()
    return _STATE["ok"]


def partials(
    q_rot: mx.array, codes: dict[str, Any], n: int, kc: Any, vc: Any, sq: mx.array | None = None, rows: int = 1
) -> tuple[mx.array, mx.array, mx.array]:
    """Kernel for single decode rows without QJL where it checked out; the reference otherwise."""
    if rows == 1 and sq is None and use_kernel():
        return partials_metal(q_rot, codes, n, kc, vc)
    return partials_ref(q_rot, codes, n, kc, vc, sq)
