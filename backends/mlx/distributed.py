"""MLX distributed (``--distributed``): this process is one rank of an ``mx.distributed`` group that
``mlx.launch`` started (ring, JACCL or MPI); the model is split with mlx-lm's own sharding.

- *tensor*: the architecture's ``Model.shard(group)`` (mlx-lm): Q/K/V, gate and up projections
  split by output rows, O and down projections by input columns with an all-sum, so every layer's
  output -- and the logits (embedding, final norm and LM head are not split) -- is whole on every
  rank.  Needs the attention and KV head counts divisible by the ranks.
- *pipeline*: ``model.model.pipeline(group)`` (mlx-lm's ``PipelineMixin``): contiguous layers per
  rank, activations sent rank to rank, the last hidden state all-gathered, so again the logits
  are whole on every rank.

Rank 0 samples from its logits; the other ranks only have to run the same graphs in the same
order.  MLX is lazy: a graph nobody evaluates never runs its collectives, so a follower evaluates
every result of the calls rank 0 sends (``follower_model``) -- rank 0's engine evaluates the same
arrays when it samples.

The core (``swiftlm.distributed.external``) reaches this module through two backend hooks,
``MLXBackend.join_distributed`` and ``MLXBackend.check_distributed``, and through ``load``
(which shards when ``cfg.distributed`` is on).
"""

from __future__ import annotations

import json
import logging
import os
import pkgutil
import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

import mlx.core as mx

from swiftlm.errors import ConfigError
from swiftlm.registry import ModelSpec

log = logging.getLogger(__name__)

SHARE_BYTES = 4096  # the largest message rank 0 shares with the others at start-up (its control address)


@lru_cache(maxsize=1)
def sharding_support() -> dict[str, tuple[bool, bool]]:
    """mlx-lm model type -> (tensor, pipeline): which architectures have ``Model.shard`` and which a
    ``pipeline`` (PipelineMixin), read from the installed mlx-lm's sources (no module is imported)."""
    import mlx_lm.models

    out: dict[str, tuple[bool, bool]] = {}
    for m in pkgutil.iter_modules(mlx_lm.models.__path__):
        try:
            text = (Path(mlx_lm.models.__path__[0]) / f"{m.name}.py").read_text()
        except OSError:
            continue
        tensor = bool(re.search(r"^    def shard\(", text, re.M))
        pipe = "PipelineMixin" in text and m.name != "pipeline"
        if tensor or pipe:
            out[m.name] = (tensor, pipe)
    return out


def _model_type(spec: ModelSpec) -> str:
    if spec.format == "gguf":
        return "llama"  # the only GGUF architecture the mlx backend reads (loader.GGUF_ARCHITECTURES)
    cfg = spec.config or {}
    from mlx_lm.utils import MODEL_REMAPPING

    mt = str(cfg.get("model_type") or spec.arch)
    return MODEL_REMAPPING.get(mt, mt)


def choose_sharding(spec: ModelSpec, mode: str, size: int | None = None) -> str:
    """'tensor' or 'pipeline' for this model over ``size`` ranks, or a ConfigError in one sentence.
    ``size=None``: only whether the architecture can be split at all (before the ranks are known)."""
    mt = _model_type(spec)
    tensor, pipe = sharding_support().get(mt, (False, False))
    if not tensor and not pipe:
        have = sorted(sharding_support())
        raise ConfigError(
            f"--distributed: mlx-lm {_version()} has no tensor or pipeline sharding for architecture "
            f"{mt!r}; architectures it can split: {', '.join(have)}"
        )
    kind = mode if mode != "auto" else ("tensor" if tensor else "pipeline")
    if kind == "tensor" and not tensor:
        raise ConfigError(
            f"--distributed-sharding tensor: mlx-lm has no tensor sharding for {mt!r} (it has "
            "pipeline sharding: use --distributed-sharding pipeline or auto)"
        )
    if kind == "pipeline" and not pipe:
        raise ConfigError(
            f"--distributed-sharding pipeline: mlx-lm has no pipeline sharding for {mt!r} (it has "
            "tensor sharding: use --distributed-sharding tensor or auto)"
        )
    if size is None:
        return kind
    cfg = spec.config or {}
    if kind == "tensor":
        heads = int(cfg.get("num_attention_heads") or 0)
        kv = int(cfg.get("num_key_value_heads") or heads)
        if heads and (heads % size or kv % size):
            raise ConfigError(
                f"--distributed: tensor sharding over {size} ranks needs the attention heads ({heads}) "
                f"and KV heads ({kv}) divisible by {size}; use a rank count that divides both"
            )
    else:
        layers = int(cfg.get("num_hidden_layers") or 0)
        if layers and layers < size:
            raise ConfigError(
                f"--distributed: pipeline sharding over {size} ranks needs at least {size} layers "
                f"(the model has {layers})"
            )
    return kind


def check(spec: ModelSpec, settings: Any, size: int | None = None) -> str:
    """The backend hook ``check_distributed``: refuse what cannot be split, before any load."""
    if spec.vision or spec.audio:
        raise ConfigError("--distributed does not support vision / audio models yet")
    if getattr(settings, "stream_experts", False):
        raise ConfigError("--stream-experts cannot be combined with --distributed yet")
    return choose_sharding(spec, getattr(settings, "distributed_sharding", "auto"), size)


@dataclass
class MLXRanks:
    """This process's place in the ``mx.distributed`` group, as ``swiftlm.distributed.external`` uses it."""

    group: Any
    rank: int
    size: int
    leader_host: str  # the address of rank 0 that the other ranks can reach

    def share(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None): one all-sum over the launcher's
        own channel, in which the other ranks add zeros."""
        import numpy as np

        buf = np.zeros(SHARE_BYTES + 1, dtype=np.int32)
        if self.rank == 0:
            raw = data or b""
            if len(raw) > SHARE_BYTES:
                raise ValueError(f"distributed start-up message of {len(raw)} bytes is over {SHARE_BYTES}")
            buf[0] = len(raw)
            buf[1 : 1 + len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        out = mx.distributed.all_sum(mx.array(buf), group=self.group, stream=mx.cpu)
        got = np.array(out)
        return bytes(got[1 : 1 + int(got[0])].astype(np.uint8))

    def follower_model(self, model: Any) -> Any:
        return EvaluatingModel(model)


_ranks: MLXRanks | None = None


def join(settings: Any) -> MLXRanks:
    """Join (once per process) the group ``mlx.launch`` set up through the environment."""
    global _ranks
    if _ranks is None:
        try:
            group = mx.distributed.init()
        except Exception as exc:  # e.g. a malformed MLX_HOSTFILE, or a peer that never came up
            raise ConfigError(f"--distributed: mx.distributed.init() failed: {exc}") from None
        _ranks = MLXRanks(group, group.rank(), group.size(), leader_host(settings))
    return _ranks


def leader_host(settings: Any) -> str:
    """Rank 0's address for the control connection: --master-addr when given; else rank 0's IP in
    the ring hostfile (MLX_HOSTFILE) or the JACCL coordinator (MLX_JACCL_COORDINATOR), which the
    other ranks reach already; else loopback."""
    if "master_addr" in getattr(settings, "model_fields_set", ()) and settings.master_addr:
        return str(settings.master_addr)
    coord = os.environ.get("MLX_JACCL_COORDINATOR")
    if coord:
        return coord.rsplit(":", 1)[0]
    path = os.environ.get("MLX_HOSTFILE")
    if path:
        try:
            hosts = json.loads(Path(path).read_text() or "[]")
            first = hosts[0][0] if isinstance(hosts[0], list) else hosts[0]
            return str(first).rsplit(":", 1)[0]
        except (OSError, ValueError, IndexError, TypeError):
            pass
    return str(getattr(settings, "master_addr", None) or "127.0.0.1")


def shard_module(spec: ModelSpec, settings: Any) -> Callable[[Any], None] | None:
    """The function that splits a freshly built (not yet evaluated) mlx-lm model for this rank."""
    if not getattr(settings, "distributed", False):
        return None
    ranks = join(settings)
    kind = check(spec, settings, ranks.size)

    def apply(module: Any) -> None:
        if kind == "tensor":
            module.shard(ranks.group)
        else:
            module.model.pipeline(ranks.group)
        log.info("rank %d/%d: %s-sharded %s", ranks.rank, ranks.size, kind, spec.name)

    apply.kind = kind  # type: ignore[attr-defined]
    apply.ranks = ranks  # type: ignore[attr-defined]
    return apply


def per_rank_kv(model: Any, shard: Any) -> None:
    """KV bytes per token that this rank holds: its heads (tensor) or its layers (pipeline)."""
    n = shard.ranks.size
    model.eval_each = True  # the same collective order on every rank, whatever order the engine evaluates in
    if shard.kind == "tensor":
        model.info.kv_bytes_per_token //= n
    else:
        inner = model.module.model
        local = len(inner.layers) - inner.start_idx
        model.info.kv_bytes_per_token = model.info.kv_bytes_per_token * local // max(1, model.info.num_layers)


class EvaluatingModel:
    """A follower's view of its ``MLXModel``: every call's array results are evaluated at once, so
    that the collectives in them run (rank 0 evaluates the same graphs when it samples)."""

    def __init__(self, model: Any):
        self._model = model

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._model, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kw: Any) -> Any:
            out = attr(*args, **kw)
            arrays = _arrays_in(out)
            if arrays:
                mx.eval(arrays)
            return out

        return call


def _arrays_in(out: Any) -> list[Any]:
    if isinstance(out, mx.array):
        return [out]
    if hasattr(out, "logits"):  # swiftlm.backend.Forward
        return _arrays_in(out.logits)
    if isinstance(out, (list, tuple)):
        return [a for x in out for a in _arrays_in(x)]
    return []


def _version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")
