"""Weights for the torch backend: HF safetensors directories, and GGUF (dequantized)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from swiftlm.convert import hf_name, unpermute_rows
from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.registry import ModelSpec

from .model import SUPPORTED


def load_hf_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    if (spec.config.get("quantization") or {}).get("bits"):
        raise UnsupportedArchitecture(f"{spec.path} holds MLX-quantized weights, which the torch backend does "
                                      "not read; use the mlx backend or a 16-bit checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in spec.weight_files:
        try:
            state.update(load_file(str(f)))
        except Exception as exc:
            raise CorruptModel(f"{f} could not be read: {exc}") from exc
    return state


def load_gguf_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Dequantize every tensor to fp32 (gguf-py) and put Q/K rows back in HF order."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    from swiftlm.gguf_file import read_gguf_header

    _, tensors = read_gguf_header(spec.path)
    raw = np.memmap(spec.path, dtype=np.uint8, mode="r")
    heads, kv_heads = spec.config["num_attention_heads"], spec.config["num_key_value_heads"]
    state: dict[str, torch.Tensor] = {}
    for t in tensors:
        shape = tuple(reversed(t.shape))
        arr = dequantize(np.asarray(raw[t.offset:t.offset + t.n_bytes]), GGMLQuantizationType(t.type_id))
        arr = arr.reshape(shape).astype(np.float32)
        name = hf_name(t.name)
        if ".self_attn.q_proj." in name:
            arr = unpermute_rows(arr, heads)
        elif ".self_attn.k_proj." in name:
            arr = unpermute_rows(arr, kv_heads)
        state[name] = torch.from_numpy(np.ascontiguousarray(arr))
    return state


def check_arch(spec: ModelSpec) -> None:
    arch = spec.config.get("model_type") or spec.arch
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(f"architecture {arch!r} is not supported by the torch backend; "
                                      f"supported: {', '.join(SUPPORTED)}")


def load_state(spec: ModelSpec) -> tuple[dict, dict[str, Any]]:
    check_arch(spec)
    if spec.format == "gguf":
        from swiftlm.convert import hf_config

        return hf_config(spec, "float32"), load_gguf_state(spec)
    return dict(spec.config), load_hf_state(spec)
