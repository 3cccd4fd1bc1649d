"""TurboQuant KV cache for the MLX backend (mlx-lm cache interface).

The same layout and rules as the torch cache (``backends/torch/compressed_cache.py``): positions
``[0, n_code)`` as packed codes + fp16 norms (+ QJL signs and residual norms), positions
``[n_code, offset)`` as 16-bit rows; after attending, rows beyond ``window`` are compressed in
blocks of at least COMPRESS_BLOCK once the sequence holds more than ``threshold`` positions.

mlx-lm's attention layers call ``cache.update_and_fetch`` and then
``scaled_dot_product_attention(q, k, v, cache=cache, ...)``; ``install_attention_hook`` wraps that
function in the loaded model's module so a ``TurboKVCache`` answers with ``cache.attend(q, scale)``:
the query is rotated once, scored against centroids looked up from the packed codes (never a 16-bit
copy of the history), values are summed in the rotated domain and rotated back once.  The fused
Metal kernel (``swiftlm.metal_kernels``) is used for single decode rows on a Metal device after it
has checked itself against this module's pure-MLX path.  When MLX runs on the CPU, single decode
rows go through the numba kernel shared with the torch backend (``swiftlm.turboquant.cpu_attention``,
reading the codes in place through numpy views) where numba is installed and ``SWIFTLM_NUMBA`` is
not "0"; prefill and verify chunks keep the pure-MLX path (matmul work).  The same hook sends a
``kv_bits`` cache's (mlx-lm ``QuantizedKVCache``) decode rows on the CPU to the numba kernel's affine
variant (``affine_cpu.py``).
"""

from __future__ import annotations

import logging
import math
import sys
from typing import Any

import mlx.core as mx
import numpy as np

from swiftlm.turboquant import TurboQuantMSE, TurboQuantProd
from swiftlm.turboquant.packing import PLANES
from swiftlm.turboquant.presets import COMPRESS_BLOCK, KVFormat, code_capacity, dense_capacity

log = logging.getLogger(__name__)


def pack(codes: mx.array, bits: int) -> list[mx.array]:
    codes = codes.astype(mx.uint32)
    d = codes.shape[-1]
    out, shift = [], 0
    for width in PLANES[bits]:
        per = 8 // width
        part = ((codes >> shift) & ((1 << width) - 1)).reshape(*codes.shape[:-1], d // per, per)
        weights = mx.array([1 << (j * width) for j in range(per)], dtype=mx.uint32)
        out.append((part * weights).sum(-1).astype(mx.uint8))
        shift += width
    return out


def byte_lut(values: np.ndarray, bits: int) -> mx.array:
    """Packed byte(s) -> code values; same tables as the torch backend's ``kv_quant.byte_lut``."""
    if bits == 3:
        lo = (np.arange(256)[:, None] >> (2 * np.arange(4))) & 3
        hi = (np.arange(16)[:, None] >> np.arange(4)) & 1
        codes = (lo[:, None, :] | (hi[None, :, :] << 2)).reshape(4096, 4)
    else:
        per = 8 // bits
        codes = (np.arange(256)[:, None] >> (bits * np.arange(per))) & ((1 << bits) - 1)
    return mx.array(values[codes].astype(np.float32))


def lut_decode(lut: mx.array, planes: list[mx.array], bits: int, d: int) -> mx.array:
    p0 = planes[0]
    if bits == 3:
        p1 = planes[1].astype(mx.uint32)
        nib = mx.stack([p1 & 15, p1 >> 4], axis=-1)
        idx = p0.astype(mx.uint32).reshape(*p0.shape[:-1], d // 8, 2) * 16 + nib
    else:
        idx = p0.astype(mx.uint32)
    return lut[idx.reshape(-1)].reshape(*p0.shape[:-1], d)


class Codec:
    def __init__(self, d: int, bits: int, seed: int, qjl: bool = False):
        self.d, self.bits, self.qjl = d, bits, qjl
        self.mse_bits = bits - 1 if qjl else bits
        ref = TurboQuantProd(d, bits, seed) if qjl else TurboQuantMSE(d, bits, seed)
        mse = ref.mse if qjl else ref
        self.R = mx.array(mse.rotation.matrix.astype(np.float32))
        self.RT = mx.array(mse.rotation.matrix.T.astype(np.float32))
        self.centroids = mx.array(mse.codebook.centroids.astype(np.float32))
        self.boundaries = mx.array(mse.codebook.boundaries.astype(np.float32))
        self.S = mx.array(ref.S.astype(np.float32)) if qjl else None
        self.qjl_scale = math.sqrt(math.pi / 2) / d
        self.lut = byte_lut(mse.codebook.centroids, self.mse_bits)

    def encode(self, x: mx.array) -> dict[str, Any]:
        x = x.astype(mx.float32)
        norms = mx.sqrt((x * x).sum(-1))
        u = x / mx.where(norms > 0, norms, 1.0)[..., None]
        y = u @ self.RT
        codes = (y[..., None] > self.boundaries).sum(-1)  # = searchsorted(boundaries, y), side left
        out = {"planes": pack(codes, self.mse_bits), "norms": norms.astype(mx.float16)}
        if self.qjl:
            r = u - self.centroids[codes] @ self.R
            out["signs"] = pack((r @ self.S.T >= 0).astype(mx.uint32), 1)[0]
            out["rnorms"] = mx.sqrt((r * r).sum(-1)).astype(mx.float16)
        return out

    def unit(self, planes: list[mx.array]) -> mx.array:
        return lut_decode(self.lut, planes, self.mse_bits, self.d)

    def signs(self, packed: mx.array) -> mx.array:
        sh = mx.arange(8, dtype=mx.uint32)
        bits = (packed.astype(mx.uint32)[..., None] >> sh) & 1
        return bits.reshape(*packed.shape[:-1], self.d).astype(mx.float32) * 2 - 1


class TurboKVCache:
    """One layer's cache for one sequence (mlx-lm interface: offset, update_and_fetch, trim, state)."""

    def __init__(self, fmt: KVFormat, compressed: bool, kc: Codec, vc: Codec):
        self.fmt, self.compressed, self.kc, self.vc = fmt, compressed, kc, vc
        self.offset = 0
        self.n_code = self.n_dense = 0
        self.dk = self.dv = None
        self.codes: dict[str, Any] = {}
        self._step_T = 0

    # ---------------------------------------------------------------- mlx-lm interface
    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        B, KVH, T, D = keys.shape
        if B != 1:
            raise ValueError("TurboKVCache holds one sequence")
        need = self.n_dense + T
        if self.dk is None or need > self.dk.shape[2]:
            cap = dense_capacity(self.fmt, need)
            dk = mx.zeros((1, KVH, cap, D), dtype=keys.dtype)
            dv = mx.zeros((1, KVH, cap, D), dtype=values.dtype)
            if self.n_dense:
                dk[..., : self.n_dense, :] = self.dk[..., : self.n_dense, :]
                dv[..., : self.n_dense, :] = self.dv[..., : self.n_dense, :]
            self.dk, self.dv = dk, dv
        self.dk[..., self.n_dense : need, :] = keys
        self.dv[..., self.n_dense : need, :] = values
        self.n_dense = need
        self.offset += T
        self._step_T = T
        return keys, values

    def attend(self, queries: mx.array, scale: float) -> mx.array:
        """queries [1, H, T, D] (rope applied) -> [1, H, T, D]; then compress what left the window."""
        out = attention(self, queries, scale)
        self._compress()
        return out

    def make_mask(self, *args: Any, **kwargs: Any) -> None:
        return None  # attend() applies causality from the positions it holds

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        if self.offset >= self.n_code:
            self.n_dense = self.offset - self.n_code
        else:
            self.n_code, self.n_dense = self.offset, 0
        return n

    def empty(self) -> bool:
        return self.offset == 0

    def size(self) -> int:
        return self.offset

    @property
    def state(self) -> list[mx.array]:
        arrs = [a for a in (self.dk, self.dv) if a is not None]
        for v in self.codes.values():
            arrs.extend(v if isinstance(v, list) else [v])
        return arrs

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.state)

    # ---------------------------------------------------------------- compression
    def _compress(self) -> None:
        if not self.compressed or self.offset <= self.fmt.threshold:
            return
        if self.n_dense < self.fmt.window + COMPRESS_BLOCK:
            return
        c = self.n_dense - self.fmt.window
        k = self.kc.encode(self.dk[0, :, :c, :])
        v = self.vc.encode(self.dv[0, :, :c, :])
        at, end = self.n_code, self.n_code + c
        new = {"kp": k["planes"], "kn": k["norms"], "vp": v["planes"], "vn": v["norms"]}
        if self.kc.qjl:
            new["ks"], new["kr"] = k["signs"], k["rnorms"]
        have = self.codes["kn"].shape[1] if self.codes else 0
        if end > have:
            cap = code_capacity(end)

            def grow(old: mx.array | None, x: mx.array) -> mx.array:
                t = mx.zeros((x.shape[0], cap, *x.shape[2:]), dtype=x.dtype)
                if old is not None and at:
                    t[:, :at] = old[:, :at]
                return t

            for name, x in new.items():
                old = self.codes.get(name)
                if isinstance(x, list):
                    self.codes[name] = [grow(o, p) for o, p in zip(old or [None] * len(x), x)]
                else:
                    self.codes[name] = grow(old, x)
        for name, x in new.items():
            if isinstance(x, list):
                for dst, src in zip(self.codes[name], x):
                    dst[:, at:end] = src
            else:
                self.codes[name][:, at:end] = x
        rest_k = self.dk[..., c : self.n_dense, :]
        rest_v = self.dv[..., c : self.n_dense, :]
        self.n_code, self.n_dense = end, self.n_dense - c
        cap = dense_capacity(self.fmt, self.n_dense)
        if cap < self.dk.shape[2]:
            self.dk = mx.zeros((*self.dk.shape[:2], cap, self.dk.shape[3]), dtype=self.dk.dtype)
            self.dv = mx.zeros_like(self.dk)
        self.dk[..., : self.n_dense, :] = rest_k
        self.dv[..., : self.n_dense, :] = rest_v


def attention(cache: TurboKVCache, queries: mx.array, scale: float) -> mx.array:
    """Compressed rows through ``swiftlm.metal_kernels.turboquant.partials`` (the Metal kernel for a
    single decode row where it checked out, else block-wise pure MLX), merged with the 16-bit rows
    (exact, causal within this step's rows); the rotated-domain value sum is rotated back once."""
    from swiftlm.metal_kernels.turboquant import partials

    _, H, T, D = queries.shape
    KVH = cache.dk.shape[1]
    rep = H // KVH
    start = cache.offset - T
    qg = queries.astype(mx.float32).reshape(KVH, rep * T, D)
    nd = cache.n_dense
    keys = cache.dk[0, :, :nd, :].astype(mx.float32)
    vals = cache.dv[0, :, :nd, :].astype(mx.float32)
    s = (qg @ keys.transpose(0, 2, 1)) * scale
    if T > 1:
        pos_q = mx.tile(mx.arange(start, start + T), (rep,))
        pos_k = mx.arange(cache.n_code, cache.n_code + nd)
        s = mx.where(pos_k[None, :] <= pos_q[:, None], s, -mx.inf)
    m = s.max(-1, keepdims=True)
    if cache.n_code:
        if T == 1 and cpu_kernel_usable(cache, rep):
            mc, lc, accc = cpu_partials(cache, qg, scale)
        else:
            q_rot = (qg @ cache.kc.RT) * scale  # the query, rotated once
            sq = (qg @ cache.kc.S.T) * scale if cache.kc.qjl else None
            mc, lc, accc = partials(q_rot, cache.codes, cache.n_code, cache.kc, cache.vc, sq, rows=T)
        M = mx.maximum(m, mc)
        p = mx.exp(s - M)
        ac = mx.exp(mc - M)
        out = p @ vals + (accc * ac) @ cache.vc.R  # rotated-domain sum, rotated back once
        out = out / (p.sum(-1, keepdims=True) + lc * ac)
    else:
        p = mx.exp(s - m)
        out = (p @ vals) / p.sum(-1, keepdims=True)
    return out.reshape(1, H, T, D).astype(queries.dtype)


def cpu_kernel_usable(cache: TurboKVCache, M: int) -> bool:
    """Compressed rows through the numba kernel: MLX on the CPU device, numba present and not
    switched off (``SWIFTLM_NUMBA=0``), M <= 32 query rows per KV head, head dim a multiple of 8."""
    from swiftlm.turboquant import cpu_attention

    return cpu_attention.enabled() and M <= 32 and cache.kc.d % 8 == 0 and mx.default_device().type == mx.DeviceType.cpu


def _np(a: mx.array) -> np.ndarray:
    """An evaluated MLX array as numpy: a view of its buffer (MLX arrays on the CPU export it through
    the buffer protocol, no copy), copied only where it is not C-contiguous."""
    x = np.asarray(a)
    return x if x.flags.c_contiguous else np.ascontiguousarray(x)


def _np_table(codec: Codec) -> np.ndarray:
    t = getattr(codec, "_np_lut", None)
    if t is None:
        t = codec._np_lut = np.ascontiguousarray(np.array(codec.lut, dtype=np.float32))
    return t


def cpu_partials(cache: TurboKVCache, qg: mx.array, scale: float) -> tuple[mx.array, mx.array, mx.array]:
    """``partials`` for qg [KVH, M, D] (fp32, unscaled) through the numba kernel: the same
    (m, l, acc) contract, acc in the value rotation's domain."""
    from swiftlm.turboquant import cpu_attention

    kc, vc, c, n = cache.kc, cache.vc, cache.codes, cache.n_code
    q_rot = (qg @ kc.RT) * scale
    kn = c["kn"][:, :n].astype(mx.float32)
    vn = c["vn"][:, :n].astype(mx.float32)
    arrs = [q_rot, kn, vn, *c["kp"], *c["vp"]]
    if kc.qjl:
        sq = (qg @ kc.S.T) * scale
        kr = c["kr"][:, :n].astype(mx.float32)
        arrs += [sq, kr, c["ks"]]
    mx.eval(arrs)  # the codes written by the last compression, the query: computed before they are read
    qjl = {}
    if kc.qjl:
        qjl = dict(st=cpu_attention.qjl_table(_np(sq)), ks=_np(c["ks"]), kr=_np(kr), qjl_scale=kc.qjl_scale)
    spans = cpu_attention.turbo_spans(
        _np(q_rot),
        n,
        kc.mse_bits,
        vc.mse_bits,
        _np_table(kc),
        [_np(p) for p in c["kp"]],
        _np(kn),
        _np_table(vc),
        [_np(p) for p in c["vp"]],
        _np(vn),
        **qjl,
    )
    return tuple(mx.array(x) for x in cpu_attention.merge_spans(*spans))


def make_turbo_cache(module: Any, fmt: KVFormat, head_dim: int) -> list[TurboKVCache]:
    n = len(module.layers)
    kc = Codec(head_dim, fmt.key_code_bits, fmt.seed * 2 + 1, qjl=fmt.key_qjl)
    vc = Codec(head_dim, fmt.value_bits, fmt.seed * 2 + 2)
    args = getattr(module, "args", None)
    heads = getattr(args, "num_attention_heads", None)
    kv_heads = getattr(args, "num_key_value_heads", None) or heads
    on_cpu = mx.default_device().type == mx.DeviceType.cpu
    if on_cpu and isinstance(heads, int) and isinstance(kv_heads, int) and kv_heads:
        from swiftlm.turboquant import cpu_attention

        # compile the decode kernel of this shape in the background (see cpu_partials)
        cpu_attention.warm_up_turbo(head_dim, heads // kv_heads, kc.mse_bits, vc.mse_bits, kc.qjl)
    return [TurboKVCache(fmt, fmt.layer_compressed(i, n), kc, vc) for i in range(n)]


def install_attention_hook(module: Any) -> None:
    """Wrap ``scaled_dot_product_attention`` in the model's mlx-lm module(s) so a TurboKVCache
    attends over its own layout and a ``kv_bits`` QuantizedKVCache's decode rows on the CPU go through
    the numba kernel (``affine_cpu``); other calls go to the original function unchanged."""
    from . import affine_cpu

    if getattr(module, "_swiftlm_hooked", False):  # called for every new cache: walk the modules once
        return
    module._swiftlm_hooked = True
    names = {type(module).__module__}
    for sub in module.modules() if hasattr(module, "modules") else []:
        names.add(type(sub).__module__)
    for name in names:
        mod = sys.modules.get(name)
        f = getattr(mod, "scaled_dot_product_attention", None)
        if f is None or getattr(f, "_swiftlm_turbo", False):
            continue

        def hooked(queries, keys, values, cache, scale, mask, *a, _orig=f, **kw):
            if isinstance(cache, TurboKVCache):
                return cache.attend(queries, scale)
            if affine_cpu.routes(cache, queries, mask, a[0] if a else kw.get("sinks")):
                return affine_cpu.attend(cache, queries, scale)
            return _orig(queries, keys, values, cache, scale, mask, *a, **kw)

        hooked._swiftlm_turbo = True
        mod.scaled_dot_product_attention = hooked
