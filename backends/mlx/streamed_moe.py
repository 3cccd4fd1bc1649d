"""SSD expert streaming on MLX: each MoE layer's ``switch_mlp`` (mlx-lm's ``SwitchGLU``) is
replaced by ``StreamedSwitchGLU``, which reads the routed experts' slabs from the checkpoint
(``swiftlm.experts.ExpertReader``) and runs the same ``gather_mm`` / ``gather_qmm`` as mlx-lm
on a stack of just those experts, with the indices remapped into it.  Every output row is the
same matrix product over the same bytes, so logits are bit-identical to the in-memory model
(tests/test_expert_streaming.py).  The model is loaded lazily and the expert arrays are
dropped before anything is evaluated: expert bytes are never read at load time.
"""

from __future__ import annotations

import logging
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from swiftlm.experts import ExpertLayout, ExpertReader, clamp_top_k

log = logging.getLogger(__name__)

_TOPK_ATTRS = ("top_k", "num_experts_per_tok")


def _module_at(root: Any, dotted: str) -> Any:
    m = root
    for part in dotted.split("."):
        m = m[int(part)] if part.isdigit() else getattr(m, part)
    return m


def _sort(x: mx.array, indices: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    m = indices.shape[-1]
    flat = indices.flatten()
    order = mx.argsort(flat)
    return x.flatten(0, -3)[order // m], flat[order], mx.argsort(order)


class _Ref:
    """Holds a module without making it a child (mlx would walk its parameters twice)."""

    def __init__(self, obj: Any):
        self.obj = obj


class StreamedSwitchGLU(nn.Module):
    """Drop-in for ``SwitchGLU(x, indices)`` with the expert weights on disk."""

    def __init__(self, reader: ExpertReader, layer: int, original: Any, float_dtype: Any | None):
        super().__init__()
        self._reader, self._layer = reader, layer
        self._activation = original.activation
        gp = original.gate_proj
        self._quant = (
            {"group_size": gp.group_size, "bits": gp.bits, "mode": getattr(gp, "mode", "affine")}
            if hasattr(gp, "scales")
            else None
        )
        self._float_dtype = float_dtype
        self._num_experts = reader.layout.num_experts
        self._next: _Ref | None = None  # the next MoE block (its router guesses for prefetch)

    def _weights(self, experts: np.ndarray) -> dict[str, tuple[mx.array, ...]]:
        widen = self._float_dtype == mx.float32  # the reader threads widen bf16 to fp32 (exact)
        raw = self._reader.read(self._layer, experts, float32=widen)
        out: dict[str, tuple[mx.array, ...]] = {}
        for proj in ("gate", "up", "down"):
            arrs = []
            for comp in ("weight", "scales", "biases") if self._quant else ("weight",):
                a = raw.get((proj, comp))
                if a is None:
                    arrs.append(None)
                    continue
                m = mx.array(a)  # a copy: the reader's buffers are reused by the next read
                if a.dtype == np.uint16:  # the reader hands bf16 out as its bits
                    m = m.view(mx.bfloat16)
                if (
                    self._float_dtype is not None
                    and mx.issubdtype(m.dtype, mx.floating)
                    and m.dtype != self._float_dtype
                ):
                    m = m.astype(self._float_dtype)
                arrs.append(m)
            out[proj] = tuple(arrs)
        return out

    def _linear(self, x: mx.array, w: tuple, idx: mx.array, sort: bool) -> mx.array:
        if self._quant:
            return mx.gather_qmm(
                x, w[0], w[1], w[2], rhs_indices=idx, transpose=True, sorted_indices=sort, **self._quant
            )
        return mx.gather_mm(x, w[0].swapaxes(-1, -2), rhs_indices=idx, sorted_indices=sort)

    def _glu(self, x: mx.array, experts: np.ndarray, local: np.ndarray, sort: bool) -> mx.array:
        w = self._weights(experts)
        idx = mx.array(local)
        up = self._linear(x, w["up"], idx, sort)
        gate = self._linear(x, w["gate"], idx, sort)
        return self._linear(self._activation(up, gate), w["down"], idx, sort)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if self._next is not None:
            self._prefetch_next(x)
        host = np.array(indices)  # routing must be known to read: one sync per layer
        experts = np.unique(host)
        lut = np.zeros(self._num_experts, dtype=np.uint32)
        x = mx.expand_dims(x, (-2, -3))
        chunk = self._reader.chunk
        if len(experts) <= chunk:  # decode: one read, mlx-lm's own path
            lut[experts] = np.arange(len(experts), dtype=np.uint32)
            do_sort = host.size >= 64
            if not do_sort:
                return self._glu(x, experts, lut[host], False).squeeze(-2)
            xs, idx, inv = _sort(x, mx.array(lut[host]))
            y = self._glu(xs, experts, np.array(idx), True)
            return mx.unflatten(y[inv], 0, indices.shape).squeeze(-2)
        # more experts than the read buffers hold: rows sorted by expert, computed a chunk of
        # experts at a time (row results do not depend on which other rows share the call)
        xs, idx, inv = _sort(x, indices)
        order = np.array(idx)
        ys = []
        for c0 in range(0, len(experts), chunk):
            part = experts[c0 : c0 + chunk]
            lo, hi = np.searchsorted(order, part[0], "left"), np.searchsorted(order, part[-1], "right")
            lut[part] = np.arange(len(part), dtype=np.uint32)
            y = self._glu(xs[lo:hi], part, lut[order[lo:hi]], True)
            mx.eval(y)  # frees this chunk's weights before the next read
            ys.append(y)
        y = mx.concatenate(ys, axis=0)
        return mx.unflatten(y[inv], 0, indices.shape).squeeze(-2)

    def _prefetch_next(self, x: mx.array) -> None:
        """Guess the next MoE layer's experts from this layer's input through its router."""
        block = self._next.obj
        scores = block.gate(x.reshape(-1, x.shape[-1]))
        k = experts_per_token(block)
        guess = np.unique(np.array(mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]))
        self._reader.hint(self._layer + 1, guess)


def _moe_block(model: Any, layout: ExpertLayout, layer: int) -> Any:
    prefix = layout.module_prefix[layer]
    try:
        return _module_at(model, prefix)
    except (AttributeError, IndexError):
        # mlx-lm nests some text models one level down (e.g. language_model.model.layers)
        return _module_at(model, "language_model." + prefix)


def experts_per_token(block: Any) -> int:
    for a in _TOPK_ATTRS:
        if hasattr(block, a):
            return int(getattr(block, a))
    return 0


def set_experts_per_token(model: Any, requested: int) -> int:
    """Apply --expert-top-k (0: keep the model's) to every MoE block; returns the value in use."""
    blocks = [
        b
        for b in (getattr(layer, n, None) for layer in _layers(model) for n in ("mlp", "block_sparse_moe"))
        if b is not None and any(hasattr(b, a) for a in _TOPK_ATTRS) and hasattr(b, "switch_mlp")
    ]
    if not blocks:
        return 0
    used = clamp_top_k(requested, experts_per_token(blocks[0]))
    for b in blocks:
        for a in _TOPK_ATTRS:
            if hasattr(b, a):
                setattr(b, a, used)
    return used


def _layers(model: Any) -> list[Any]:
    for path in ("model.layers", "layers", "language_model.model.layers"):
        try:
            return list(_module_at(model, path))
        except AttributeError:
            continue
    return []


def attach(
    model: Any, layout: ExpertLayout, reader: ExpertReader, float_dtype: Any | None, prefetch: bool = False
) -> list[StreamedSwitchGLU]:
    """Replace every MoE layer's switch_mlp with a streamed one (before any evaluation)."""
    streamed = []
    for li in layout.layers:
        block = _moe_block(model, layout, li)
        s = StreamedSwitchGLU(reader, li, block.switch_mlp, float_dtype)
        block.switch_mlp = s
        streamed.append((li, block, s))
    if prefetch:
        by_layer = {li: (block, s) for li, block, s in streamed}
        for li, _block, s in streamed:
            nxt = by_layer.get(li + 1)
            if nxt is not None:
                s._next = _Ref(nxt[0])
    return [s for _, _, s in streamed]
