"""Multimodal models on MLX through mlx-vlm: its model classes and weight loading, its prompt
caches, one forward per sequence (the prompt with the media arrays, then text rows through the
language model)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from swiftlm.errors import BackendUnavailable
from swiftlm.media.model import MultimodalModel, multimodal_info
from swiftlm.registry import ModelSpec
from swiftlm.tokenizer import load_hf_tokenizer

from .ops import MLXOps


class MLXMultimodal(MultimodalModel):
    def __init__(self, spec: ModelSpec, cfg: Any):
        super().__init__()
        try:
            from mlx_vlm.utils import load_model
        except ImportError as exc:
            raise BackendUnavailable(
                f"multimodal models on MLX need mlx-vlm (pip install 'swiftlm[vlm]'): {exc}"
            ) from None
        self.module = load_model(Path(spec.path))
        if mx.default_device().type == mx.DeviceType.cpu:  # MLX's CPU gather/matmul kernels want fp32
            self.module.set_dtype(mx.float32)
        _materialise(self.module)
        from .cpu_split import split_projections

        split_projections(self.module)  # on a CPU: projections' rows over the cores (cpu_split.py)
        self.tokenizer = load_hf_tokenizer(spec.path, spec.config)
        self.ops = MLXOps()
        nbytes = sum(v.nbytes for _, v in tree_flatten(self.module.parameters()))
        self.info = multimodal_info(spec, cfg, self.tokenizer, nbytes, 4, spec.quantization)

    def new_cache(self) -> Any:
        from mlx_vlm.models.cache import make_prompt_cache

        return make_prompt_cache(self.module.language_model)

    def concat(self, rows: list[Any]) -> Any:
        return mx.concatenate(rows)

    def run(self, cache: Any, tokens: list[int], media: Any) -> Any:
        ids = mx.array([tokens], dtype=mx.int32)
        if media is not None:
            kw = {k: mx.array(v) for k, v in media.for_length(len(tokens)).items()}
            out = self.module(ids, cache=cache, **kw)
        else:
            out = self.module.language_model(ids, cache=cache)
        logits = getattr(out, "logits", out)[0, -1].astype(mx.float32)
        mx.eval(logits)
        return logits

    def memory(self) -> dict[str, Any]:
        from .model import allocator_memory

        return allocator_memory(self.info.weight_bytes)


def _materialise(module: Any) -> None:
    """Evaluate every array the model holds, parameters and private buffers (``_inv_freq``-style
    keys, plain attributes) alike: a lazy array is bound to the stream of the thread that built it,
    and the server loads on a thread that has exited by the time the engine thread runs."""
    arrays = []
    for m in module.modules():
        for v in list(m.values()) + list(vars(m).values()):
            if isinstance(v, mx.array):
                arrays.append(v)
            elif isinstance(v, (list, tuple)):
                arrays.extend(x for x in v if isinstance(x, mx.array))
    mx.eval(module.parameters(), arrays)


def load_multimodal(spec: ModelSpec, cfg: Any) -> MLXMultimodal:
    return MLXMultimodal(spec, cfg)
