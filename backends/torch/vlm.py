"""Multimodal models on torch through transformers (its model class for the checkpoint's
``architectures``, e.g. Gemma4ForConditionalGeneration) with one DynamicCache per sequence."""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.errors import UnsupportedArchitecture
from swiftlm.media.model import MultimodalModel, multimodal_info
from swiftlm.registry import ModelSpec
from swiftlm.tokenizer import load_hf_tokenizer

from .ops import TorchOps


class TorchMultimodal(MultimodalModel):
    def __init__(self, spec: ModelSpec, cfg: Any, device: torch.device, dtype: torch.dtype):
        super().__init__()
        import transformers

        arch = (spec.config.get("architectures") or [""])[0]
        cls = getattr(transformers, arch, None)
        if cls is None:
            raise UnsupportedArchitecture(
                f"transformers {transformers.__version__} has no class {arch!r} for {spec.path}"
            )
        self.module = cls.from_pretrained(str(spec.path), dtype=dtype).to(device).eval()
        self.device, self.dtype = device, dtype
        self.tokenizer = load_hf_tokenizer(spec.path, spec.config)
        self.ops = TorchOps(device)
        nbytes = sum(p.numel() * p.element_size() for p in self.module.parameters())
        self.info = multimodal_info(
            spec, cfg, self.tokenizer, nbytes, torch.finfo(dtype).bits // 8, f"{spec.quantization} -> {str(dtype)[6:]}"
        )

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.module.config)

    @torch.inference_mode()
    def concat(self, rows: list[Any]) -> Any:
        return torch.cat(rows)

    def run(self, cache: Any, tokens: list[int], media: Any) -> Any:
        kw: dict[str, torch.Tensor] = {}
        if media is not None:
            for k, v in media.for_length(len(tokens)).items():
                t = torch.from_numpy(v).to(self.device)
                kw[k] = t.to(self.dtype) if t.is_floating_point() else t
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.module(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1, **kw)
        return out.logits[0, -1].float()

    def memory(self) -> dict[str, Any]:
        """Measured memory, as TorchModel.memory (runner.device_memory), plus the weights held."""
        from .devices import device_memory

        return {**device_memory(self.device), "weights": self.info.weight_bytes}


def load_multimodal(spec: ModelSpec, cfg: Any) -> TorchMultimodal:
    from .runner import _apply_mem_limit, pick_device

    device, dtype = pick_device(cfg)
    _apply_mem_limit(cfg, device)
    return TorchMultimodal(spec, cfg, device, dtype)
