"""The kernel and CUDA-graph side of a ``CompressedCache``: a decode row through the Triton kernels (eager, or with
every shape fixed for a graph), the host bookkeeping after a replayed step, and the block compression a graph replays
(``graphs.GraphDecoder.run_turbo``, ``run_compressed_batch``)."""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.turboquant.presets import COMPRESS_BLOCK

from .code_pages import put_rows


class GraphSteps:
    """Mixed into ``compressed_cache.CompressedCache`` (``layers``, ``fmt``, ``static``, ``capacity``, ``window``,
    ``kc`` / ``vc``, ``a``, ``device``, ``_rot``, the paged-code hooks, ``_dense`` and ``_compress``)."""

    def attend_static(
        self,
        layer: int,
        q: torch.Tensor,
        n_code: torch.Tensor,
        valid: torch.Tensor,
        k: torch.Tensor | None = None,
        v: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Decode-row attention with every shape fixed (capturable): q [H, D]; the new row is
        already in the 16-bit buffer; ``n_code`` (device, [1]) compressed rows are read through the
        Triton kernel over the whole code storage, the buffer's rows through ``valid`` [rows].
        Affine caches: the new row is ``k``, ``v`` [KVH, 1, D], quantized into the codes at ``n_code``
        here and attended in 16 bits (``affine_decode.static_row``).  Returns [1, H*D]."""
        L = self.layers[layer]
        if self.fmt.kind == "affine":
            from .affine_decode import static_row

            return static_row(self, L, q, k, v, n_code)
        return self._kernel_row(
            L, q, (L.kp, L.kn, L.vp, L.vn, L.ks), n_code, L.dk, L.dv, valid, self._pages_arg(self.capacity)
        )

    def graphable(self) -> bool:
        """Can this cache's decode rows replay a CUDA graph?  A prompt held in 16 bits is compressed first
        (``settle``): every graph path asks this before its first decode row."""
        self.settle()
        if self.fmt.kind == "affine":
            return self.static and self._affine_kernel()
        return self.static and self.fmt.kind == "turbo" and all(L.compressed for L in self.layers)

    def after_graph_step(self, pos: int, compress: Any = None) -> None:
        """Host bookkeeping after a replayed decode step wrote position ``pos``.  ``compress``: a callable
        that runs ``compress_block`` (e.g. replays a CUDA graph of it), used when exactly COMPRESS_BLOCK
        rows of every layer leave the window (the steady state of one-row steps); otherwise each
        layer compresses eagerly."""
        if self.fmt.kind == "affine":  # the step quantized its row into the codes at n_code
            for L in self.layers:
                if L.n_code >= self.capacity:
                    raise RuntimeError(f"static affine cache holds {self.capacity} positions; {L.n_code + 1} needed")
                L.n_code += 1
            self.length = pos + 1
            return
        for L in self.layers:
            L.n_dense += 1
        if compress is not None and self.block_due():
            n_code = self.layers[0].n_code
            if self.paged:
                self._need_pages(n_code + COMPRESS_BLOCK)
            compress(n_code)
            for L in self.layers:
                L.n_code += COMPRESS_BLOCK
                L.n_dense -= COMPRESS_BLOCK
        else:
            for L in self.layers:
                self._compress(L)
        self.length = pos + 1

    def block_due(self) -> bool:
        """A static TurboQuant cache whose layers all hold the same counts and must now compress exactly
        COMPRESS_BLOCK rows (``compress_block``'s fixed shapes)."""
        L0 = self.layers[0]
        return (
            self.static
            and self.fmt.kind == "turbo"
            and L0.n_dense == self.window + COMPRESS_BLOCK
            and L0.n_code + L0.n_dense > self.fmt.threshold
            and L0.n_code + COMPRESS_BLOCK <= self.capacity
            and all(
                L.compressed and L.pending is None and L.n_dense == L0.n_dense and L.n_code == L0.n_code
                for L in self.layers
            )
        )

    def compress_block(self, at: torch.Tensor) -> None:
        """Every layer: encode the first COMPRESS_BLOCK rows of the 16-bit buffer into the codes at positions
        ``at`` (device [1]) + 0.. and move the window's rows down in the buffer -- what ``_compress`` does when
        ``block_due``, with every shape fixed and no host sync (capturable).  Counters are the caller's."""
        c, n = COMPRESS_BLOCK, self.window
        idx = at + torch.arange(c, device=self.device)
        if self.paged:  # code rows -> pool rows through the device page table
            P = self.code_pages.page_rows
            idx = self.ptab[idx // P].long() * P + idx % P
        for L in self.layers:
            put_rows(L, idx, self.kc.encode(L.dk[:, :c]), self.vc.encode(L.dv[:, :c]))
            rest_k, rest_v = L.dk[:, c : c + n].clone(), L.dv[:, c : c + n].clone()
            L.dk[:, :n] = rest_k
            L.dv[:, :n] = rest_v

    def _attend_triton(self, L: Any, q: torch.Tensor, scale: float) -> torch.Tensor:
        if self.fmt.kind == "affine":
            from .affine_decode import attend_row

            return attend_row(self, L, q[:, 0], *self._dense(L))
        n = L.n_code
        dk, dv = self._dense(L)
        if self.paged:  # the pool's tensors, read through the page table
            return self._kernel_row(L, q[:, 0], (L.kp, L.kn, L.vp, L.vn, L.ks), None, dk, dv, None, self._pages_arg(n))
        views = (
            [p[:, :n] for p in L.kp],
            L.kn[:, :n],
            [p[:, :n] for p in L.vp],
            L.vn[:, :n],
            L.ks[:, :n] if L.ks is not None else None,
        )
        return self._kernel_row(L, q[:, 0], views, None, dk, dv, None)

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
        L: Any,
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

        a = self.a
        H, D = q.shape
        rep = H // a.kv_heads
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
            rep=rep,
            qjl=qjl,
            n_rows=n_rows,
            valid=valid,
            f16=q.dtype in (torch.float16, torch.bfloat16),
            pages=pages,
        )
        return out.reshape(1, H * D)

    def _affine_kernel(self) -> bool:
        from .affine_decode import kernel_ok  # affine caches: cuda_ext/affine_kv_kernels.py

        return self.fmt.kind == "affine" and kernel_ok(self)
