"""The kernel and CUDA-graph side of a ``CompressedCache``: a decode row through the Triton kernels (eager, or with
every shape fixed for a graph) and the block compression a graph replays (``graphs.GraphDecoder.run_turbo``,
``run_compressed_batch``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from swiftlm.turboquant.presets import COMPRESS_BLOCK, KVFormat

from .affine_decode import attend_row, kernel_ok, static_row
from .code_pages import CachePages, CodeLayer, put_rows


class GraphSteps:
    """The Triton decode rows of one compressed cache (layout ``a``, format ``fmt``, codecs ``kc`` / ``vc``, 16-bit
    rows in ``dense_dtype``).  Static caches (``capacity`` positions, None: a cache that grows) also get the fixed
    shape steps a CUDA graph replays; ``pages``: the cache's ``CachePages`` (None: codes of its own)."""

    def __init__(
        self,
        a: Any,
        fmt: KVFormat,
        kc: Any,
        vc: Any,
        dense_dtype: torch.dtype,
        capacity: int | None,
        pages: CachePages | None,
    ):
        self.a, self.fmt, self.kc, self.vc, self.dense_dtype = a, fmt, kc, vc, dense_dtype
        self.capacity, self.pages = capacity, pages
        self.window = fmt.window if fmt.kind == "turbo" else 0
        self._rot: tuple | None = None  # (R^T * scale, S^T * scale) fp32, made on first use

    def affine_kernel(self) -> bool:
        """An affine format whose rows the kernels of cuda_ext/affine_kv_kernels.py take (affine_decode.py)."""
        return self.fmt.kind == "affine" and kernel_ok(self)

    def attend_static(
        self, L: CodeLayer, q: torch.Tensor, n_code: torch.Tensor, valid: torch.Tensor, k: Any = None, v: Any = None
    ) -> torch.Tensor:
        """``CompressedCache.attend_static`` for layer ``L``."""
        if self.fmt.kind == "affine":
            return static_row(self, L, q, k, v, n_code)
        pages = self.pages.arg(self.capacity) if self.pages is not None else None
        return self._kernel_row(L, q, (L.kp, L.kn, L.vp, L.vn, L.ks), n_code, L.dk, L.dv, valid, pages)

    def attend_row(self, L: CodeLayer, q: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
        """One decode row q [H, 1, D], eagerly: L's ``n_code`` compressed rows through the kernel and the 16-bit rows
        ``dk`` / ``dv``.  [1, H*D]."""
        if self.fmt.kind == "affine":
            return attend_row(self, L, q[:, 0], dk, dv)
        n = L.n_code
        if self.pages is not None:  # the pool's tensors, read through the page table
            return self._kernel_row(L, q[:, 0], (L.kp, L.kn, L.vp, L.vn, L.ks), None, dk, dv, None, self.pages.arg(n))
        views = (
            [p[:, :n] for p in L.kp],
            L.kn[:, :n],
            [p[:, :n] for p in L.vp],
            L.vn[:, :n],
            L.ks[:, :n] if L.ks is not None else None,
        )
        return self._kernel_row(L, q[:, 0], views, None, dk, dv, None)

    def after_step(self, layers: list[CodeLayer], compress: Any, eager: Callable[[CodeLayer], None]) -> None:
        """``CompressedCache.after_graph_step``'s counters: an affine step quantized its row into the codes; a
        TurboQuant step's row joined the 16-bit rows, and a block that left the window is compressed by
        ``compress`` (a callable of the first code row) when ``block_due``, else layer by layer by ``eager``."""
        if self.fmt.kind == "affine":
            for L in layers:
                if L.n_code >= self.capacity:
                    raise RuntimeError(f"static affine cache holds {self.capacity} positions; {L.n_code + 1} needed")
                L.n_code += 1
            return
        for L in layers:
            L.n_dense += 1
        if compress is None or not self.block_due(layers):
            for L in layers:
                eager(L)
            return
        n_code = layers[0].n_code
        if self.pages is not None:
            self.pages.need(n_code + COMPRESS_BLOCK)
        compress(n_code)
        for L in layers:
            L.n_code += COMPRESS_BLOCK
            L.n_dense -= COMPRESS_BLOCK

    def block_due(self, layers: list[CodeLayer]) -> bool:
        """A static TurboQuant cache whose layers all hold the same counts and must now compress exactly
        COMPRESS_BLOCK rows (``compress_block``'s fixed shapes)."""
        L0 = layers[0]
        return (
            self.capacity is not None
            and self.fmt.kind == "turbo"
            and L0.n_dense == self.window + COMPRESS_BLOCK
            and L0.n_code + L0.n_dense > self.fmt.threshold
            and L0.n_code + COMPRESS_BLOCK <= self.capacity
            and all(
                L.compressed and L.pending is None and L.n_dense == L0.n_dense and L.n_code == L0.n_code for L in layers
            )
        )

    def compress_block(self, layers: list[CodeLayer], at: torch.Tensor) -> None:
        """``CompressedCache.compress_block`` over ``layers``."""
        c, n = COMPRESS_BLOCK, self.window
        idx = at + torch.arange(c, device=at.device)
        if self.pages is not None:  # code rows -> pool rows through the device page table
            idx = self.pages.table_rows(idx)
        for L in layers:
            put_rows(L, idx, self.kc.encode(L.dk[:, :c]), self.vc.encode(L.dv[:, :c]))
            rest_k, rest_v = L.dk[:, c : c + n].clone(), L.dv[:, c : c + n].clone()
            L.dk[:, :n] = rest_k
            L.dv[:, :n] = rest_v

    def rotations(self, scale: float) -> tuple:
        """(R^T, S^T or None) with the softmax scale folded in, fp32, for ``rotate_rows`` (made once)."""
        if self._rot is None:
            self._rot = (
                (self.kc.R.T * scale).float().contiguous(),
                (self.kc.S.T * scale).float().contiguous() if self.kc.qjl else None,
            )
        return self._rot

    def _kernel_row(
        self,
        L: CodeLayer,
        q: torch.Tensor,
        views: tuple,
        n_rows: torch.Tensor | None,
        dk: torch.Tensor,
        dv: torch.Tensor,
        valid: torch.Tensor | None,
        pages: tuple | None = None,
    ) -> torch.Tensor:
        """One decode row (q [H, D]): the compressed rows through the Triton kernel (``views`` of the
        planes/norms/signs; ``n_rows`` on the device for graphs), merged with the 16-bit rows ``dk``/``dv``
        (``valid`` masks buffer rows) in the original domain; the code part is rotated back once."""
        from swiftlm.cuda_ext.turboquant_kernels import rotate_rows, tq_decode_attention_full

        H, D = q.shape
        scale = D**-0.5
        kp, kn, vp, vn, ks = views
        rt, st = self.rotations(scale)
        qjl = (rotate_rows(q, st), ks, L.kr, self.kc.qjl_scale) if self.kc.qjl else None
        # 16-bit models: fp16 operands in the code dots (fp32 accumulation); fp32 models: fp32 throughout
        out = tq_decode_attention_full(
            q,
            rotate_rows(q, rt),
            kp,
            kn,
            self.kc.centroids,
            self.kc.mse_bits,
            vp,
            vn,
            self.vc.centroids,
            self.vc.bits,
            self.vc.R,
            dk,
            dv,
            scale,
            rep=H // self.a.kv_heads,
            qjl=qjl,
            n_rows=n_rows,
            valid=valid,
            f16=q.dtype in (torch.float16, torch.bfloat16),
            pages=pages,
        )
        return out.reshape(1, H * D)
