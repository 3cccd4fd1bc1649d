"""Several sequences' static TurboQuant caches decoded by one launch per kernel (the batched graph step).

``fused_decode.decode_compressed_batch_static_fused`` runs B decode rows, each over its own static
compressed cache.  Per row and layer that is four small kernels (rope + K/V write, query rotation, the
split pass over the codes, the combine pass): 4 x B launches per layer.  When every cache of the batch
holds the same TurboQuant format, the kernels take all rows at once instead: the caches' storage never
moves (static caches), so each row's tensors are addressed from row 0's by a constant element offset,
kept in small device tables made once per set of caches (outside graph capture: the warm-up run makes
them, the capture finds them).  The rope kernel writes row b's K/V into its own 16-bit buffer through
row 0's buffer seen as a pool whose "slot" b is that offset (keys and values of a layer share one
allocation per cache, so one offset serves both; the pool's slot stride is one element, so any offset does).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

_TABLES: OrderedDict = OrderedDict()
CALLS = 0  # batched layer calls made (tests check that the batched path ran)
_MAX_TABLES = 2048  # sets of caches x layers; beyond, the oldest go


def _offsets(ts: list[torch.Tensor]) -> list[int] | None:
    """Element offsets of ``ts[b]`` from ``ts[0]`` (same dtype, shape and strides), or None."""
    t0 = ts[0]
    out = []
    for t in ts:
        if t.dtype != t0.dtype or t.shape != t0.shape or t.stride() != t0.stride():
            return None
        d = t.data_ptr() - t0.data_ptr()
        if d % t.element_size():
            return None
        out.append(d // t.element_size())
    return out


def batch_tables(kvs: list, i: int) -> tuple | None:
    """(offs [B, 8] (paged caches: [B, 9], the page tables' offsets last), dense offs [B, 2], slot base [B])
    int64 device tables for layer ``i`` of these caches,
    or None where the batched kernels cannot take them (mixed formats, affine caches, a layer kept 16-bit,
    offsets that do not divide)."""
    kv0 = kvs[0]
    if len(kvs) < 2 or kv0.fmt.kind != "turbo" or not kv0.static:
        return None
    if any(
        kv.fmt != kv0.fmt
        or not kv.static
        or kv.dense_rows != kv0.dense_rows
        or kv.code_pages is not kv0.code_pages
        or kv.capacity != kv0.capacity
        for kv in kvs
    ):
        return None
    Ls = [kv.layers[i] for kv in kvs]
    if not all(L.compressed and L.kp is not None for L in Ls):
        return None
    # every tensor the tables address, so that caches freed and made again elsewhere never meet a stale table
    key = (
        (kv0.fmt,)
        + tuple(t.data_ptr() for L in Ls for t in (*L.kp, *L.vp, L.kn, L.vn, L.ks, L.kr, L.dk, L.dv) if t is not None)
        + tuple(kv.ptab.data_ptr() for kv in kvs if kv.paged)
    )
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    if Ls[0].dk.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # no host-to-device copy inside a capture: this capture takes the per-row path

    def col(get) -> list[int] | None:
        return _offsets([get(L) for L in Ls])

    cols = [
        col(lambda L: L.kp[0]),
        col(lambda L: L.kp[-1]),
        col(lambda L: L.kn),
        col(lambda L: L.vp[0]),
        col(lambda L: L.vp[-1]),
        col(lambda L: L.vn),
        col(lambda L: L.ks if L.ks is not None else L.kn),
        col(lambda L: L.kr if L.kr is not None else L.kn),
    ]
    dk, dv = col(lambda L: L.dk), col(lambda L: L.dv)
    if any(c is None for c in cols) or dk is None or dv is None or dk != dv:
        return None
    if any(x % 16 for c in cols + [dk] for x in c):  # the kernels assume it (wide loads); CUDA allocates 512 B aligned
        return None
    if kv0.paged:  # one pool (offsets 0 above); column 8: each cache's page table from the first's
        pt = _offsets([kv.ptab for kv in kvs])
        if pt is None:
            return None
        cols.append(pt)
    dev = Ls[0].dk.device
    hit = (
        torch.tensor(cols, dtype=torch.int64).T.contiguous().to(dev),
        torch.tensor([dk, dv], dtype=torch.int64).T.contiguous().to(dev),
        torch.tensor(dk, dtype=torch.int64).to(dev),
    )
    _TABLES[key] = hit
    while len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return hit


def buffer_as_pool(buf: torch.Tensor, slot_stride: int | None = None) -> torch.Tensor:
    """A static compressed cache's 16-bit buffer [KVH, rows, D] seen as a one-slot pool
    [1, KVH, rows, D] whose slot stride is one row: ``rope_kv_write_rows`` writes row ``pos`` of slot
    ``s`` at buffer row ``s + pos``, so slot ``n_dense - pos`` puts the rope-rotated row at ``n_dense``
    while the rotation still uses position ``pos``.  ``slot_stride``: another slot stride (elements)."""
    KVH, rows, D = buf.shape
    assert buf.is_contiguous()
    return torch.as_strided(buf, (1, KVH, rows, D), (D if slot_stride is None else slot_stride, rows * D, D, 1))


def attend_static_batch(
    kv: Any,
    layer: int,
    q: torch.Tensor,
    n_code: torch.Tensor,
    n_dense: torch.Tensor,
    offs: torch.Tensor,
    doffs: torch.Tensor,
) -> torch.Tensor:
    """``CompressedCache.attend_static`` for B caches of ``kv``'s format at once: q [B*H, D], row b's tensors
    at ``offs`` / ``doffs`` elements from ``kv``'s, its counts in n_code / n_dense [B].  Returns [B*H, D]."""
    from swiftlm.cuda_ext.turboquant_kernels import rotate_rows, tq_decode_attention_full

    L = kv.layers[layer]
    BH, D = q.shape
    H = BH // n_code.shape[0]
    rep = H // kv.a.kv_heads
    scale = D**-0.5
    rt, st = kv.rotations(scale)
    qjl = (rotate_rows(q, st), L.ks, L.kr, kv.kc.qjl_scale) if kv.kc.qjl else None
    return tq_decode_attention_full(
        q,
        rotate_rows(q, rt),
        L.kp,
        L.kn,
        kv.kc.centroids,
        kv.kc.mse_bits,
        L.vp,
        L.vn,
        kv.vc.centroids,
        kv.vc.bits,
        kv.vc.R,
        L.dk,
        L.dv,
        scale,
        rep=rep,
        qjl=qjl,
        n_rows=n_code,
        f16=q.dtype in (torch.float16, torch.bfloat16),
        batch=(offs, doffs, n_dense, H),
        pages=kv._pages_arg(kv.capacity),
    )


def batch_row_attention(
    model: Any,
    kvs: list,
    i: int,
    qkv: torch.Tensor,
    pos: torch.Tensor,
    n_dense: torch.Tensor,
    n_code: torch.Tensor,
    H: int,
    KVH: int,
    D: int,
    tables: tuple,
) -> torch.Tensor:
    """Layer ``i`` of B decode rows over B static TurboQuant caches of one format (``batch_tables``): rope +
    K/V rows written into each cache's buffer at its ``n_dense`` (one kernel), then the caches' attention
    (``attend_static_batch``: three kernels for all rows).  qkv [B, (H+2KVH)*D]; pos,
    n_dense, n_code device [B].  Returns [B, H*D]."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    global CALLS
    CALLS += 1
    offs, doffs, dense_base = tables
    L0 = kvs[0].layers[i]
    B = qkv.shape[0]
    # row 0's buffers as a pool whose slot stride is one element: slot dense_base[b] + (n_dense - pos) * D puts
    # row b's rope-rotated K/V row at its own buffer's row n_dense while the rotation uses position pos
    q = rope_kv_write_rows(
        qkv,
        model.cos,
        model.sin,
        pos,
        dense_base + (n_dense - pos) * D,
        buffer_as_pool(L0.dk, slot_stride=1),
        buffer_as_pool(L0.dv, slot_stride=1),
        H,
        KVH,
        D,
    )  # [B, H, D]
    return attend_static_batch(kvs[0], i, q.reshape(B * H, D), n_code, n_dense, offs, doffs).reshape(B, H * D)
