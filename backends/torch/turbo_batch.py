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

A graph captured over ``batch_tables`` serves only its own set of caches.  ``SetTables`` addresses every row from a
fixed base cache through one device buffer instead, which a new set's offsets are copied into before a replay: one
graph per batch size then serves every set (caches come and go with requests, so sets change at almost every
arrival, and a capture costs ~100 ms for all the streams of a step).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Any

import torch

_TABLES: OrderedDict = OrderedDict()
CALLS = 0  # batched layer calls made (tests check that the batched path ran)
_MAX_TABLES = 2048  # sets of caches x layers; beyond, the oldest go
LOADS = 0  # sets loaded into SetTables (tests check that one graph served several sets)
_PAIRS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # cache -> {base cache: _pair_rows}


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


def _same_kind(kvs: list) -> bool:
    """Static TurboQuant caches of one format, buffer size, capacity and code pool: what the batched kernels need
    for every row to be addressed from the first's tensors."""
    kv0 = kvs[0]
    return (
        kv0.fmt.kind == "turbo"
        and kv0.static
        and all(
            kv.fmt == kv0.fmt
            and kv.static
            and kv.dense_rows == kv0.dense_rows
            and kv.code_pages is kv0.code_pages
            and kv.capacity == kv0.capacity
            for kv in kvs
        )
    )


def _layer_columns(kvs: list, i: int) -> tuple[list[list[int]], list[int]] | None:
    """Element offsets of layer ``i``'s tensors of each cache from ``kvs[0]``'s: the 8 code columns (paged caches: a
    9th, the page tables) and the 16-bit buffer's; None where the kernels cannot take them (a layer kept 16-bit,
    offsets that do not divide or are not 16-element aligned, keys and values apart)."""
    Ls = [kv.layers[i] for kv in kvs]
    if not all(L.compressed and L.kp is not None for L in Ls):
        return None

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
    if kvs[0].paged:  # one pool (offsets 0 above); column 8: each cache's page table from the first's
        pt = _offsets([kv.ptab for kv in kvs])
        if pt is None:
            return None
        cols.append(pt)
    return cols, dk  # type: ignore[return-value]


def batch_tables(kvs: list, i: int) -> tuple | None:
    """(offs [B, 8] (paged caches: [B, 9], the page tables' offsets last), dense offs [B, 2], slot base [B])
    int64 device tables for layer ``i`` of these caches, from ``kvs[0]``'s tensors,
    or None where the batched kernels cannot take them (mixed formats, affine caches, a layer kept 16-bit,
    offsets that do not divide)."""
    if len(kvs) < 2 or not _same_kind(kvs):
        return None
    Ls = [kv.layers[i] for kv in kvs]
    if not all(L.compressed and L.kp is not None for L in Ls):
        return None
    # every tensor the tables address, so that caches freed and made again elsewhere never meet a stale table
    key = (
        (kvs[0].fmt,)
        + tuple(t.data_ptr() for L in Ls for t in (*L.kp, *L.vp, L.kn, L.vn, L.ks, L.kr, L.dk, L.dv) if t is not None)
        + tuple(kv.ptab.data_ptr() for kv in kvs if kv.paged)
    )
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    if Ls[0].dk.is_cuda and torch.cuda.is_current_stream_capturing():
        return None  # no host-to-device copy inside a capture: this capture takes the per-row path
    got = _layer_columns(kvs, i)
    if got is None:
        return None
    cols, dk = got
    dev = Ls[0].dk.device
    hit = (
        torch.tensor(cols, dtype=torch.int64).T.contiguous().to(dev),
        torch.tensor([dk, dk], dtype=torch.int64).T.contiguous().to(dev),
        torch.tensor(dk, dtype=torch.int64).to(dev),
    )
    _TABLES[key] = hit
    while len(_TABLES) > _MAX_TABLES:
        _TABLES.popitem(last=False)
    return hit


def _pair_rows(base: Any, kv: Any) -> torch.Tensor | None:
    """[layers, W + 3] int64: every layer's offsets of ``kv``'s tensors from ``base``'s (W = 8 code columns, 9 with
    the page table), then the 16-bit buffers' offset three times (keys, values, the rope kernel's slot base); None
    where the two cannot share tables.  Made once per pair: a static cache's storage never moves."""
    per = _PAIRS.setdefault(kv, weakref.WeakKeyDictionary())
    if base in per:
        return per[base]
    rows = None
    if _same_kind([base, kv]):
        cols = [_layer_columns([base, kv], i) for i in range(len(kv.layers))]
        if all(c is not None for c in cols):
            rows = torch.tensor([[c[1] for c in cs] + [dk[1]] * 3 for cs, dk in cols], dtype=torch.int64)
    per[base] = rows
    return rows


class SetTables:
    """The batched kernels' tables for any set of ``B`` caches compatible with ``base``, addressed from ``base``'s
    tensors (which need not be in the set) and held in one device buffer of fixed address: a CUDA graph captured
    over these tables serves every set of B such caches, ``load`` writing a new set's offsets in before a replay.
    ``layers[i]``: layer i's (offs [B, W], dense offs [B, 2], slot base [B]), views of the buffer."""

    def __init__(self, base: Any, B: int, device: torch.device):
        n, W = len(base.layers), 9 if base.paged else 8
        self.base, self.B, self.W = base, B, W
        # each layer's tables start 16-byte aligned, as tables of their own would: Triton specialises a kernel on
        # its pointers' alignment, and another specialisation is another compile (seconds) in the serving loop
        self.sizes = [-(-B * w // 2) * 2 for w in (W, 2, 1)]
        self.buf = torch.zeros(n * sum(self.sizes), dtype=torch.int64, device=device)
        parts, at = [], 0
        for size, w in zip(self.sizes, (W, 2, 1)):
            part = self.buf[at : at + n * size].view(n, size)[:, : B * w]
            parts.append([part[i].view(B, w) if w > 1 else part[i] for i in range(n)])
            at += n * size
        self.layers = list(zip(*parts))
        self.loaded: list = []  # the caches whose offsets the buffer holds, in row order

    def host(self, kvs: list) -> torch.Tensor | None:
        """The buffer's contents for ``kvs`` (a CPU tensor), or None where one of them cannot share ``base``'s tables."""
        rows = [_pair_rows(self.base, kv) for kv in kvs]
        if len(kvs) != self.B or any(r is None for r in rows):
            return None
        t = torch.stack(rows, 1)  # [layers, B, W + 3]
        n, W = t.shape[0], self.W
        out = []
        for size, cols in zip(self.sizes, (t[..., :W], t[..., W : W + 2], t[..., W + 2 :])):
            part = torch.zeros(n, size, dtype=torch.int64)
            part[:, : cols.shape[1] * cols.shape[2]] = cols.reshape(n, -1)
            out.append(part.reshape(-1))
        return torch.cat(out)

    def load(self, kvs: list, to_device: Any) -> bool:
        """Point the tables at ``kvs`` (``to_device``: a host -> device copy that does not wait for the device);
        False where they cannot take this set."""
        if len(kvs) == len(self.loaded) and all(a is b for a, b in zip(kvs, self.loaded)):
            return True
        host = self.host(kvs)
        if host is None:
            return False
        self.buf.copy_(to_device(host))
        self.loaded = list(kvs)
        global LOADS
        LOADS += 1
        return True


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
    kv0: Any,
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
    """Layer ``i`` of B decode rows over B static TurboQuant caches of one format, addressed from ``kv0``'s tensors
    by ``tables`` (``batch_tables``, or a ``SetTables`` layer): rope +
    K/V rows written into each cache's buffer at its ``n_dense`` (one kernel), then the caches' attention
    (``attend_static_batch``: three kernels for all rows).  qkv [B, (H+2KVH)*D]; pos,
    n_dense, n_code device [B].  Returns [B, H*D]."""
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows

    global CALLS
    CALLS += 1
    offs, doffs, dense_base = tables
    L0 = kv0.layers[i]
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
    return attend_static_batch(kv0, i, q.reshape(B * H, D), n_code, n_dense, offs, doffs).reshape(B, H * D)
