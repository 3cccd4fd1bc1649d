"""SSD expert streaming on torch: ``StreamedMoE`` routes like ``MoE`` and gets the routed
experts' weights from the checkpoint through ``swiftlm.experts.ExpertReader`` instead of
resident stacks.  On CUDA the reader fills pinned host buffers, and each expert is copied to
the GPU on a side stream (non-blocking), so the copy of expert j+1 overlaps the compute of
expert j; the compute stream waits on one event per expert.  The math per expert is the same
``F.linear`` calls on the same values as ``MoE``: outputs are bit-identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .model import MoE
from .model_config import Args

_TORCH = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


class H2DStats:
    """Host-to-device copies of streamed experts, timed with CUDA events."""

    def __init__(self) -> None:
        self.bytes = 0
        self.seconds = 0.0
        self._pending: list[tuple[Any, Any]] = []

    def add(self, start: Any, end: Any, nbytes: int) -> None:
        self.bytes += nbytes
        self._pending.append((start, end))
        if len(self._pending) > 512:
            self.resolve()

    def resolve(self) -> None:
        for s, e in self._pending:
            e.synchronize()
            self.seconds += s.elapsed_time(e) / 1000.0
        self._pending.clear()

    def snapshot(self) -> dict:
        self.resolve()
        return {
            "h2d_bytes": self.bytes,
            "h2d_seconds": round(self.seconds, 6),
            "h2d_bandwidth_bytes_per_s": self.bytes / self.seconds if self.seconds else 0.0,
        }


class StreamedMoE(MoE):
    def __init__(self, a: Args, reader: Any, layer: int, device: torch.device, dtype: torch.dtype):
        super().__init__(a)
        del self.w_gate, self.w_up, self.w_down
        self.reader, self.layer = reader, layer
        self.device, self.dtype = device, dtype
        self.copy_stream: Any = None
        self.h2d: H2DStats | None = None
        self.next_router: Any = None  # (gate Linear, Args) of the next MoE layer when prefetching
        stored = [reader.layout.slabs[layer][(p, "weight")][0].dtype for p in ("gate", "up", "down")]
        if any(d not in _TORCH for d in stored):
            raise RuntimeError(f"streamed experts of dtype {stored} are not supported by the torch backend")
        self.stored_dtypes = [_TORCH[d] for d in stored]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.next_router is not None:  # guess the next layer's experts from this layer's input
            gate, a = self.next_router
            guess = torch.topk(gate(x).float(), a.top_k, dim=-1).indices.unique().tolist()
            self.reader.hint(self.layer + 1, guess)
        return super().forward(x)

    def to_device(self) -> None:
        """Called once the module sits on its device: a side stream and pinned buffers on CUDA."""
        if self.device.type == "cuda":
            self.copy_stream = torch.cuda.Stream(self.device)
            self.h2d = getattr(self.reader, "h2d", None) or H2DStats()
            self.reader.h2d = self.h2d

    def expert_weights(self, experts: list[int]) -> Any:
        """Yields (gate, up, down) per expert, reading ``reader.chunk`` experts at a time; within
        a chunk, expert j is handed out as soon as its own reads are done."""
        dts = self.stored_dtypes
        widen = self.copy_stream is None and self.dtype == torch.float32  # the reader threads widen bf16
        for c0 in range(0, len(experts), self.reader.chunk):
            chunk = experts[c0 : c0 + self.reader.chunk]
            if self.copy_stream is not None:
                self.copy_stream.synchronize()  # the pinned buffers' previous copies are done
            pending = self.reader.start(self.layer, chunk, float32=widen)
            if self.copy_stream is None:
                for j in range(len(chunk)):
                    w = pending.expert(j)
                    yield tuple(self._host(w[(p, "weight")], dt, widen) for p, dt in zip(("gate", "up", "down"), dts))
            else:
                yield from self._to_gpu(pending, dts, len(chunk))
            pending.result()

    @staticmethod
    def _view(t: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
        return t.view(dt) if dt == torch.bfloat16 else t

    def _host(self, arr: np.ndarray, dt: torch.dtype, widened: bool) -> torch.Tensor:
        t = torch.from_numpy(arr)
        if widened or (dt == self.dtype and dt != torch.bfloat16):
            return t  # already float32 / the model's dtype: used in place (read before the next chunk)
        return self._view(t, dt).to(self.dtype)

    def _to_gpu(self, pending: Any, dts: list, n: int) -> Any:
        """Per expert, as soon as its reads land in the pinned buffers: queue its copy on the side
        stream, make the compute stream wait for that copy only, and hand the weights out.  Reads
        (host threads), copies (copy stream) and expert matmuls (compute stream) overlap."""
        main = torch.cuda.current_stream(self.device)
        self.copy_stream.wait_stream(main)
        start = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            start.record()
        nbytes = 0
        for j in range(n):
            host = pending.expert(j)
            ws = []
            with torch.cuda.stream(self.copy_stream):
                for p, dt in zip(("gate", "up", "down"), dts):
                    src = self._view(torch.from_numpy(host[(p, "weight")]), dt)
                    nbytes += src.numel() * src.element_size()
                    dev = src.to(self.device, non_blocking=True).to(self.dtype)
                    dev.record_stream(main)
                    ws.append(dev)
                ev = torch.cuda.Event()
                ev.record()
            main.wait_event(ev)
            yield tuple(ws)
        end = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.copy_stream):
            end.record()
        self.h2d.add(start, end, nbytes)


def pinned_alloc(nbytes: int) -> np.ndarray:
    """Reader buffers in page-locked host memory (async H2D copies read from them directly)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).numpy()


def link_prefetch(model: Any) -> None:
    """Give each streamed layer the next streamed layer's router (--expert-prefetch)."""
    layers = list(model.layers)
    for cur, nxt in zip(layers, layers[1:]):
        if isinstance(cur.mlp, StreamedMoE) and isinstance(nxt.mlp, StreamedMoE):
            cur.mlp.next_router = (nxt.mlp.gate, nxt.mlp.a)
