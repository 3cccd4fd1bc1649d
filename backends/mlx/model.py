"""The MLX ``Model``: mlx-lm model classes and KV caches behind the batched step protocol.

Each sequence owns an mlx-lm prompt cache.  When several sequences decode in the same step,
their caches are merged into mlx-lm ``BatchKVCache`` objects (left-padded, one per layer) and
all decode rows go through the model as one [B, 1] batch; the merged "decode group" persists
across steps and is rebuilt only when its membership changes (a sequence joins, finishes,
rolls back or needs its own cache for a prefill chunk, speculation or the prompt cache).
Prefill chunks and lone decode rows run per sequence.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from swiftlm.backend import Forward, ModelHooks, ModelInfo, StepBatch
from swiftlm.errors import UnsupportedArchitecture
from swiftlm.registry import ModelSpec
from swiftlm.turboquant.presets import KVFormat, settings_format

from .loader import load_gguf, load_hf, supported_architectures
from .ops import MLXOps

log = logging.getLogger(__name__)


class MLXModel(ModelHooks):
    def __init__(
        self, module: Any, tokenizer: Any, info: ModelInfo, kv_default: KVFormat | None = None, head_dim: int = 0
    ):
        self.module = module
        self.tokenizer = tokenizer
        self.info = info
        self.head_dim = head_dim
        self.kv_default = kv_default or KVFormat()
        self.kv_formats: dict[int, KVFormat] = {}  # per sequence, from its request (set by step())
        self.caches: dict[int, list[Any]] = {}
        self.ops = MLXOps()
        self.overlap = False  # forward() does not take StepBatch.input_ids yet
        self.group_ids: list[int] = []  # sequences whose KV lives in the decode group
        self.group_len: list[int] = []  # their positions, kept on the host (no device reads)
        self.group_cache: list[Any] | None = None
        self.expert_stream: Any = None  # swiftlm.experts.ExpertReader with --stream-experts
        # --distributed: evaluate each sequence's logits as it is built, so that every rank runs the
        # collectives (all-sums, send/recv pairs) of the step's sequences in the same order
        self.eval_each = False
        self.lora: Any = None  # lora.LoraSet with --adapter: per-request LoRA adapters (selected in forward)

    def _make_cache(self, fmt: KVFormat | None = None) -> list[Any]:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        fmt = fmt or KVFormat()
        if fmt.kind == "turbo":
            from .turbo_cache import install_attention_hook, make_turbo_cache

            install_attention_hook(self.module)
            return make_turbo_cache(self.module, fmt, self.head_dim)
        if fmt.kind == "affine":  # mlx-lm's quantized cache (its attention uses mx.quantized_matmul)
            from swiftlm.turboquant.presets import effective_group

            group = effective_group(self.head_dim, fmt.group_size)
            if group is None:
                log.warning(
                    "kv_bits: head_dim %d is not a multiple of 32 (MLX's smallest quantization group); "
                    "this sequence keeps a 16-bit cache",
                    self.head_dim,
                )
                return make_prompt_cache(self.module)
            if mx.default_device().type == mx.DeviceType.cpu:  # decode rows through the numba kernel (affine_cpu.py)
                from .affine_cpu import prepare
                from .turbo_cache import install_attention_hook

                install_attention_hook(self.module)
                prepare(self.module, self.head_dim, fmt.key_bits, group)
            return [QuantizedKVCache(group_size=group, bits=fmt.key_bits) for _ in self.module.layers]
        return make_prompt_cache(self.module)

    # ---------------------------------------------------------------- decode group
    def _ungroup(self) -> None:
        """Give every member its own cache back (a copy of its rows of the batch caches)."""
        if self.group_cache is None:
            return
        for j, sid in enumerate(self.group_ids):
            self.caches[sid] = [bc.extract(j) for bc in self.group_cache]
        self.group_ids, self.group_len, self.group_cache = [], [], None

    def _batchable(self, sid: int) -> bool:
        cache = self.caches.get(sid)
        return bool(cache) and all(type(c).__name__ == "KVCache" and c.keys is not None for c in cache)

    def _decode_batch(self, work: list[Any]) -> mx.array:
        """Logits [B, V] for the decode rows ``work`` (in this order) through the decode group."""
        from mlx_lm.models.cache import BatchKVCache

        ids = [w.seq_id for w in work]
        if ids != self.group_ids:
            self._ungroup()
            for w in work:
                self._cache_for(w.seq_id, w.start_pos)  # trims a rolled-back cache
            layers = len(self.caches[ids[0]])
            self.group_cache = [BatchKVCache.merge([self.caches[sid][i] for sid in ids]) for i in range(layers)]
            self.group_ids = ids
            self.group_len = [self.caches.pop(sid)[0].offset for sid in ids]
        x = mx.array([[w.tokens[0]] for w in work], dtype=mx.int32)
        self.group_len = [n + 1 for n in self.group_len]
        if self.lora is not None:  # each row its request's adapter (0: the base, its output untouched)
            with self.lora.rows([self._aid(w) for w in work]):
                return self.module(x, cache=self.group_cache)[:, -1, :]
        return self.module(x, cache=self.group_cache)[:, -1, :]

    def _aid(self, w: Any) -> int:
        """The LoRA adapter index of a step's sequence (0: none); the engine refuses unknown names."""
        name = getattr(w.params, "adapter", None)
        return self.lora.index(name) if name and self.lora is not None else 0

    def _cache_for(self, seq_id: int, start_pos: int) -> list[Any]:
        if seq_id in self.group_ids:
            self._ungroup()
        cache = self.caches.get(seq_id)
        if cache is None:
            cache = self.caches[seq_id] = self._make_cache(self.kv_formats.get(seq_id, self.kv_default))
        offset = cache[0].offset if cache else 0
        if offset > start_pos:  # recompute after preemption / rollback: drop the extra positions
            for c in cache:
                c.trim(offset - start_pos)
        elif offset < start_pos:
            raise RuntimeError(f"sequence {seq_id}: KV cache holds {offset} positions, step starts at {start_pos}")
        return cache

    def _feed(self, seq_id: int, tokens: list[int], start_pos: int) -> mx.array:
        cache = self._cache_for(seq_id, start_pos)
        return self.module(mx.array([tokens], dtype=mx.int32), cache=cache)

    def logits(self, seq_id: int, tokens: list[int], start_pos: int, adapter: int = 0) -> mx.array:
        """Feed ``tokens`` and return the last position's logits (1-D).

        Like mlx-lm, a multi-token chunk is fed as ``tokens[:-1]`` evaluating only the
        KV state (so the lazy graph never computes the LM head for those positions),
        then the last token alone.  ``adapter``: a LoRA adapter's index (lora.py), 0 the base."""
        if adapter:
            with self.lora.rows(single=adapter):
                return self.logits(seq_id, tokens, start_pos)
        if len(tokens) > 1:
            self._feed(seq_id, tokens[:-1], start_pos)
            _eval_cache(self.caches[seq_id])
            start_pos += len(tokens) - 1
            tokens = tokens[-1:]
        return self._feed(seq_id, tokens, start_pos)[0, -1]

    def hidden_states(self, prompts: list[list[int]]) -> list[Any]:
        """Each prompt's final-norm hidden states [T, hidden] as float32 numpy (embeddings), one
        forward per prompt with no cache (mlx-lm's inner ``model`` returns the normed states)."""
        import numpy as np

        inner = getattr(self.module, "model", None)
        if inner is None:
            raise NotImplementedError(f"{type(self.module).__name__} exposes no hidden states for embeddings")
        out = []
        for toks in prompts:
            h = inner(mx.array([toks], dtype=mx.int32))[0].astype(mx.float32)
            mx.eval(h)
            out.append(np.array(h))
        return out

    def score(self, seq_id: int, tokens: list[int], start_pos: int, pad_to: int | None = None) -> mx.array:
        """Every fed position's logits [len(tokens), vocab] (speculative verification)."""
        out = self._feed(seq_id, tokens, start_pos)[0]
        mx.eval(out)
        return out

    def forward(self, batch: StepBatch) -> Forward:
        """Logits [n_sample, V] (lazy) in batch order: decode rows of several sequences through
        the decode group in one [B, 1] forward; prefill chunks and lone rows per sequence."""
        for w in batch.seqs:
            if w.seq_id not in self.caches and w.seq_id not in self.group_ids:
                self.kv_formats[w.seq_id] = self.kv_default if w.kv_format is None else w.kv_format
        decode = [w for w in batch.seqs if w.sample and len(w.tokens) == 1]
        rows: dict[int, int] = {}
        batched = None
        if (
            len(decode) > 1
            and all(w.seq_id in self.group_ids or self._batchable(w.seq_id) for w in decode)
            and all(self._pos(w.seq_id) == w.start_pos for w in decode)
        ):
            batched = self._decode_batch(decode)
            rows = {w.seq_id: j for j, w in enumerate(decode)}
        out: list[mx.array] = []
        for w in batch.seqs:
            j = rows.get(w.seq_id)
            if j is not None:
                out.append(batched[j])
                continue
            aid = self._aid(w) if self.lora is not None else 0
            if not w.sample:
                if aid:
                    with self.lora.rows(single=aid):
                        self._feed(w.seq_id, w.tokens, w.start_pos)
                else:
                    self._feed(w.seq_id, w.tokens, w.start_pos)
                _eval_cache(self.caches[w.seq_id])
                continue
            out.append(self.logits(w.seq_id, w.tokens, w.start_pos, adapter=aid))
            if self.eval_each:
                mx.eval(out[-1])
        sample = [w.seq_id for w in batch.seqs if w.sample]
        if batched is not None and sample == [w.seq_id for w in decode]:
            return Forward(batched)
        return Forward(mx.stack(out) if out else None)

    def _pos(self, seq_id: int) -> int:
        """Positions held for a sequence (in the group or its own cache, minus a pipelined step)."""
        if seq_id in self.group_ids:
            return self.group_len[self.group_ids.index(seq_id)]
        cache = self.caches.get(seq_id)
        return cache[0].offset if cache else 0

    # ---------------------------------------------------------------- prompt cache hooks
    def snapshot_prefix(self, seq_id: int) -> tuple[Any, int, int] | None:
        """(per-layer (keys, values) up to the offset, bytes, positions); plain KV caches only."""
        if seq_id in self.group_ids:
            self._ungroup()
        cache = self.caches.get(seq_id)
        if not cache or any(type(c).__name__ != "KVCache" or c.keys is None for c in cache):
            return None
        n = cache[0].offset
        payload = [(c.keys[..., :n, :], c.values[..., :n, :]) for c in cache]
        mx.eval(payload)
        return payload, sum(k.nbytes + v.nbytes for k, v in payload), n

    def restore_prefix(self, seq_id: int, payload: Any, n: int) -> None:
        """Start ``seq_id`` from the first ``n`` cached positions.  MLX arrays are immutable
        (a cache update makes a new array), so the entry is never modified through this one."""
        if seq_id in self.group_ids:
            self._ungroup()
        cache = self._make_cache(KVFormat())
        for c, (k, v) in zip(cache, payload):
            c.keys, c.values, c.offset = k[..., :n, :], v[..., :n, :], n
        self.caches[seq_id] = cache

    def free(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            if s in self.group_ids:  # drop its row; the others keep decoding as a group
                keep = [j for j, g in enumerate(self.group_ids) if g != s]
                if keep:
                    for bc in self.group_cache:
                        bc.filter(keep)
                    self.group_ids = [self.group_ids[j] for j in keep]
                    self.group_len = [self.group_len[j] for j in keep]
                else:
                    self.group_ids, self.group_len, self.group_cache = [], [], None
            self.caches.pop(s, None)
            self.kv_formats.pop(s, None)

    def kv_stats(self) -> dict[str, int]:
        """KV storage held by the running sequences (all cache arrays) and the 16-bit equivalent."""
        per_tok16 = self.info.kv_bytes_per_token // (4 if self.info.kv_bytes_per_token and _f32() else 2) * 2
        held = fp16 = 0
        caches = list(self.caches.values())
        if self.group_cache is not None:
            caches.append(self.group_cache)
            fp16 += sum(self.group_len) * per_tok16
        for cache in caches:
            held += sum(_arrays_nbytes(c) for c in cache)
            if cache is not self.group_cache and cache:
                fp16 += cache[0].offset * per_tok16
        return {"bytes": held, "fp16_bytes": fp16}

    def memory(self) -> dict[str, Any]:
        return allocator_memory(self.info.weight_bytes)

    def reset_peak_memory(self) -> None:
        mx.reset_peak_memory()


def allocator_memory(weight_bytes: int) -> dict[str, Any]:
    """MLX's allocator, as SwiftLM reports it: active (in live arrays), peak, cache (freed
    buffers kept for reuse); on Metal the device's name, architecture and memory size from
    mx.device_info().  Plus the weights held."""
    from swiftlm.memory import cpu_name, system_memory

    try:
        di = mx.device_info()
    except Exception:  # older MLX: Metal only
        di = mx.metal.device_info() if mx.metal.is_available() else {}
    gpu = mx.default_device().type == mx.DeviceType.gpu
    return {
        "device": "metal" if gpu else "cpu",
        "architecture": str(di.get("architecture", "")) if gpu else "cpu",
        "device_name": str(di.get("device_name") or (cpu_name() if not gpu else "")),
        "active": mx.get_active_memory(),
        "peak": mx.get_peak_memory(),
        "cache": mx.get_cache_memory(),
        "device_total": int(di.get("memory_size") or system_memory()),
        "weights": weight_bytes,
    }


def _f32() -> bool:
    return mx.default_device().type == mx.DeviceType.cpu


def _arrays(c: Any) -> list[mx.array]:
    try:
        return [x for _, x in tree_flatten(c.state) if isinstance(x, mx.array)]
    except (AttributeError, TypeError):  # an mlx-lm cache with nothing written yet
        return []


def _arrays_nbytes(c: Any) -> int:
    return sum(x.nbytes for x in _arrays(c))


def _eval_cache(cache: list[Any]) -> None:
    mx.eval([x for c in cache for x in _arrays(c)])


def load_model(spec: ModelSpec, cfg: Any) -> MLXModel:
    reader = None
    shard = None
    if getattr(cfg, "distributed", False):  # one rank of an mlx.launch group: load only this rank's part
        from .distributed import shard_module

        shard = shard_module(spec, cfg)
    if spec.format == "gguf":
        if getattr(cfg, "stream_experts", False):
            from swiftlm.memory import streamable_layout

            streamable_layout(spec)  # raises: GGUF experts are not streamed
        module, tokenizer, config = load_gguf(spec, shard=shard)
    else:
        if spec.arch not in supported_architectures():
            raise UnsupportedArchitecture(
                f"architecture {spec.arch!r} is not supported by the mlx backend (mlx-lm {_mlx_lm_version()}); "
                f"supported: {', '.join(sorted(supported_architectures()))}"
            )
        module, tokenizer, config, reader = load_hf(spec, cfg, shard=shard)
    _apply_mem_limit(cfg)
    if shard is None:  # MLX on a CPU: projections' rows over the cores (cpu_split.py; not for mlx.launch ranks)
        from .cpu_split import split_projections

        split_projections(module)
    k_used = 0
    if spec.is_moe:
        from .streamed_moe import set_experts_per_token

        k_used = set_experts_per_token(module, int(getattr(cfg, "expert_top_k", 0) or 0))
    n_layers = int(config.get("num_hidden_layers") or len(getattr(module, "layers", [])))
    heads = int(config.get("num_attention_heads") or 1)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or (int(config.get("hidden_size", 0)) // heads))
    weight_bytes = sum(v.nbytes for _, v in tree_flatten(module.parameters()))
    dt_bytes = 4 if mx.default_device().type == mx.DeviceType.cpu else 2
    ctx = int(cfg.ctx_size or spec.context_length or 4096) if cfg is not None else int(spec.context_length or 4096)
    info = ModelInfo(
        arch=spec.arch,
        num_layers=n_layers,
        context_length=min(ctx, spec.context_length or ctx),
        vocab_size=int(config.get("vocab_size") or tokenizer.vocab_size),
        num_params=spec.num_params,
        quantization=spec.quantization,
        is_moe=spec.is_moe,
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * n_layers * kv_heads * head_dim * dt_bytes,
        streamed_expert_bytes=reader.layout.expert_bytes_total if reader else 0,
        experts_per_token=k_used,
    )
    model = MLXModel(module, tokenizer, info, kv_default=settings_format(cfg), head_dim=head_dim)
    model.expert_stream = reader
    adapters = list(getattr(cfg, "adapter", None) or [])
    if adapters:  # --adapter NAME=PATH: LoRA adapters served on this base, chosen per request (lora.py)
        if shard is not None:
            from swiftlm.errors import ConfigError

            raise ConfigError("--adapter is not supported with --distributed on the mlx backend")
        from .lora import attach

        model.lora = attach(module, adapters)
        log.info("LoRA adapters: %s", ", ".join(model.lora.names))
    if shard is not None:
        from .distributed import per_rank_kv

        per_rank_kv(model, shard)
    return model


def _apply_mem_limit(cfg: Any) -> None:
    limit = getattr(cfg, "mem_limit", None)
    if limit:
        from swiftlm.config import parse_bytes

        mx.set_memory_limit(parse_bytes(limit))


def _mlx_lm_version() -> str:
    from importlib.metadata import version

    return version("mlx-lm")
