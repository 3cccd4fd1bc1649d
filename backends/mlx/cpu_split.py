"""MLX on a CPU: every projection's output rows split over the cores.

MLX's CPU backend runs the operations of one stream one after another on that stream's thread, and its
matmul uses one core: a decode step keeps one core busy and leaves the others idle, whatever the batch.  Here
each projection (``nn.Linear``, ``nn.QuantizedLinear``, and a tied embedding's ``as_linear``, the LM head)
computes its output rows in ``n`` slices, slice 0 on the calling thread's default stream and slice i on CPU
stream i, and joins them: each output element is the same dot product over the same weights as unsplit, only
the rows are shared out, so the logits are bit-for-bit those of the unsplit model (tested).
``scripts/bench_mlx_cpu_split.py`` measures the gain per batch size.

The switch: ``SWIFTLM_MLX_CPU_SPLIT`` = the number of slices (default: the cores this process may use, at most
8; ``0`` or ``1``: off).  It applies only when MLX's default device is the CPU (Metal runs a matmul on the whole
GPU already) and not to ranks of a distributed group (each rank has its own cores); layers given a LoRA adapter
keep their own class (``lora.py``) and are not split.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import mlx.core as mx
import mlx.nn as nn

log = logging.getLogger(__name__)

MAX_SLICES = 8
_LOCAL = threading.local()  # per thread: its CPU streams 1..n-1 (MLX streams belong to the thread that made them)


def slices_wanted() -> int:
    """How many slices: ``SWIFTLM_MLX_CPU_SPLIT`` or the usable cores (at most MAX_SLICES)."""
    env = os.environ.get("SWIFTLM_MLX_CPU_SPLIT", "").strip()
    if env:
        try:
            return max(0, int(env))
        except ValueError:
            log.warning("SWIFTLM_MLX_CPU_SPLIT=%r is not a number; splitting off", env)
            return 0
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return min(cores, MAX_SLICES)


def _streams(n: int) -> list[Any]:
    """None (slice 0: the caller's default stream) and this thread's CPU streams for slices 1..n-1."""
    own = getattr(_LOCAL, "streams", None)
    if own is None:
        own = _LOCAL.streams = []
    while len(own) < n - 1:
        own.append(mx.new_stream(mx.cpu))
    return [None] + own[: n - 1]


def _cuts(rows: int, n: int) -> list[int]:
    return [rows * i // n for i in range(n + 1)]


def _join(parts: list[mx.array]) -> mx.array:
    return mx.concatenate(parts, axis=-1)


def split_matmul(x: mx.array, w: mx.array, n: int) -> mx.array:
    """``x @ w.T`` with w's rows in ``n`` slices, one per CPU stream."""
    cuts = _cuts(w.shape[0], n)
    return _join([mx.matmul(x, w[a:b].T, stream=s) for s, a, b in zip(_streams(n), cuts, cuts[1:])])


def split_quantized_matmul(x: mx.array, layer: Any, n: int) -> mx.array:
    """``mx.quantized_matmul(x, layer.weight, ...)`` (transposed) with the packed rows, scales and biases of
    the output rows in ``n`` slices (quantization groups run along the input dimension, so a row slice keeps
    them whole)."""
    w, scales, biases = layer["weight"], layer["scales"], layer.get("biases")
    cuts = _cuts(w.shape[0], n)
    kw = {"transpose": True, "group_size": layer.group_size, "bits": layer.bits, "mode": layer.mode}
    return _join(
        [
            mx.quantized_matmul(
                x, w[a:b], scales=scales[a:b], biases=None if biases is None else biases[a:b], stream=s, **kw
            )
            for s, a, b in zip(_streams(n), cuts, cuts[1:])
        ]
    )


class SplitLinear(nn.Linear):
    def __call__(self, x: mx.array) -> mx.array:
        y = split_matmul(x, self["weight"], self._swiftlm_slices)
        return y + self["bias"] if "bias" in self else y


class SplitQuantizedLinear(nn.QuantizedLinear):
    def __call__(self, x: mx.array) -> mx.array:
        y = split_quantized_matmul(x, self, self._swiftlm_slices)
        return y + self["bias"] if "bias" in self else y


class SplitEmbedding(nn.Embedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return split_matmul(x, self["weight"], self._swiftlm_slices)


class SplitQuantizedEmbedding(nn.QuantizedEmbedding):
    def as_linear(self, x: mx.array) -> mx.array:
        return split_quantized_matmul(x, self, self._swiftlm_slices)


_SWAP = {
    nn.Linear: SplitLinear,
    nn.QuantizedLinear: SplitQuantizedLinear,
    nn.Embedding: SplitEmbedding,
    nn.QuantizedEmbedding: SplitQuantizedEmbedding,
}
_PLAIN = {split: plain for plain, split in _SWAP.items()}


def plain_type(layer: Any) -> type:
    """The class a layer had before ``split_projections`` (its own class when not split)."""
    return _PLAIN.get(type(layer), type(layer))


def unsplit(layer: Any) -> Any:
    """Give a split layer its plain class back (its weights never changed); other layers are left as they are."""
    layer.__class__ = plain_type(layer)
    return layer


def split_projections(module: nn.Module, n: int | None = None) -> int:
    """Swap the class of every plain projection in ``module`` for its split twin (weights, names and
    ``isinstance`` unchanged) when MLX's default device is the CPU.  Returns the number of layers swapped."""
    n = slices_wanted() if n is None else n
    if n < 2 or mx.default_device().type != mx.DeviceType.cpu:
        return 0
    swapped = 0
    for _, layer in module.named_modules():
        new = _SWAP.get(type(layer))
        if new is None:
            continue
        rows = layer["weight"].shape[0]
        if rows < n:
            continue
        layer.__class__ = new
        layer._swiftlm_slices = n
        swapped += 1
    if swapped:
        log.info("MLX on the CPU: %d projections split over %d streams (SWIFTLM_MLX_CPU_SPLIT)", swapped, n)
    return swapped
