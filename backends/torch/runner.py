"""The torch ``Model``: our transformer + per-sequence KV caches behind the batched step."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Sequence
from contextlib import nullcontext
from typing import Any

import torch

from swiftlm.backend import Forward, ModelHooks, ModelInfo, StepBatch
from swiftlm.errors import UnsupportedArchitecture
from swiftlm.registry import ModelSpec
from swiftlm.turboquant.presets import KVFormat, settings_format

from . import cpu_kernels
from .build import build, tokenizer_and_info
from .code_pages import CodePages
from .compressed_cache import CompressedCache, StageBudget
from .decode_rows import decode_batch
from .devices import (  # noqa: F401 (re-exported)
    CUDA_DEFAULT_CTX,
    _apply_mem_limit,
    bind_thread,
    code_pool_pages,
    cuda_eager_reason,
    kv_pool_size,
    pick_device,
    stage_bytes,
)
from .graphs import GraphDecoder, graphable
from .kv_accounting import KVAccounting
from .kv_fp8 import FP8, check_kv_cache_dtype, checkpoint_scales, describe, kv_storage_dtype
from .kv_pool import PagedSeqCache, SlotPool
from .loader import check_arch, load_state
from .ops import TorchOps
from .packed_attention import prefill_attention
from .packed_steps import PackedSteps, PromptChunks, packed_hidden_states
from .prefill_graphs import PackedGraphs
from .prefix_hooks import PrefixCopies
from .seq_caches import SeqCaches, adapter_rows, static_turbo, warm_up_waves

log = logging.getLogger(__name__)


class TorchModel(ModelHooks):
    """On CUDA, each running sequence holds a fixed-capacity cache slot from a pool (slots are
    reused, so their CUDA graphs are captured once) and dense models decode by graph replay.
    On CPU, caches grow on demand and every step runs eagerly.

    Its parts: ``seqs`` (each sequence's KV cache, seq_caches.py), ``prefix`` (KV rows handed between
    sequences, prefix_hooks.py), ``kv`` (memory figures, kv_accounting.py) and ``packed`` (packed prompt
    steps, packed_steps.py).  Each is built on first use from the fields ``__init__`` sets (``module``,
    ``device``, ``dtype``, ``info``, ``kv_default``, ``caches``, ``kv_formats``, ``static``, ``pool``,
    ``graphs``...): a pipeline stage (pipeline.py) sets those fields in its own ``__init__``."""

    kv_fp8: Any = None  # --kv-cache-dtype fp8: kv_fp8.KVScales (K/V stored as e4m3), else None
    prefill_graphs: PackedGraphs | None = None  # short first prompt chunks: a graph per token bucket
    mixed_graphs: PackedGraphs | None = None  # decode rows and first prompt chunks: a graph per token bucket
    packed_weight_bytes = 0  # cpu_packed.py's second copy of the weights

    def __init__(
        self,
        module: Any,
        tokenizer: Any,
        info: ModelInfo,
        device: torch.device,
        dtype: torch.dtype,
        use_graphs: bool | None = None,
        slots: int = 1,
        kv_default: KVFormat | None = None,
        block_size: int | None = None,
        num_blocks: int | None = None,
        code_pages: int = 0,
        kv_fp8: Any = None,
    ):
        self.module, self.tokenizer, self.info = module, tokenizer, info
        self.kv_fp8 = kv_fp8
        self.kv_default = kv_default or KVFormat()
        self.kv_formats: dict[int, KVFormat] = {}  # per sequence, from its request (set by step())
        self.caches: dict[int, Any] = {}
        self.device, self.dtype = device, dtype
        if device.type == "cpu" and self.kv_default.compressed:  # compile the CPU kernel before the first request
            cpu_kernels.warm_up(module.a, self.kv_default, CompressedCache)
        self.ops = TorchOps(device)
        # --gpu-layers (CPU layers in the forward), archs.py / archs_moe.py layers and live sliding windows
        # (the graphs and paged attention run the llama-family layer over every key): the eager path on CUDA,
        # i.e. no slot pool, CUDA graphs or overlapped steps (cuda_eager_reason)
        self.eager_reason = cuda_eager_reason(module.a, device, info.context_length)
        self.static = device.type == "cuda" and self.eager_reason is None
        if self.eager_reason is not None and module.a.offload is None:
            log.info(
                "%s runs eagerly on CUDA (per-sequence KV caches and eager forwards; no CUDA graphs, slot pool, "
                "paged attention or overlapped steps, which run the llama-family layer over every key): %s",
                module.a.arch,
                self.eager_reason,
            )
        if use_graphs is None:
            use_graphs = self.static and graphable(module)
        self.graphs = GraphDecoder(module, device) if use_graphs else None
        # CUDA: all sequences' KV live in one paged pool per layer (kv_pool.py), so decode rows of many
        # sequences run as one batched, graphed step (graphs.decode_batch_static)
        self.pool = (
            SlotPool(
                module.a,
                slots,
                info.context_length,
                dtype,
                device,
                block_size=block_size,
                num_blocks=num_blocks,
                fp8=kv_fp8,
            )
            if self.static
            else None
        )
        # CUDA graphs + a TurboQuant server default: its static caches keep their codes in pages of one pool
        if code_pages and self.graphs is not None and static_turbo(self.kv_default, device):
            self.seqs.code_pages = CodePages(module.a, self.kv_default, code_pages, device)
        self.expert_stream: Any = None  # swiftlm.experts.ExpertReader with --stream-experts
        self.lora: Any = None  # lora.LoraSet with --adapter: per-request LoRA adapters
        # CUDA kernels run asynchronously: the engine may launch step k+1 before reading step k's ids
        self.overlap = self.static
        self.graph_capture = {"graphs": 0, "seconds": 0.0, "bytes": 0}
        if self.graphs is not None and self.pool is not None:
            self.prefill_graphs = PackedGraphs(self.graphs, self.pool)
            self.mixed_graphs = PackedGraphs(self.graphs, self.pool, rows=self.pool.n)
            if self.graphs.use_graph:
                self.graph_capture = self.packed.capture(self.graphs)

    # ---------------------------------------------------------------- parts (built from the fields above)
    @functools.cached_property
    def seqs(self) -> SeqCaches:
        return SeqCaches(
            self.module.a,
            self.device,
            self.dtype,
            self.info.context_length,
            self.kv_default,
            self.caches,
            self.kv_formats,
            static=self.static,
            pool=self.pool,
            graphed=self.graphs is not None,
            fp8=self.kv_fp8,
        )

    @functools.cached_property
    def prefix(self) -> PrefixCopies:
        # tensor / pipeline ranks (subclasses) share no forks: each rank's caches would have to follow
        return PrefixCopies(self.seqs, shareable=self._plain() and not self.static)

    @functools.cached_property
    def kv(self) -> KVAccounting:
        return KVAccounting(self.seqs, self.pool, self.info.kv_bytes_per_token, self.info.weight_bytes)

    @functools.cached_property
    def packed(self) -> PackedSteps:
        return PackedSteps(self.seqs, self.module, self.pool, self.prefill_graphs, self.mixed_graphs)

    def _plain(self) -> bool:
        """The single-process model itself (tensor / pipeline ranks subclass it and keep their own KV rules)."""
        return type(self) is TorchModel

    def _cache(self, seq_id: int, start: int) -> Any:
        return self.seqs.get(seq_id, start)

    @torch.inference_mode()
    def logits(self, seq_id: int, tokens: list[int] | torch.Tensor, start: int, adapter: int = 0) -> torch.Tensor:
        """Last position's logits; ``tokens`` may be a device tensor (overlapped decode).  ``adapter``: a
        LoRA adapter's index (lora.py), run eagerly (no CUDA graph)."""
        cache = self.seqs.get(seq_id, start)
        if len(tokens) == 1 and not adapter and isinstance(cache, CompressedCache):
            if self.graphs is not None and cache.graphable():
                return self.graphs.run_turbo(cache, tokens[0] if torch.is_tensor(tokens) else int(tokens[0]), start)
        elif len(tokens) == 1 and not adapter and self.graphs is not None:
            if isinstance(cache, PagedSeqCache):  # a pool sequence decoding alone: the batch-of-one graph
                out = self.graphs.run_batch(
                    self.pool, [cache.slot], tokens if torch.is_tensor(tokens) else [tokens[0]], [start]
                )[0]
            else:
                out = self.graphs.run(cache, tokens[0], start)
            cache.length = start + 1
            return out
        ids = tokens.long() if torch.is_tensor(tokens) else torch.tensor(tokens, dtype=torch.long, device=self.device)
        with prefill_attention(self.device, len(ids)), self.lora.rows(single=adapter) if adapter else nullcontext():
            return self.module(ids, cache, start)[-1]

    @torch.inference_mode()
    def hidden_states(self, prompts: list[list[int]]) -> list[Any]:
        """Embeddings, prompts packed into few forwards (``packed_steps.packed_hidden_states``)."""
        bind_thread(self.device)
        return packed_hidden_states(self.module, prompts, self.device)

    @torch.inference_mode()
    def score(self, seq_id: int, tokens: list[int], start: int, pad_to: int | None = None) -> torch.Tensor:
        """Feed ``tokens`` at ``start`` and return every position's logits [len(tokens), vocab]
        (speculative verification).  On CUDA the block is padded to ``pad_to`` tokens and
        replayed from a graph (the padding writes KV rows past the block, which the next step
        overwrites: rollback is by position)."""
        bind_thread(self.device)
        cache = self.seqs.get(seq_id, start)
        T = len(tokens)
        width = max(T, pad_to or T)
        if self.graphs is not None and start + width <= cache.capacity:
            out = self.graphs.verify(cache, tokens + [0] * (width - T), start)[:T]
            cache.length = start + T
            return out
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.module(ids, cache, start, last_only=False)

    @torch.inference_mode()
    def forward(self, batch: StepBatch) -> Forward:
        """Decode rows of several sequences go through one batched pass (a graph replay over the
        slot pool on CUDA, ``decode_batch`` otherwise); a lone decode row uses the per-slot CUDA
        graph (on GPU); prefill chunks run per sequence.  Logits [n_sample, V] in batch order."""
        bind_thread(self.device)
        t0 = time.perf_counter()
        self.seqs.admit(batch.seqs)
        failed: dict[int, str] = {}
        aid: dict[int, int] = {}
        if self.lora is not None or any(getattr(w.params, "adapter", None) for w in batch.seqs):
            batch, aid, failed = adapter_rows(batch, self.lora)
        batch = self.seqs.make_compressed(batch, failed)
        decode = [w for w in batch.seqs if len(w.tokens) == 1 and w.sample]
        dev = batch.input_ids  # overlapped decode: the ids are still on the device (row i: batch.seqs[i])
        rows: dict[int, torch.Tensor] = {}
        batched = None
        prep = None
        chunks = PromptChunks(self.packed, batch, aid)  # the step's packable prompt chunks, worked out on first use
        mixed = self.packed.mixed(batch, decode, aid, chunks) if dev is None and decode else None
        if mixed is not None:  # decode rows and first prompt chunks in one forward
            batched, packed = mixed
            rows = {w.seq_id: j for j, w in enumerate(decode)}
        elif len(decode) > 1:
            caches = [self.seqs.get(w.seq_id, w.start_pos) for w in decode]
            toks = dev if dev is not None else [w.tokens[0] for w in decode]
            positions = [w.start_pos for w in decode]
            prep = time.perf_counter() - t0
            adapters = [aid.get(w.seq_id, 0) for w in decode]  # adapter rows run eagerly (no CUDA graph)
            if (
                self.graphs is not None
                and all(getattr(c, "slot", None) is not None for c in caches)
                and not any(adapters)
            ):
                batched = self.graphs.run_batch(self.pool, [c.slot for c in caches], toks, positions)
                for c, p in zip(caches, positions):
                    c.length = p + 1
            elif (
                self.graphs is not None
                and self.graphs.fused
                and all(isinstance(c, CompressedCache) and c.graphable() for c in caches)
                and not any(adapters)
            ):  # weights once, each row its cache's kernels
                batched = self.graphs.run_compressed_batch(caches, toks, positions)
            else:
                with self.lora.rows(adapters, self.device) if any(adapters) else nullcontext():
                    batched = decode_batch(self.module, caches, toks, positions)
            rows = {w.seq_id: j for j, w in enumerate(decode)}
        if mixed is None:
            packed = self.packed.prefill(batch, aid, chunks) if dev is None else {}
        if dev is None:
            packed.update(self.packed.late_chunks(batch, aid, self.graphs))
        out: list[torch.Tensor] = []
        for i, w in enumerate(batch.seqs):
            j = rows.get(w.seq_id)
            if j is not None:
                out.append(batched[j])
                continue
            if w.seq_id in packed:
                logits = packed[w.seq_id]
            else:
                logits = self.logits(
                    w.seq_id,
                    dev[i : i + 1] if dev is not None else w.tokens,
                    w.start_pos,
                    **({"adapter": aid[w.seq_id]} if aid.get(w.seq_id) else {}),
                )
            if w.sample:
                out.append(logits)
        sample = [w for w in batch.seqs if w.sample]
        if (
            batched is not None
            and len(sample) == len(decode)
            and [w.seq_id for w in sample] == [w.seq_id for w in decode]
        ):
            logits = batched  # the common decode step: no copy
        else:
            logits = torch.stack(out) if out else None
        return Forward(logits, failed=failed, prepare_seconds=prep or 0.0)

    def free(self, seq_ids: Sequence[int]) -> None:
        self.seqs.free(seq_ids)

    # ---------------------------------------------------------------- ModelHooks (swiftlm/backend.py)
    def share_prefix(self, seq_id: int) -> tuple[Any, int] | None:
        return self.prefix.share(seq_id)

    def fork_from(self, seq_id: int, handle: Any, n: int) -> None:
        self.prefix.fork(seq_id, handle, n)

    def snapshot_prefix(self, seq_id: int) -> tuple[Any, int, int] | None:
        return self.prefix.snapshot(seq_id)

    def restore_prefix(self, seq_id: int, payload: Any, n: int) -> None:
        self.prefix.restore(seq_id, payload, n)

    def adopt_prefix(self, seq_id: int, n: int) -> None:
        self.prefix.adopt(seq_id, n)

    def kv_block_spec(self) -> tuple[int, int] | None:
        """None where sequences keep their own caches (CPU, eager CUDA models) and on tensor / pipeline ranks, which
        keep fixed slot runs: the leader's block decisions (prefix blocks above all) would have to reach every
        rank's pool."""
        p = self.pool
        return None if p is None or p.managed or not self._plain() else (p.num_blocks, p.block_size)

    def attach_kv_blocks(self, blocks: Any) -> None:
        self.seqs.kv_blocks = blocks
        self.pool.attach()

    def code_page_spec(self) -> tuple[int, int, Any] | None:
        """The pages of the server's TurboQuant format (the engine's second manager hands them out), or None."""
        p = self.seqs.code_pages
        return None if p is None or p.managed or not self._plain() else (p.pages, p.page_rows, p.fmt)

    def attach_code_pages(self, blocks: Any) -> None:
        self.seqs.code_blocks = blocks
        self.seqs.code_pages.attach()

    def warm_up_waves(self) -> list[list[int]]:
        graphed = self.graphs is not None and self.graphs.use_graph and self.pool is not None
        return warm_up_waves(self.kv_default, self.device, self.pool.n) if graphed else []

    def kv_stats(self) -> dict[str, int]:
        return self.kv.kv_stats()

    def reset_peak_memory(self) -> None:
        self.kv.reset_peak_memory()

    def memory(self) -> dict[str, Any]:
        return self.kv.memory(self.packed_weight_bytes)


def load_model(spec: ModelSpec, cfg: Any) -> TorchModel:
    adapters = list(getattr(cfg, "adapter", None) or [])
    if adapters and (
        int(getattr(cfg, "tensor_parallel", 1) or 1) > 1 or int(getattr(cfg, "pipeline_parallel", None) or 1) > 1
    ):
        from swiftlm.errors import ConfigError

        raise ConfigError("--adapter is not supported with --tensor-parallel or --pipeline-parallel")
    if int(getattr(cfg, "tensor_parallel", 1) or 1) > 1:  # this process is one rank (parallel.py)
        from .parallel import load_sharded

        return load_sharded(spec, cfg, TorchModel)
    if int(getattr(cfg, "pipeline_parallel", None) or 1) > 1:  # this process is one stage (pipeline.py)
        from .pipeline import load_stage

        return load_stage(spec, cfg, TorchModel)
    device, dtype = pick_device(cfg)
    bind_thread(device)
    _apply_mem_limit(cfg, device)
    kv_name = getattr(cfg, "kv_cache_dtype", "auto") if cfg is not None else "auto"
    check_kv_cache_dtype(cfg)
    reader = None
    if getattr(cfg, "stream_experts", False):
        from swiftlm.experts import ExpertReader
        from swiftlm.memory import streamable_layout

        layout = streamable_layout(spec)  # a clear error for dense models and GGUF files
        check_arch(spec)
        if layout.quantized:
            raise UnsupportedArchitecture(
                f"{spec.path} holds MLX-quantized experts, which the torch backend does "
                "not read; use the mlx backend or a 16-bit checkpoint"
            )
        alloc = None
        if device.type == "cuda":
            from .streamed_moe import pinned_alloc

            alloc = pinned_alloc
        reader = ExpertReader(
            layout,
            mode=cfg.expert_read_mode,
            workers=cfg.expert_read_threads,
            chunk=max(1, spec.experts_per_token),
            alloc=alloc,
        )
    skip = reader.layout.expert_tensors if reader else frozenset()
    config, state = load_state(spec, skip, dtype, device, getattr(cfg, "quantize", None))
    from .offload import DTYPES, offload_split

    first_cpu = offload_split(cfg, int(config.get("num_hidden_layers") or 0))
    module = build(
        config,
        state,
        dtype,
        device,
        expert_reader=reader,
        first_cpu_layer=first_cpu,
        offload_dtype=DTYPES[getattr(cfg, "offload_dtype", "float32")],
    )
    del state
    packed_bytes = 0
    if device.type == "cpu":  # fp32 matrices packed for oneDNN (cpu_packed.py): faster few-row and prefill matmuls
        from .cpu_packed import pack

        packed_bytes = pack(module)
    if reader is not None and getattr(cfg, "expert_prefetch", False):
        from .streamed_moe import link_prefetch

        link_prefetch(module)
    if module.a.experts:
        from swiftlm.experts import clamp_top_k

        module.a.top_k = clamp_top_k(int(getattr(cfg, "expert_top_k", 0) or 0), module.a.top_k)
    a = module.a
    kv_store = kv_storage_dtype(kv_name, dtype)  # what the KV rows are stored in (e4m3 with --kv-cache-dtype fp8)
    kv_scales = checkpoint_scales(spec.path, a.layers, a.kv_heads).to(device) if kv_store == FP8 else None
    log.info("KV cache: %s", describe(kv_scales) or str(kv_store)[6:])
    tokenizer, info = tokenizer_and_info(
        spec,
        cfg,
        module,
        a,
        device,
        dtype,
        kv_store,
        is_moe=bool(a.experts),
        kv_dtype=describe(kv_scales) or str(dtype)[6:],
        streamed_expert_bytes=reader.layout.expert_bytes_total if reader else 0,
        experts_per_token=a.top_k,
    )
    ctx = info.context_length
    slots = max(1, int(getattr(cfg, "parallel", 1) or 1)) if cfg is not None else 1
    if module.a.offload is not None and kv_scales is None:  # CPU layers keep their KV rows in --offload-dtype
        from .offload import kv_bytes_per_token

        info.kv_bytes_per_token = kv_bytes_per_token(a, device, dtype)
        log.info(
            "partial offload: layers 0-%d on %s, %d-%d on the CPU (%s)",
            first_cpu - 1,
            device,
            first_cpu,
            a.layers - 1,
            str(module.a.offload[2])[6:],
        )
    block_size, num_blocks = (
        kv_pool_size(cfg, a, device, kv_store, slots, ctx)
        if (device.type == "cuda" and cuda_eager_reason(a, device, ctx) is None)
        else (None, None)
    )
    stage_limit = stage_bytes(cfg, a, device, ctx, dtype)
    code_pages = 0
    if block_size is not None:  # the 16-bit pool's bytes are not allocated yet: the code pages leave them free,
        # and the staging room of prompts (held outside the pools while they prefill)
        code_pages = code_pool_pages(
            cfg, a, device, slots, ctx, taken=num_blocks * block_size * info.kv_bytes_per_token + stage_limit
        )
    model = TorchModel(
        module,
        tokenizer,
        info,
        device,
        dtype,
        slots=slots,
        kv_default=settings_format(cfg),
        block_size=block_size,
        num_blocks=num_blocks,
        code_pages=code_pages,
        kv_fp8=kv_scales,
    )
    model.expert_stream = reader
    model.seqs.stage_budget = StageBudget(stage_limit) if stage_limit else None
    model.packed_weight_bytes = packed_bytes
    if adapters:  # --adapter NAME=PATH: LoRA adapters served on this base, chosen per request (lora.py)
        from .lora import attach

        model.lora = attach(module, adapters)
        log.info("LoRA adapters: %s", ", ".join(model.lora.names))
    return model
