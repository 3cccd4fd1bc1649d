"""Weights for the torch backend: HF safetensors directories, and GGUF (dequantized)."""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.convert import iter_dequantized
from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.registry import ModelSpec

from .model import SUPPORTED


def load_hf_state(spec: ModelSpec, skip: set[str] | frozenset[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Every tensor of the checkpoint but those named in ``skip`` (streamed experts: never read)."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if (spec.config.get("quantization") or {}).get("bits"):
        raise UnsupportedArchitecture(f"{spec.path} holds MLX-quantized weights, which the torch backend does "
                                      "not read; use the mlx backend or a 16-bit checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in spec.weight_files:
        try:
            if skip:
                with safe_open(str(f), framework="pt") as fh:
                    state.update({k: fh.get_tensor(k) for k in fh.keys() if k not in skip})
            else:
                state.update(load_file(str(f)))
        except Exception as exc:
            raise CorruptModel(f"{f} could not be read: {exc}") from exc
    return state


def load_gguf_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 (gguf-py), Q/K rows back in HF order."""
    return {name: torch.from_numpy(arr) for name, arr in iter_dequantized(spec)}


GGUF_ARCHITECTURES = ("llama",)  # as the mlx backend: tensor names and Q/K layout mapped for llama only


def check_gguf(spec: ModelSpec) -> None:
    """A GGUF is read as a llama (swiftlm.convert.hf_config): refuse, in one sentence, any other
    architecture and any metadata that llama mapping would drop (experts, rope scaling, sliding window)."""
    arch = spec.arch
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(f"GGUF architecture {arch!r} is not supported by the torch backend "
                                      f"(supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}), so give "
                                      "an HF-format directory for it")
    meta = spec.gguf_meta or {}
    for key in ("expert_count", "rope.scaling.type", "attention.sliding_window", "attn_logit_softcapping"):
        value = meta.get(f"{arch}.{key}")
        if value not in (None, 0, "none"):
            raise UnsupportedArchitecture(f"GGUF field {arch}.{key}={value!r} is not implemented by the torch "
                                          "backend's GGUF reader")


def check_arch(spec: ModelSpec) -> None:
    if spec.format == "gguf":
        check_gguf(spec)
    arch = spec.config.get("model_type") or spec.arch
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(f"architecture {arch!r} is not supported by the torch backend; "
                                      f"supported: {', '.join(SUPPORTED)}")


def load_state(spec: ModelSpec, skip: set[str] | frozenset[str] = frozenset()) -> tuple[dict, dict[str, Any]]:
    check_arch(spec)
    if spec.format == "gguf":
        from swiftlm.convert import hf_config

        return hf_config(spec, "float32"), load_gguf_state(spec)
    return dict(spec.config), load_hf_state(spec, skip)
