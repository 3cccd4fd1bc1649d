"""The torch ``Model``: our transformer + per-sequence KV caches behind the batched step."""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from swiftlm.backend import ModelInfo, SampledToken, StepBatch, StepResult
from swiftlm.registry import ModelSpec
from swiftlm.sampling import sample_row
from swiftlm.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

from .loader import load_state
from .model import SeqCache, build, param_bytes
from .ops import TorchOps

log = logging.getLogger(__name__)


class TorchModel:
    def __init__(self, module: Any, tokenizer: Any, info: ModelInfo, device: torch.device, dtype: torch.dtype):
        self.module, self.tokenizer, self.info = module, tokenizer, info
        self.device, self.dtype = device, dtype
        self.caches: dict[int, SeqCache] = {}
        self.ops = TorchOps(device)

    def _cache(self, seq_id: int, start: int) -> SeqCache:
        c = self.caches.get(seq_id)
        if c is None:
            c = self.caches[seq_id] = SeqCache(self.module.a, self.dtype, self.device)
        if c.length > start:  # recompute / rollback: later positions are simply overwritten
            c.length = start
        elif c.length < start:
            raise RuntimeError(f"sequence {seq_id}: KV cache holds {c.length} positions, step starts at {start}")
        return c

    @torch.inference_mode()
    def logits(self, seq_id: int, tokens: list[int], start: int) -> torch.Tensor:
        cache = self._cache(seq_id, start)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        return self.module(ids, cache, start)[-1]

    @torch.inference_mode()
    def step(self, batch: StepBatch) -> StepResult:
        result = StepResult()
        for w in batch.seqs:
            logits = self.logits(w.seq_id, w.tokens, w.start_pos)
            if w.sample:
                token, lp, top = sample_row(self.ops, logits, w.params, w.state)
                result.sampled.append(SampledToken(w.seq_id, token, lp, top))
        return result

    def free(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self.caches.pop(s, None)

    def memory(self) -> dict[str, int]:
        if self.device.type == "cuda":
            return {"active": torch.cuda.memory_allocated(), "peak": torch.cuda.max_memory_allocated(),
                    "cache": torch.cuda.memory_reserved() - torch.cuda.memory_allocated()}
        kv = sum(c.nbytes() for c in self.caches.values())
        active = self.info.weight_bytes + kv
        return {"active": active, "peak": active, "cache": 0}


def pick_device(cfg: Any) -> tuple[torch.device, torch.dtype]:
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def load_model(spec: ModelSpec, cfg: Any) -> TorchModel:
    device, dtype = pick_device(cfg)
    config, state = load_state(spec)
    module = build(config, state, dtype, device)
    del state
    tokenizer = (load_gguf_tokenizer(spec.gguf_meta or {}) if spec.format == "gguf"
                 else load_hf_tokenizer(spec.path, spec.config))
    a = module.a
    ctx_cfg = getattr(cfg, "ctx_size", None) if cfg is not None else None
    ctx = min(int(ctx_cfg or a.ctx), a.ctx)
    info = ModelInfo(arch=spec.arch, num_layers=a.layers, context_length=ctx, vocab_size=a.vocab,
                     num_params=spec.num_params, quantization=f"{spec.quantization} -> {str(dtype)[6:]}",
                     is_moe=bool(a.experts), weight_bytes=param_bytes(module),
                     kv_bytes_per_token=2 * a.layers * a.kv_heads * a.head_dim * torch.finfo(dtype).bits // 8)
    return TorchModel(module, tokenizer, info, device, dtype)
