"""Pages of TurboQuant codes: the compressed part of every static TurboQuant cache of one format in one pool.

Without pages, a static (CUDA-graph) TurboQuant cache holds codes for the whole context from its first
request on, whatever its length.  With a ``CodePages`` pool, every layer's packed key/value planes, norms
(and QJL signs / residual norms) are tensors ``[KVH, (pages + 1) * page_rows, ...]`` shared by all caches of
the format; a cache owns *pages* of ``page_rows`` positions, listed in position order::

    code row r of a sequence  ->  pool row  pages[r // page_rows] * page_rows + r % page_rows

Each cache keeps its list on the host and the same list in a device table of fixed address (a CUDA graph
reads it; entries past the list name the scratch page, the pool's last).  The split kernel reads one table
entry per tile, one tile ahead (``cuda_ext/turboquant_kernels._page_of``); encodes write through the same mapping.

Which pages a sequence gets is the engine's decision when the format is the server's default
(``swiftlm.kv_blocks.KVBlocks`` over the pages: admission and preemption by memory, as for 16-bit blocks);
without a manager (tests, a cache built by hand) a cache takes free pages itself as its codes grow and gives
them back on ``reset``.
"""

from __future__ import annotations

from typing import Any

import torch

from .kv_quant import Encoded, TurboCodec
from .staging import stager

PAGE_ROWS = 256  # positions per page: a multiple of the split kernel's 64-row tile


class CodeLayer:
    """One layer of a compressed cache: its 16-bit buffer and its code storage (a paged cache's: the pool's)."""

    __slots__ = (
        "compressed", "n_code", "n_dense", "dk", "dv", "kp", "kn", "ks", "kr", "vp", "vn", "vb", "pending", "stage",
        "staging", "np_codes",
    )  # fmt: skip

    def __init__(self, compressed: bool):
        self.compressed = compressed
        self.n_code = self.n_dense = 0
        self.dk = self.dv = None
        self.kp = self.vp = None  # lists of uint8 planes [KVH, cap, bytes]
        self.kn = self.vn = None  # fp16 norms / affine scales [KVH, cap(, groups)]
        self.ks = self.kr = None  # QJL signs [KVH, cap, d/8] and residual norms / affine key bias
        self.vb = None  # affine value bias
        self.pending = None  # static caches: this step's 16-bit rows when they overflow the buffer
        self.stage = None  # static caches: (keys, values) [KVH, cap, D] holding a prompt's 16-bit rows (staging)
        self.staging = False  # the layer's rows so far are a prompt held in 16 bits, compressed at ``settle``
        # the code storage as the CPU kernels take it, with the tensors it was made of: an affine layer's numpy views
        # (cpu_kernels.encode_into) and addresses, or a TurboQuant layer's addresses (cpu_kernels.code_rows)
        self.np_codes = None


def put_rows(L: CodeLayer, idx: torch.Tensor | slice, k: Encoded, v: Encoded) -> None:
    """Encoded rows (tensors [KVH, n, ...]) into rows ``idx`` of L's code storage: device int64 [n] (a pool's rows,
    through a page table), or a slice of a cache's own contiguous rows."""
    pairs = [*zip(L.kp + L.vp, k.planes + v.planes), (L.kn, k.norms), (L.vn, v.norms)]
    pairs += [(L.ks, k.signs), (L.kr, k.rnorms), (L.vb, v.signs)]  # QJL keys; affine value biases
    for dst, src in pairs:
        if src is None:
            continue
        if isinstance(idx, slice):
            dst[:, idx] = src
        else:
            dst.index_copy_(1, idx, src)


class CodePages:
    """The code storage of ``pages`` pages for caches of format ``fmt`` (every layer compressed)."""

    def __init__(self, a: Any, fmt: Any, pages: int, device: torch.device, page_rows: int = PAGE_ROWS):
        if fmt.kind != "turbo" or fmt.keep_layers:
            raise ValueError(f"code pages hold TurboQuant formats with every layer compressed, not {fmt.name}")
        self.fmt, self.a, self.device = fmt, a, device
        self.pages, self.page_rows = int(pages), int(page_rows)
        self.scratch = self.pages
        rows = (self.pages + 1) * self.page_rows
        KVH, d = a.kv_heads, a.head_dim
        kc = TurboCodec(d, fmt.key_code_bits, fmt.seed * 2 + 1, device, qjl=fmt.key_qjl)
        vc = TurboCodec(d, fmt.value_bits, fmt.seed * 2 + 2, device)
        k = kc.encode(torch.zeros(KVH, 1, d, device=device))
        v = vc.encode(torch.zeros(KVH, 1, d, device=device))

        def like(t: torch.Tensor) -> torch.Tensor:
            return torch.zeros((t.shape[0], rows, *t.shape[2:]), dtype=t.dtype, device=device)

        # per layer: (key planes, value planes, key norms, value norms, QJL signs, QJL residual norms)
        self.layers = [
            (
                [like(p) for p in k.planes],
                [like(p) for p in v.planes],
                like(k.norms),
                like(v.norms),
                like(k.signs) if k.signs is not None else None,
                like(k.rnorms) if k.rnorms is not None else None,
            )
            for _ in range(a.layers)
        ]
        self.page_bytes = self.nbytes() // (self.pages + 1)  # one page over every layer
        self.free = list(range(self.pages - 1, -1, -1))  # pages no cache holds (unmanaged use)
        self.managed = False  # a KVBlocks manager hands the pages out (attach)

    @staticmethod
    def page_bytes_for(a: Any, fmt: Any, page_rows: int = PAGE_ROWS) -> int:
        """Bytes of one page over every layer (codes, norms, QJL): what ``pages`` of them cost."""
        per_row = fmt.key_row_bytes(a.head_dim) + fmt.value_row_bytes(a.head_dim)  # codes, norms, QJL
        return per_row * a.kv_heads * page_rows * a.layers

    def tensors(self) -> list[torch.Tensor]:
        return [t for L in self.layers for t in (*L[0], *L[1], *L[2:]) if t is not None]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def attach(self) -> None:
        """From now on a ``KVBlocks`` manager decides which pages each sequence holds."""
        self.managed = True
        self.free = []

    def table(self, capacity: int) -> torch.Tensor:
        """A fresh device page table for a cache of ``capacity`` positions (all scratch)."""
        n = -(-capacity // self.page_rows) + 1
        return torch.full((n,), self.scratch, dtype=torch.int32, device=self.device)


class CachePages:
    """One static cache's pages of ``pool``: the list in position order (``list``: its own, or the manager's live
    list for the sequence), the same list in a device table for ``capacity`` positions (``table``: fixed address,
    read by CUDA graphs), and the pool rows that code rows map to."""

    def __init__(self, pool: CodePages, capacity: int):
        self.pool = pool
        self.list: list[int] = []
        self.table = pool.table(capacity)
        self._synced = 0  # entries of ``list`` the table holds (-1: rewrite it)
        self._rows: tuple[tuple, torch.Tensor] | None = None  # ((at, n, pages), rows_at's answer)

    def release(self) -> None:
        """Give the pages back: to the pool (a manager's list is the manager's to free)."""
        if not self.pool.managed:
            self.pool.free.extend(reversed(self.list))
        self.set([])  # the device table still names them: rewrite it before the next read

    def set(self, pages: list[int]) -> None:
        """The manager's live page list for this cache's sequence (``KVBlocks.table``)."""
        self.list, self._synced, self._rows = pages, -1, None

    def sync(self) -> None:
        """Copy the page list into the device table if it changed (before a step that reads it)."""
        n = len(self.list)
        if n == self._synced:
            return
        host = torch.full((self.table.shape[0],), self.pool.scratch, dtype=torch.int32)
        host[:n] = torch.tensor(self.list[: host.shape[0]], dtype=torch.int32)
        self.table.copy_(stager(self.pool.device).to_device(host) if self.table.is_cuda else host)
        self._synced = n

    def need(self, rows: int) -> None:
        """Pages for code rows [0, rows): a managed list must already hold them; else take free pages."""
        P, pool = self.pool.page_rows, self.pool
        need = -(-rows // P) - len(self.list)
        if need > 0:
            if pool.managed:
                raise RuntimeError(f"code pages for {rows} positions are not allocated ({len(self.list)} pages of {P})")
            if need > len(pool.free):
                raise RuntimeError(f"TurboQuant code pages exhausted ({pool.pages} pages of {P} positions)")
            self.list.extend(pool.free.pop() for _ in range(need))
        self.sync()

    def rows_at(self, at: int, n: int) -> torch.Tensor:
        """Pool rows of code rows [at, at + n) (device int64; every layer writes the same rows)."""
        key = (at, n, len(self.list))
        if self._rows is None or self._rows[0] != key:
            self.need(at + n)
            P = self.pool.page_rows
            p = torch.arange(at, at + n)
            rows = torch.tensor(self.list, dtype=torch.long)[p // P] * P + p % P
            self._rows = key, rows.to(self.pool.device)
        return self._rows[1]

    def arg(self, rows: int) -> tuple:
        """The kernels' ``pages`` argument for ``rows`` code rows at most."""
        return self.table, self.pool.page_rows, rows

    def table_rows(self, idx: torch.Tensor) -> torch.Tensor:
        """Pool rows of code rows ``idx`` (device) through the device table: no host sync (capturable)."""
        P = self.pool.page_rows
        return self.table[idx // P].long() * P + idx % P

    def view(self, L: CodeLayer) -> CodeLayer:
        """L with its code rows [0, n_code) gathered into contiguous tensors (the eager paths read codes by
        position)."""
        if not L.n_code:
            return L
        idx = self.rows_at(0, L.n_code)
        v = CodeLayer(True)
        v.n_code, v.n_dense, v.dk, v.dv, v.pending = L.n_code, L.n_dense, L.dk, L.dv, L.pending
        v.stage, v.staging = L.stage, L.staging
        v.kp = [t.index_select(1, idx) for t in L.kp]
        v.vp = [t.index_select(1, idx) for t in L.vp]
        v.kn, v.vn = L.kn.index_select(1, idx), L.vn.index_select(1, idx)
        v.ks = L.ks.index_select(1, idx) if L.ks is not None else None
        v.kr = L.kr.index_select(1, idx) if L.kr is not None else None
        return v

    def nbytes(self) -> int:
        """Bytes of the pages held."""
        return len(self.list) * self.pool.page_bytes
