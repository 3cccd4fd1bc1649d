"""The Model protocol over a library's multimodal model (transformers on torch, mlx-vlm on MLX).

Each step runs one forward per sequence with that sequence's own library KV cache: a media
prompt is prefilled in one forward with its arrays, every later row is text.  Backends supply
``new_cache``, ``run`` and ``concat``; sampling is the core's batched sampler.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from ..backend import Forward, ModelHooks, ModelInfo, StepBatch

log = logging.getLogger(__name__)


def multimodal_info(
    spec: Any, cfg: Any, tokenizer: Any, weight_bytes: int, kv_dtype_bytes: int, quantization: str
) -> ModelInfo:
    """ModelInfo from a multimodal config (the language model's numbers live under text_config)."""
    text = spec.config.get("text_config") or spec.config
    model_ctx = int(text.get("max_position_embeddings") or 4096)
    layers = int(text.get("num_hidden_layers", 0))
    kv = int(text.get("num_key_value_heads") or 1) * int(text.get("head_dim") or 64)
    return ModelInfo(
        arch=spec.arch,
        num_layers=layers,
        context_length=min(int(getattr(cfg, "ctx_size", None) or model_ctx), model_ctx),
        vocab_size=int(text.get("vocab_size") or tokenizer.vocab_size),
        num_params=spec.num_params,
        quantization=quantization,
        modalities=("text",) + tuple(m for m, on in (("image", spec.vision), ("audio", spec.audio)) if on),
        weight_bytes=weight_bytes,
        kv_bytes_per_token=2 * layers * kv * kv_dtype_bytes,
    )


class MultimodalModel(ModelHooks):
    info: ModelInfo
    tokenizer: Any
    ops: Any
    overlap = False  # one forward per sequence, host ids

    def __init__(self) -> None:
        self.caches: dict[int, Any] = {}
        self.lengths: dict[int, int] = {}

    # backends implement these three (and concat)
    def new_cache(self) -> Any:
        raise NotImplementedError

    def run(self, cache: Any, tokens: list[int], media: Any) -> Any:
        """Feed ``tokens`` (with ``media`` arrays on a prompt's first chunk: ``media.for_length``);
        return the last row's logits."""
        raise NotImplementedError

    def forward(self, batch: StepBatch) -> Forward:  # (the engine frees batch.preempted before the step)
        failed: dict[int, str] = {}
        rows = []
        for w in batch.seqs:
            try:  # a sequence that fails (its media, its state) fails alone; the others in the step go on
                logits = self._one(w)
            except Exception as exc:
                log.exception("forward failed for sequence %d", w.seq_id)
                self.free([w.seq_id])
                failed[w.seq_id] = f"{type(exc).__name__}: {exc}"
                continue
            if w.sample:
                rows.append(self.ops.one_row(logits))
        return Forward(self.concat(rows) if rows else None, failed)

    def concat(self, rows: list[Any]) -> Any:
        """[1, V] rows -> [n, V] (the backend's array concatenation)."""
        raise NotImplementedError

    def _one(self, w: Any) -> Any:
        if w.start_pos == 0:
            self.caches[w.seq_id] = self.new_cache()
            self.lengths[w.seq_id] = 0
        if self.lengths.get(w.seq_id) != w.start_pos:
            raise RuntimeError(
                f"sequence {w.seq_id}: KV holds {self.lengths.get(w.seq_id)} positions, step feeds from {w.start_pos}"
            )
        media = getattr(w, "media", None)
        if media is not None and w.start_pos != 0:
            raise RuntimeError("a media prompt must be prefilled from its first position in one chunk")
        logits = self.run(self.caches[w.seq_id], w.tokens, media)
        self.lengths[w.seq_id] += len(w.tokens)
        return logits

    def free(self, seq_ids: Sequence[int]) -> None:
        for s in seq_ids:
            self.caches.pop(s, None)
            self.lengths.pop(s, None)
