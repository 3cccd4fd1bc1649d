"""The sampler's common case in one call: temperature, logit bias and greedy rows, drawn by the
same inverse-CDF rule as ``swiftlm.sampler`` (the same torch operations in the same order, so the
same tokens).  On CUDA the call is a captured graph per padded batch size: one launch instead of
the ~15 separate kernel launches and host-to-device copies of the general path, each of which
released and re-took the GIL (the engine thread queued behind the HTTP loop at 64 streams).

``inputs`` is ``swiftlm.sampler.simple_inputs``' array on the device: [n, 3 + 2K] float32 =
temperature, uniform, greedy, K bias token ids, K bias values.
"""

from __future__ import annotations

import os

import numpy as np
import torch

from .staging import stager


def simple_sample(logits: torch.Tensor, inputs: torch.Tensor, greedy_rows: bool = True) -> torch.Tensor:
    """``greedy_rows`` False: no row is greedy, the argmax (one thread block per row: slow for a large
    vocabulary) is skipped."""
    K = (inputs.shape[1] - 3) // 2
    x = logits.float()
    temp, u, greedy = inputs[:, 0:1], inputs[:, 1:2], inputs[:, 2] > 0.5
    cols, vals = inputs[:, 3 : 3 + K].long(), inputs[:, 3 + K : 3 + 2 * K]
    x = x.scatter_add(1, cols, vals)  # the logit bias (padding adds 0.0 to token 0)
    cdf = torch.cumsum(torch.softmax(x / temp, dim=-1), dim=-1)
    tok = torch.searchsorted(cdf, u * cdf[:, -1:]).reshape(-1)
    V = x.shape[-1]
    tok = torch.where(tok < V, tok, V - 1)
    return torch.where(greedy, torch.argmax(x, dim=-1), tok) if greedy_rows else tok


class GraphedSampler:
    """``simple_sample`` as CUDA graphs, one per (batch size padded to a power of two, vocabulary,
    logits dtype, whether any row is greedy), sharing one memory pool.  Safe to share: every read of a
    graph's output (the ids' copy to the host, the next step's input) is queued on the stream before the
    next replay."""

    def __init__(self, device: torch.device):
        self.device = device
        self.enabled = device.type == "cuda" and os.environ.get("SWIFTLM_GRAPH_SAMPLER", "1") != "0"
        self.graphs: dict[tuple, tuple] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.enabled else None

    def __call__(self, logits: torch.Tensor, host: np.ndarray) -> torch.Tensor:
        st = stager(self.device)
        if not self.enabled:
            t = torch.from_numpy(np.ascontiguousarray(host))
            return simple_sample(logits, t if self.device.type == "cpu" else st.to_device(t), bool(host[:, 2].any()))
        B, V = logits.shape
        Bp = 1
        while Bp < B:
            Bp *= 2
        greedy_rows = bool(host[:, 2].any())  # padding rows are never read: they need no argmax
        key = (Bp, V, host.shape[1], logits.dtype, greedy_rows)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self.graphs[key] = self._capture(Bp, V, host.shape[1], logits.dtype, greedy_rows)
        g, x, inp, out = entry
        pad = np.zeros((Bp, host.shape[1]), np.float32)
        pad[:, 0], pad[:, 1], pad[:, 2] = 1.0, 0.5, 1.0  # padding rows: greedy, never read
        pad[:B] = host
        x[:B].copy_(logits)
        inp.copy_(st.to_device(torch.from_numpy(pad)))
        g.replay()
        return out[:B]

    def _capture(self, Bp: int, V: int, width: int, dtype: torch.dtype, greedy_rows: bool) -> tuple:
        x = torch.zeros((Bp, V), dtype=dtype, device=self.device)
        inp = torch.zeros((Bp, width), dtype=torch.float32, device=self.device)
        inp[:, 0] = 1.0
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up (kernel selection, workspace) off the capture
            simple_sample(x, inp, greedy_rows)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = simple_sample(x, inp, greedy_rows)
        return g, x, inp, out
