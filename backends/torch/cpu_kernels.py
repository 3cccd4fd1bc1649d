"""Compressed-KV decode attention on the CPU for the torch backend: glue to the numba kernels.

The kernels themselves (numpy + numba, shared with the MLX backend) live in
``swiftlm.turboquant.cpu_attention``: each task owns a span of rows of one KV head, expands codes
through small per-byte tables and keeps a running softmax (see that module).  Here: when a layer's
compressed rows go through them (``usable``), handing each cache's storage over by address (``code_rows``: the
code kernel of the format, TurboQuant or affine ``kv_bits``, over the tasks of one or several caches, then their
partials and 16-bit rows merged in one call; ``decode_attention``: one cache's row; cpu_code_batch.py: the rows of
a decode step), compressing a ``kv_bits`` decode row straight into the codes (``encode_into``) and compiling the
server's default format at load (``warm_up``).  Without numba, or with ``SWIFTLM_NUMBA=0``, the torch path
(``code_attention.code_blocks``) runs instead.
"""

from __future__ import annotations

import functools
import logging
import os
import threading

import numpy as np

from swiftlm.turboquant.cpu_affine import affine_encode
from swiftlm.turboquant.cpu_attention import (
    _FM,
    _LOCK,
    MIN_SPAN,
    NORM_TYPES,
    TILE,
    _launch_threads,
    affine_batch,
    affine_kernel,
    enabled,
    nb,
    parallel,
    splits,
    threads,
    turbo_batch,
    turbo_kernel,
    turbo_tasks,
    use_threads,
)
from swiftlm.turboquant.cpu_merge import merge_kernel, rotate

# the kernels and their settings, re-exported (cpu_batch_attention, tests)
__all__ = [
    "MIN_SPAN",
    "TILE",
    "_FM",
    "_LOCK",
    "_launch_threads",
    "affine_kernel",
    "code_rows",
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
                none = torch.zeros(a.kv_heads, 0, a.head_dim, dtype=c.dense_dtype)  # the merge's row type
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
    qg [KVH, M, D] fp32 -> out [KVH, M, D] fp32, normalised, in natural coordinates: ``code_rows`` with this one
    row (the batched decode step's path, cpu_code_batch.py)."""
    return code_rows([(cache, L, dk, dv)], qg[None], scale)[0]


NO_ROTATION = np.zeros((0, 0), np.float32)


def _rotation(codec) -> np.ndarray:
    r = getattr(codec, "_np_R", None)
    if r is None:
        r = codec._np_R = np.ascontiguousarray(codec.R.float().numpy())
    return r


def _rotation_t(codec) -> np.ndarray:
    """R^T, C-contiguous (the merge reads its rows)."""
    r = getattr(codec, "_np_RT", None)
    if r is None:
        r = codec._np_RT = np.ascontiguousarray(_rotation(codec).T)
    return r


def code_rows(rows, qg, scale: float):
    """Decode rows of B caches of one compressed format (TurboQuant or affine ``kv_bits``), each over its layer's
    compressed rows and 16-bit rows, in two compiled calls: the code kernel over every (sequence, KV head, span)
    task (each cache's storage read where it lies, by address), then the merge with each cache's 16-bit rows.
    rows: [(cache, L, dk, dv)] (L a layer holding codes, dk / dv [KVH, nd, D] its 16-bit rows); qg [B, KVH, M, D]
    fp32 queries.  Returns out [B, KVH, M, D] fp32, normalised, in natural coordinates.  A row's result does not
    depend on the others: each task and each merge reads its own sequence only."""
    import torch

    start_pool()  # before the kernel is chosen: its thread count decides serial or parallel (``parallel``)
    B, KVH, M, D = qg.shape
    c0 = rows[0][0]
    q = (qg * scale).contiguous().numpy()
    dtype = rows[0][2].dtype
    if dtype not in (torch.float16, torch.float32) or any(r[2].dtype != dtype for r in rows):
        rows, dtype = [(c, L, dk.float(), dv.float()) for c, L, dk, dv in rows], torch.float32
    keep: list = []  # copies made for the kernels, alive until they return
    tasks, first, per = _tasks(tuple(L.n_code for _, L, _, _ in rows), KVH, threads())
    if c0.fmt.kind == "turbo":
        m_o, l_o, a_o = _turbo_partials(rows, qg, q, scale, tasks, keep)
        RT = _rotation_t(c0.vc)
    else:  # affine: values in natural coordinates
        seqs = np.array([_affine_seq_row(c, L, keep) for c, L, _, _ in rows], np.int64)
        m_o, l_o, a_o = affine_batch(q, tasks, seqs, _side_type(rows), c0.kc.bits, c0.kc.group)
        RT = NO_ROTATION
    dense = np.array([_dense_row(dk, dv, keep) for _, _, dk, dv in rows], np.int64)
    nd = np.array([r[2].shape[1] for r in rows], np.int64)
    out = np.empty((B, KVH, M, D), np.float32)
    kernel = merge_kernel(parallel())
    dt = _HALF if dtype == torch.float16 else _FLOAT
    with _LOCK:
        _launch_threads()
        kernel(m_o, l_o, a_o, first, per, q, dense, nd, dt, RT, out)
    return torch.from_numpy(out)


def _turbo_partials(rows, qg, q: np.ndarray, scale: float, tasks: np.ndarray, keep: list):
    """The TurboQuant code kernel's per-task partials of ``code_rows``: queries rotated into the keys' domain."""
    import torch

    B, KVH, M, D = qg.shape
    kc, vc = rows[0][0].kc, rows[0][0].vc
    qr = np.empty_like(q)
    rotate(q.reshape(B * KVH, M, D), _rotation(kc), qr.reshape(B * KVH, M, D))
    # QJL keys: each row's table as one row alone computes it
    st = np.stack([_qjl_table(kc, qg[b], scale) for b in range(B)]) if kc.qjl else None
    seqs = np.array([_seq_row(kc.qjl, L, keep) for _, L, _, _ in rows], np.int64)
    nt = NORM_TYPES[np.dtype(np.uint16 if rows[0][1].kn.dtype == torch.float16 else np.float32)]
    return turbo_batch(qr, tasks, seqs, nt, kc.mse_bits, vc.mse_bits, _table(kc), _table(vc), st, kc.qjl_scale)


@functools.lru_cache(maxsize=256)
def _tasks(ns: tuple, kv_heads: int, n_threads: int) -> tuple:
    """``turbo_tasks``, made once per row lengths (the layers of a step share them; never written)."""
    return turbo_tasks(ns, kv_heads)


_HALF, _FLOAT = np.zeros(1, np.uint16), np.zeros(1, np.float32)  # ``merge_kernel``'s witnesses of fp16 / fp32 rows


def _seq_row(qjl: bool, L, keep: list) -> list[int]:
    """Layer ``L``'s code storage as a row of the kernel's sequence table (``SEQ_FIELDS``: addresses, then rows;
    0 for what the format lacks).  Norms fp16 (read as their bits) or fp32, one type for all.  Kept on the layer
    (``np_codes``) until its storage is reallocated (``CompressedCache._alloc_codes`` replaces every tensor)."""
    held = L.np_codes
    if held is not None and held[0] is L.kn and held[1] is L.vn:
        return held[2]
    kp, vp = L.kp, L.vp
    arrays = [kp[0], kp[1] if len(kp) > 1 else None, L.kn, L.ks if qjl else None, L.kr if qjl else None]
    arrays += [vp[0], vp[1] if len(vp) > 1 else None, L.vn]
    if len({t.dtype for t in (L.kn, L.vn, L.kr if qjl else L.kn)}) > 1:
        raise ValueError("TurboQuant norms of several types")
    copies = len(keep)
    arrays = [None if t is None else _contiguous(t, keep) for t in arrays]
    row = [0 if t is None else t.data_ptr() for t in arrays] + [0 if t is None else t.shape[1] for t in arrays]
    if len(keep) == copies:  # the storage itself, not copies
        L.np_codes = (L.kn, L.vn, row)
    return row


def _dense_row(dk, dv, keep: list) -> list[int]:
    """16-bit rows [KVH, nd, D] as a row of the merge's table: both tensors' addresses, then their rows (the
    capacity of the buffer whose first nd rows they are; a view of another layout is copied first)."""
    out = []
    for t in (dk, dv):
        s0, s1, s2 = t.stride()
        _, n, D = t.shape
        if s2 != 1 or s1 != D or s0 % D or s0 < n * D:
            t = _contiguous(t, keep)
            s0 = t.stride(0)
        out.append((t.data_ptr(), s0 // D if t.shape[0] > 1 else n))
    return [out[0][0], out[1][0], out[0][1], out[1][1]]


def _contiguous(t, keep: list):
    if not t.is_contiguous():
        t = t.contiguous()
        keep.append(t)
    return t


def _qjl_table(kc, qg, scale: float) -> np.ndarray:
    """QJL keys: the kernel's per-byte table [KVH, D/8, 256, M] of one row's queries qg [KVH, M, D]."""
    import torch

    KVH, M, D = qg.shape
    sq = ((qg @ kc.S.T) * scale).view(KVH, M, D // 8, 8)
    return torch.einsum("hmkt,bt->hkbm", sq, _sign_table(kc)).contiguous().numpy()


def _side_type(rows) -> np.ndarray:
    """``NORM_TYPES``' array of the affine layers' scales and biases (one type for all): fp16 (read as its uint16
    bits) or fp32."""
    import torch

    types = {t.dtype for _, L, _, _ in rows for t in (L.kn, L.ks, L.vn, L.vb)}
    if len(types) > 1 or not types <= {torch.float16, torch.float32}:
        raise ValueError("affine scales and biases of several types, or neither fp16 nor fp32")
    return NORM_TYPES[np.dtype(np.uint16 if torch.float16 in types else np.float32)]


def _affine_seq_row(cache, L, keep: list) -> list[int]:
    """Layer ``L``'s affine storage as a row of ``affine_kernel``'s sequence table (``AFFINE_FIELDS``: codes,
    scales and biases of keys, then of values, by address; then their rows), kept on the layer with its numpy views
    (``_held``); a tensor that is not contiguous is copied into ``keep``."""
    row = _held(cache, L)[2]
    if row is None:
        ts = [_contiguous(t, keep) for t in _code_tensors(L)]
        row = [t.data_ptr() for t in ts] + [t.shape[1] for t in ts]
    return row


def _held(cache, L) -> tuple:
    """An affine layer's ``np_codes``: (its storage tensors, their numpy views for ``affine_encode`` or None
    (``_code_views``), their addresses and rows for ``affine_kernel`` or None where one is not contiguous), made
    again when the storage is reallocated (``CompressedCache._alloc_codes`` replaces every tensor)."""
    held, ts = L.np_codes, _code_tensors(L)
    if held is None or any(a is not b for a, b in zip(held[0], ts)):
        row = None
        if all(t.is_contiguous() for t in ts):
            row = [t.data_ptr() for t in ts] + [t.shape[1] for t in ts]
        held = L.np_codes = (ts, _code_views(cache, L), row)
    return held


def encode_into(cache, L, dk, dv, at: int) -> bool:
    """Affine (``kv_bits``) rows dk / dv [KVH, c, D] encoded straight into rows [at, at + c) of ``L``'s code
    storage by one compiled call each (``affine_encode``: the bytes of ``AffineCodec.encode``), instead of a
    chain of small torch ops per layer and decode step.  False (nothing written) where it does not apply: no
    numba, not the CPU, storage too short or of other dtypes; the caller encodes and stores them itself."""
    import torch

    if cache.fmt.kind != "affine" or L.kn is None or at + dk.shape[1] > L.kn.shape[1] or not enabled():
        return False
    arrays = _held(cache, L)[1]
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
