"""The transformers fallback: any ``AutoModelForCausalLM`` architecture the native path
(model.py) does not implement, run by transformers' own modeling code behind the engine's
Model interface.

Slower than the native path: one transformers forward per sequence per step (each sequence keeps
its own ``DynamicCache``; transformers' caches of different lengths do not batch without padding
and position bookkeeping per architecture), no CUDA graphs, no compressed KV.  Sampling is still
the core's batched sampler.  The same per-sequence loop as the multimodal wrapper (vlm.py).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from swiftlm.backend import ModelInfo
from swiftlm.errors import UnsupportedArchitecture
from swiftlm.media.model import MultimodalModel
from swiftlm.registry import ModelSpec
from swiftlm.tokenizer import load_hf_tokenizer

from .ops import TorchOps

log = logging.getLogger(__name__)

NAME = "transformers fallback"


def path_for(spec: ModelSpec) -> str:
    """Which torch path loads ``spec``: "native" or "transformers fallback"; for a quantized checkpoint on
    the native path also how its weights run (or the sentence refusing them)."""
    from swiftlm.quant_config import parse

    from .model_config import SUPPORTED

    arch = spec.config.get("model_type") or spec.arch
    path = "native" if spec.format == "gguf" or arch in SUPPORTED else NAME
    if spec.format != "hf" or path != "native":
        return path
    try:
        scheme = parse(spec.config)
    except UnsupportedArchitecture as exc:
        return f"refused: {exc}"
    if scheme is None:
        return path
    return f"{path}: {scheme.describe()} weights {quant_path(scheme, arch)}"


def quant_path(scheme: Any, arch: str) -> str:
    """How the native path runs a quantized checkpoint's weights (``swiftlm info``)."""
    from .model_config import EXTRA_ARCHS, MOE_ARCHS

    cpu = "dequantised to float32 at load on the CPU"
    if arch in EXTRA_ARCHS or arch in MOE_ARCHS or arch in ("qwen3_moe", "qwen2_moe", "mixtral") or scheme.bits == 8:
        return "dequantised at load (bfloat16 on a GPU, float32 on the CPU)"
    if scheme.kind == "fp8" and scheme.block is None:
        how = "FP8 tensor-core GEMMs (torch._scaled_mm) for batches, a Triton FP8 GEMV for up to 16 rows"
    elif scheme.kind == "fp8":
        how = "a Triton kernel dequantising the FP8 blocks in registers"
    else:
        how = "a Triton kernel dequantising the 4-bit codes in registers"
    return f"kept quantized on CUDA ({how}); {cpu}"


class TransformersFallback(MultimodalModel):
    def __init__(self, spec: ModelSpec, cfg: Any, device: torch.device, dtype: torch.dtype):
        super().__init__()
        import transformers

        try:
            self.module = transformers.AutoModelForCausalLM.from_pretrained(str(spec.path), dtype=dtype)
        except (ValueError, KeyError) as exc:
            raise UnsupportedArchitecture(
                f"architecture {spec.arch!r} is neither native to the torch backend nor "
                f"loadable by transformers {transformers.__version__} "
                f"AutoModelForCausalLM: {str(exc).splitlines()[0]}"
            ) from exc
        self.module = self.module.to(device).eval()
        self.device, self.dtype = device, dtype
        self.tokenizer = load_hf_tokenizer(spec.path, spec.config)
        self.ops = TorchOps(device)
        c = self.module.config
        layers = int(getattr(c, "num_hidden_layers", 0) or 0)
        heads = int(getattr(c, "num_attention_heads", 1) or 1)
        kv = int(getattr(c, "num_key_value_heads", None) or heads) * int(
            getattr(c, "head_dim", None) or (getattr(c, "hidden_size", 0) or 0) // heads
        )
        model_ctx = int(getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 4096)
        ctx_cfg = getattr(cfg, "ctx_size", None) if cfg is not None else None
        self.info = ModelInfo(
            arch=f"{spec.arch} ({NAME})",
            num_layers=layers,
            context_length=min(int(ctx_cfg or model_ctx), model_ctx),
            vocab_size=int(getattr(c, "vocab_size", 0) or self.tokenizer.vocab_size),
            num_params=spec.num_params,
            quantization=f"{spec.quantization} -> {str(dtype)[6:]} ({NAME})",
            weight_bytes=sum(p.numel() * p.element_size() for p in self.module.parameters()),
            kv_bytes_per_token=2 * layers * kv * torch.finfo(dtype).bits // 8,
        )
        log.info(
            "%s: architecture %r is not native to the torch backend; loaded through the %s "
            "(transformers %s, one forward per sequence per step)",
            spec.path,
            spec.arch,
            NAME,
            transformers.__version__,
        )

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.module.config)

    def concat(self, rows: list[Any]) -> Any:
        return torch.cat(rows)

    @torch.inference_mode()
    def run(self, cache: Any, tokens: list[int], media: Any) -> Any:
        if media is not None:
            raise RuntimeError(f"the {NAME} takes text only")
        ids = torch.tensor([tokens], dtype=torch.long, device=self.device)
        out = self.module(input_ids=ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return out.logits[0, -1].float()

    @torch.inference_mode()
    def logits(self, seq_id: int, tokens: list[int], start: int) -> torch.Tensor:
        """Last-position logits after feeding ``tokens`` at ``start`` (as TorchModel.logits)."""
        if start == 0:
            self.caches[seq_id], self.lengths[seq_id] = self.new_cache(), 0
        out = self.run(self.caches[seq_id], list(tokens), None)
        self.lengths[seq_id] += len(tokens)
        return out

    def memory(self) -> dict[str, Any]:
        from .devices import device_memory

        return {**device_memory(self.device), "weights": self.info.weight_bytes}


def load_fallback(spec: ModelSpec, cfg: Any) -> TransformersFallback:
    from .runner import _apply_mem_limit, pick_device

    for flag in ("tensor_parallel", "pipeline_parallel"):
        if int(getattr(cfg, flag, None) or 1) > 1:
            raise UnsupportedArchitecture(
                f"--{flag.replace('_', '-')} is not available for architecture "
                f"{spec.arch!r}, which runs through the {NAME}"
            )
    if getattr(cfg, "stream_experts", False):
        raise UnsupportedArchitecture(
            f"--stream-experts is not available for architecture {spec.arch!r}, which runs through the {NAME}"
        )
    device, dtype = pick_device(cfg)
    _apply_mem_limit(cfg, device)
    return TransformersFallback(spec, cfg, device, dtype)
