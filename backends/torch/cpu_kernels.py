"""Compressed-KV decode attention on the CPU for the torch backend: glue to the numba kernels.

The kernels themselves (numpy + numba, shared with the MLX backend) live in
``swiftlm.turboquant.cpu_attention``: each task owns a span of rows of one KV head, expands codes
through small per-byte tables and keeps a running softmax (see that module).  Here: when a layer's
compressed rows go through them (``usable``), handing the cache's tensors over as numpy views
(``decode_attention``: the kernel, then its partials and the 16-bit rows merged in one call) and
compiling the server's default format at load (``warm_up``).  Without numba, or with
``SWIFTLM_NUMBA=0``, the torch path (``code_attention.code_blocks``) runs instead.
"""

from __future__ import annotations

import logging
import os
import threading

import numpy as np

from swiftlm.turboquant.cpu_affine import affine_encode
from swiftlm.turboquant.cpu_attention import (
    _FM,
    _LOCK,
    MIN_SPAN,
    TILE,
    _launch_threads,
    affine_kernel,
    enabled,
    merge_window,
    nb,
    parallel,
    rotate,
    splits,
    turbo_kernel,
    turbo_spans,
    use_threads,
)

# the kernels and their settings, re-exported (cpu_batch_attention, tests)
__all__ = [
    "MIN_SPAN",
    "TILE",
    "_FM",
    "_LOCK",
    "_launch_threads",
    "affine_kernel",
    "decode_attention",
    "enabled",
    "nb",
    "parallel",
    "splits",
    "start_pool",
    "turbo_kernel",
    "usable",
    "warm_up",
]

log = logging.getLogger(__name__)

# numba's thread pool: its OpenMP layer first.  With torch's CPU wheels its parallel loops then run on the threads of
# torch's own OpenMP pool (numba's layer binds to the libgomp torch loaded), so a kernel and the torch ops around it
# take turns on one set of threads.  The "workqueue" layer (numba's fallback, and earlier the default here) is a
# second pool: its threads wake through condition variables for every kernel while torch's idle threads still spin,
# and a decode step of a compressed cache took ~1.2x its OpenMP-layer time on 2 cores (SmolLM2, 4K context).  Numba's
# OpenMP layer sets the process's OpenMP thread count to its own (every core) when it starts: ``start_pool`` puts
# torch's count back and runs the kernels on as many threads (OMP_NUM_THREADS holds for both).
if nb is not None and not os.environ.get("NUMBA_THREADING_LAYER"):
    nb.config.THREADING_LAYER_PRIORITY = ["omp", "workqueue", "tbb"]

_POOL: list[int] = []


def start_pool() -> None:
    """Start numba's threading layer (once per process) and keep torch's thread count for torch and the kernels."""
    if nb is None or _POOL:
        return
    import torch

    with _LOCK:
        if _POOL:
            return
        n = torch.get_num_threads()
        nb.get_num_threads()  # starts the layer
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)
        use_threads(n)
        _POOL.append(n)


# ---------------------------------------------------------------------------------------- glue
def warm_up(a, fmt, cache_cls: type) -> threading.Thread | None:
    """Compile (or load from numba's disk cache) the kernel of this model shape and KV format on a
    background thread, so that the first request with the server's default format does not wait for it
    (a first compile takes seconds; a request that arrives meanwhile waits on the kernel lock).  ``cache_cls``:
    compressed_cache.CompressedCache, whose one-row cache the kernel runs on."""
    if not enabled():
        return None

    def run() -> None:
        import types

        import torch

        try:
            start_pool()
            one = types.SimpleNamespace(layers=1, kv_heads=a.kv_heads, heads=a.heads, head_dim=a.head_dim)
            c = cache_cls(one, fmt, torch.float32, torch.device("cpu"), dense_dtype=torch.float16)
            L, rows = c.layers[0], torch.ones(a.kv_heads, 1, a.head_dim)
            c._store(L, c.kc.encode(rows), c.vc.encode(rows), 0, 1)
            L.n_code = 1
            with torch.inference_mode():
                none = torch.zeros(a.kv_heads, 0, a.head_dim)
                decode_attention(c, L, torch.ones(a.kv_heads, a.heads // a.kv_heads, a.head_dim), 1.0, none, none)
                if fmt.kind == "affine":  # a decode step's compression (``encode_into``), with its argument types
                    from swiftlm.turboquant.presets import COMPRESS_BLOCK

                    row = torch.zeros(a.kv_heads, COMPRESS_BLOCK, a.head_dim, dtype=c.dense_dtype)[:, :1]
                    encode_into(c, L, row, row, 0)
        except Exception as e:  # pragma: no cover - the first request compiles it instead
            log.warning("numba kernel warm-up for %s failed: %s", fmt.name, e)

    t = threading.Thread(target=run, name="swiftlm-numba-warmup", daemon=True)
    t.start()
    return t


def usable(cache, L, M: int) -> bool:
    """Whether this layer's compressed rows go through a kernel here: CPU, numba present, a decode
    step or a short verify step (a long prefill chunk is matmul work: the torch path does it)."""
    return enabled() and L.n_code > 0 and cache.device.type == "cpu" and M <= 32 and cache.kc.d % 8 == 0


def decode_attention(cache, L, qg, scale: float, dk, dv):
    """One decode row's attention over layer ``L``'s compressed rows and its 16-bit rows dk / dv [KVH, nd, D]:
    qg [KVH, M, D] fp32 -> out [KVH, M, D] fp32, normalised, in natural coordinates.  The code kernel's per-task
    partials and the 16-bit rows are merged by one compiled call (``merge_window``) instead of a chain of small
    torch ops per layer."""
    import torch

    q = (qg * scale).contiguous().numpy()
    m_o, l_o, a_o = code_spans(cache, L, qg, scale, q)
    R = _rotation(cache.vc) if cache.fmt.kind == "turbo" else NO_ROTATION
    out = np.empty(qg.shape, np.float32)
    merge_window(m_o, l_o, a_o, q, _f32(dk), _f32(dv), R, out)
    return torch.from_numpy(out)


def _f32(t) -> np.ndarray:
    return np.ascontiguousarray(t.float().numpy())


NO_ROTATION = np.zeros((0, 0), np.float32)


def _rotation(codec) -> np.ndarray:
    r = getattr(codec, "_np_R", None)
    if r is None:
        r = codec._np_R = np.ascontiguousarray(codec.R.float().numpy())
    return r


def code_spans(cache, L, qg, scale: float, q: np.ndarray | None = None):
    """The code kernel over layer ``L``'s compressed rows for queries qg [KVH, M, D] (fp32): per-task partials
    (m, l [KVH, S, M], acc [KVH, S, M, D]) as numpy arrays, acc in the rotated domain for TurboQuant.  ``q``: the
    scaled queries as a C-contiguous numpy array, where the caller has them."""
    import torch

    start_pool()  # before the kernel is chosen: its thread count decides serial or parallel (``parallel``)
    KVH, M, D = qg.shape
    n = L.n_code
    if cache.fmt.kind == "turbo":
        kc, vc = cache.kc, cache.vc
        if q is None:
            q = (qg * scale).contiguous().numpy()
        qr = np.empty_like(q)
        rotate(q, _rotation(kc), qr)
        qjl = {}
        if kc.qjl:
            sq = ((qg @ kc.S.T) * scale).view(KVH, M, D // 8, 8)
            qjl = dict(
                st=torch.einsum("hmkt,bt->hkbm", sq, _sign_table(kc)).contiguous().numpy(),
                ks=L.ks.numpy(),
                kr=_norms(L.kr),
                qjl_scale=kc.qjl_scale,
            )
        m_o, l_o, a_o = turbo_spans(
            qr,
            n,
            kc.mse_bits,
            vc.mse_bits,
            _table(kc),
            _numpy(L.kp),
            _norms(L.kn),
            _table(vc),
            _numpy(L.vp),
            _norms(L.vn),
            **qjl,
        )
    else:
        kc = cache.kc
        S = splits(n, KVH)
        m_o = np.empty((KVH, S, M), np.float32)
        l_o = np.empty((KVH, S, M), np.float32)
        a_o = np.empty((KVH, S, M, D), np.float32)
        if q is None:
            q = (qg * scale).contiguous().numpy()
        kernel = affine_kernel(D, M, kc.bits, kc.group, parallel())
        # scales and biases: the cache's fp16 storage itself (uint16 bits, converted in the kernel), no fp32 copy
        args = (q, L.kp[0].numpy(), *_sides(L), L.vp[0].numpy(), *_sides(L, "v"), n, S, m_o, l_o, a_o)
        with _LOCK:
            _launch_threads()
            kernel(*args)
    return m_o, l_o, a_o


def _norms(t) -> np.ndarray:
    """A layer's norms [KVH, cap] as the TurboQuant kernel reads them, in place: fp16 storage as its uint16 bits."""
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.float16 else np.ascontiguousarray(a, np.float32)


def _sides(L, which: str = "k") -> tuple[np.ndarray, np.ndarray]:
    """A layer's affine scales and biases [KVH, cap, G] as the kernel reads them: fp16 storage as its uint16
    bits, fp32 as itself."""
    out = []
    for t in (L.kn, L.ks) if which == "k" else (L.vn, L.vb):
        a = t.numpy()
        out.append(a.view(np.uint16) if a.dtype == np.float16 else np.asarray(a, np.float32))
    return out[0], out[1]


def encode_into(cache, L, dk, dv, at: int) -> bool:
    """Affine (``kv_bits``) rows dk / dv [KVH, c, D] encoded straight into rows [at, at + c) of ``L``'s code
    storage by one compiled call each (``affine_encode``: the bytes of ``AffineCodec.encode``), instead of a
    chain of small torch ops per layer and decode step.  False (nothing written) where it does not apply: no
    numba, not the CPU, storage too short or of other dtypes; the caller encodes and stores them itself."""
    import torch

    if cache.fmt.kind != "affine" or L.kn is None or at + dk.shape[1] > L.kn.shape[1] or not enabled():
        return False
    views = L.np_codes
    if views is None or any(a is not b for a, b in zip(views[0], _code_tensors(L))):
        views = L.np_codes = (_code_tensors(L), _code_views(cache, L))
    arrays = views[1]
    if arrays is None or dk.dtype != dv.dtype or dk.dtype not in (torch.float16, torch.float32):
        return False
    kp, kn, ks, vp, vn, vb = arrays
    affine_encode(_rows(dk), kp, kn, ks, at, cache.kc.bits, cache.kc.group)
    affine_encode(_rows(dv), vp, vn, vb, at, cache.vc.bits, cache.vc.group)
    return True


def _code_tensors(L) -> tuple:
    return (L.kp[0], L.kn, L.ks, L.vp[0], L.vn, L.vb)


def _code_views(cache, L) -> tuple | None:
    """numpy views of an affine layer's storage for ``affine_encode`` (codes uint8, fp16 scales / biases as uint16
    bits), or None where ``encode_into`` does not apply (not the CPU, other dtypes)."""
    import torch

    kc, vc = cache.kc, cache.vc
    if cache.fmt.kind != "affine" or cache.device.type != "cpu" or kc.dtype != torch.float32 or vc.dtype != kc.dtype:
        return None
    if len(L.kp) != 1 or len(L.vp) != 1:
        return None
    ts = _code_tensors(L)
    if any(t.dtype != (torch.uint8 if i % 3 == 0 else torch.float16) for i, t in enumerate(ts)):
        return None
    return tuple(t.numpy() if i % 3 == 0 else t.numpy().view(np.uint16) for i, t in enumerate(ts))


def _rows(t) -> np.ndarray:
    """16-bit rows as ``affine_encode`` reads them: fp16 as uint16 bits, fp32 as itself."""
    a = t.numpy()
    return a.view(np.uint16) if a.dtype == np.float16 else a


def _numpy(planes) -> list[np.ndarray]:
    return [p.numpy() for p in planes]


def _table(codec) -> np.ndarray:
    t = getattr(codec, "_np_lut", None)
    if t is None:
        t = codec._np_lut = np.ascontiguousarray(codec.lut.float().numpy())
    return t


def _sign_table(codec):
    """[256, 8] ±1: bit t of byte b (QJL signs are packed little-end first, one bit per coordinate)."""
    import torch

    t = getattr(codec, "_signs", None)
    if t is None:
        b = torch.arange(256)[:, None]
        t = codec._signs = (((b >> torch.arange(8)) & 1) * 2 - 1).float()
    return t
