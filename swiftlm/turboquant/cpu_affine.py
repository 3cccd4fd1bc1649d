"""The ``kv_bits`` (affine) pieces of the CPU kernels that are not attention: fp16 <-> fp32 conversions for numba
(which has no float16 type on the CPU; the torch cache holds affine scales and biases as fp16, handed over as their
uint16 bit patterns) and ``affine_encode``, which compresses a decode step's rows straight into a cache's storage.
``cpu_attention.affine_kernel`` reads scales and biases through ``_f32``.
"""

from __future__ import annotations

import numpy as np

try:  # optional (the torch extra installs it)
    import numba as nb
except ImportError:  # pragma: no cover - exercised where numba is absent
    nb = None

_f32 = _f16_bits = None


def _half_intrinsics():
    """IEEE fp16 <-> fp32 conversions for numba (which has no float16 type on the CPU): the torch cache holds
    affine scales and biases as fp16, handed over as their uint16 bit patterns.  ``_f32`` reads one: uint16 bits
    -> fp32 (LLVM's fpext, exact), fp32 -> itself; ``_f16_bits``: fp32 -> the uint16 bits of its fp16 rounding
    (LLVM's fptrunc: round to nearest even, as torch's and numpy's casts)."""
    global _f32, _f16_bits
    from llvmlite import ir
    from numba import types
    from numba.extending import intrinsic

    @intrinsic
    def _f32(typingctx, x):
        if x == types.uint16:

            def codegen(context, builder, signature, args):
                return builder.fpext(builder.bitcast(args[0], ir.HalfType()), ir.FloatType())

            return types.float32(x), codegen
        if x == types.float32:
            return types.float32(x), lambda context, builder, signature, args: args[0]
        return None

    @intrinsic
    def _f16_bits(typingctx, x):
        if x != types.float32:
            return None

        def codegen(context, builder, signature, args):
            return builder.bitcast(builder.fptrunc(args[0], ir.HalfType()), ir.IntType(16))

        return types.uint16(x), codegen


if nb is not None:
    _half_intrinsics()


def _affine_encode(x, kp, scale, bias, at, bits, group):
    """Affine-quantize rows x [KVH, c, D] (fp32, or fp16 as uint16 bits) into rows [at, at + c) of a cache's
    storage: codes kp [KVH, cap, D*bits/8] uint8, scale / bias [KVH, cap, D/group] fp16 as uint16 bits.  The
    arithmetic of ``backends/torch/kv_quant.AffineCodec.encode`` (fp32, IEEE: compiled without fastmath), so the
    bytes are the same: per group lo = min, scale = (max - lo) / (2^bits - 1) (1 where max == lo), both rounded to
    fp16; code = round-half-even((x - lo) / scale) clamped to [0, 2^bits - 1]."""
    KVH, c, D = x.shape
    top = np.float32(2**bits - 1)
    codes = np.empty(D, np.uint8)
    for h in range(KVH):
        for i in range(c):
            j = at + i
            for g in range(D // group):
                lo = _f32(x[h, i, g * group])
                hi = lo
                for d in range(g * group + 1, (g + 1) * group):
                    v = _f32(x[h, i, d])
                    lo = min(lo, v)
                    hi = max(hi, v)
                sb = _f16_bits((hi - lo) / top) if hi > lo else _f16_bits(np.float32(1.0))
                bb = _f16_bits(lo)
                scale[h, j, g] = sb
                bias[h, j, g] = bb
                sf, bf = _f32(sb), _f32(bb)
                for d in range(g * group, (g + 1) * group):
                    r = np.rint((_f32(x[h, i, d]) - bf) / sf)
                    codes[d] = np.uint8(min(max(r, np.float32(0.0)), top)) if r == r else np.uint8(0)
            if bits == 8:
                for d in range(D):
                    kp[h, j, d] = codes[d]
            else:
                for k in range(D // 2):
                    kp[h, j, k] = codes[2 * k] | (codes[2 * k + 1] << 4)


affine_encode = nb.njit(nogil=True, cache=True, error_model="numpy")(_affine_encode) if nb is not None else None
