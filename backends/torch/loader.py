"""Weights for the torch backend: HF safetensors directories (16-bit, or quantized FP8 / AWQ / GPTQ /
compressed-tensors layouts), and GGUF (dequantized).  A quantized checkpoint's layers stay quantized on CUDA
(``<module>.weight`` -> quant_linear.QuantLinear, which build.build installs where its kernels run) and are
dequantised on the CPU (quant_weights.py).  ``--quantize fp8`` quantises a 16-bit checkpoint's projections at
load (per-output-channel e4m3 scales): kept as FP8 on CUDA, the FP8-rounded weights in float on the CPU."""

from __future__ import annotations

from typing import Any

import torch

from swiftlm.convert import GGUF_ARCHS, iter_dequantized
from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.quant_config import QuantScheme, parse
from swiftlm.registry import ModelSpec

from .kv_fp8 import scale_names
from .model_config import SUPPORTED
from .quant_linear import quantize_fp8, quantized_state
from .quant_weights import dequantize_state

QUANTIZE = ("fp8",)  # --quantize methods
# the projections --quantize quantises (the embedding, the LM head and MoE routers stay 16-bit)
_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quant_scheme(spec: ModelSpec) -> QuantScheme | None:
    """The checkpoint's quantized-weight format (None: 16-bit weights, and GGUF); one sentence if unreadable."""
    return parse(spec.config) if spec.format == "hf" else None


def refuse_quantized(spec: ModelSpec, what: str) -> None:
    """One sentence when ``what`` (a flag) cannot take this checkpoint's quantized weights."""
    s = quant_scheme(spec)
    if s is not None:
        raise UnsupportedArchitecture(
            f"{what} does not read quantized checkpoints ({spec.path} holds {s.describe()} weights); "
            "serve it without it, or give a 16-bit checkpoint"
        )


def load_hf_state(
    spec: ModelSpec,
    skip: set[str] | frozenset[str] = frozenset(),
    dtype: torch.dtype = torch.float32,
    keep_quantized: bool = False,
) -> dict[str, Any]:
    """Every tensor of the checkpoint but those named in ``skip`` (streamed experts: never read); the
    layers of a quantized checkpoint dequantised to ``dtype``, or (``keep_quantized``) as QuantLinear."""
    from safetensors import safe_open
    from safetensors.torch import load_file

    if (spec.config.get("quantization") or {}).get("bits"):
        raise UnsupportedArchitecture(
            f"{spec.path} holds MLX-quantized weights, which the torch backend does "
            "not read; use the mlx backend or a 16-bit checkpoint"
        )
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
    for k in [k for k in state if scale_names(k)]:  # KV-cache scales: kv_fp8.checkpoint_scales reads them
        del state[k]
    scheme = quant_scheme(spec)
    if scheme is not None and keep_quantized:
        quantized_state(state, scheme)
    elif scheme is not None:
        dequantize_state(state, scheme, dtype)
    return state


def quantize_state(state: dict[str, Any], method: str, device: torch.device | None) -> dict[str, Any]:
    """``--quantize``: each layer projection's weight (``_PROJ``; 2-D, floating point) quantised in place: on
    CUDA kept as a QuantLinear (quantised on the GPU), elsewhere the FP8-rounded weight in float32."""
    if method not in QUANTIZE:
        raise UnsupportedArchitecture(f"--quantize {method} is not a method here (methods: {', '.join(QUANTIZE)})")
    cuda = device is not None and device.type == "cuda"
    for k in list(state):
        parts = k.split(".")
        w = state[k]
        if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in _PROJ or "layers" not in parts:
            continue
        if not torch.is_tensor(w) or w.dim() != 2 or not w.is_floating_point():
            continue
        q = quantize_fp8(w.to(device) if cuda else w)
        state[k] = q if cuda else q.dequantized(torch.float32)
    return state


def load_gguf_state(spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Every tensor dequantized to fp32 (gguf-py), Q/K rows back in HF order (llama only)."""
    return {name: torch.from_numpy(arr) for name, arr in iter_dequantized(spec)}


GGUF_ARCHITECTURES = tuple(GGUF_ARCHS)  # llama (as the mlx backend), qwen2, qwen3: swiftlm.convert.GGUF_ARCHS

# <arch>.<key> metadata that changes the computation and that the native layer does not read from a
# GGUF: refused when present with a value other than these neutral ones.
_GGUF_REFUSED = {
    "expert_count": (0, 1),
    "expert_used_count": (0, 1),
    "expert_shared_count": (0,),
    "rope.scaling.type": ("none",),
    "rope.scaling.factor": (0.0, 1.0),
    "rope.dimension_sections": (),
    "attention.sliding_window": (0,),
    "attention.sliding_window_pattern": (0,),
    "attn_logit_softcapping": (0.0,),
    "final_logit_softcapping": (0.0,),
    "logit_scale": (1.0,),
    "embedding_scale": (1.0,),
    "residual_scale": (1.0,),
    "attention.scale": (0.0,),
}


def check_gguf(spec: ModelSpec) -> None:
    """A GGUF is read as the HF config swiftlm.convert.hf_config derives from its metadata: refuse, in
    one sentence naming the GGUF key and its value, any other architecture and any metadata that
    mapping would drop (experts, rope scaling, a sliding window, soft caps, partial rotary, ...)."""
    arch = spec.arch
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"GGUF architecture {arch!r} (general.architecture) is not supported by the "
            f"torch backend (supported GGUF architectures: {', '.join(GGUF_ARCHITECTURES)}), "
            "so give an HF-format directory for it"
        )
    meta = spec.gguf_meta or {}

    def refuse(key: str, value: Any) -> None:
        raise UnsupportedArchitecture(
            f"GGUF field {arch}.{key}={value!r} is not implemented by the torch backend's GGUF reader"
        )

    for key, neutral in _GGUF_REFUSED.items():
        value = meta.get(f"{arch}.{key}")
        if value is not None and value not in neutral:
            refuse(key, value)
    head_dim = spec.config.get("head_dim")
    for key in ("rope.dimension_count", "attention.key_length", "attention.value_length"):
        value = meta.get(f"{arch}.{key}")
        if value is not None and int(value) != head_dim:  # partial rotary / unequal q-k and v widths
            refuse(key, value)


def check_arch(spec: ModelSpec) -> None:
    if spec.format == "gguf":
        check_gguf(spec)
    quant_scheme(spec)  # an unreadable quantization_config: one sentence before any tensor is read
    arch = spec.config.get("model_type") or spec.arch
    if arch not in SUPPORTED:
        raise UnsupportedArchitecture(
            f"architecture {arch!r} is not supported by the torch backend; supported: {', '.join(SUPPORTED)}"
        )


def load_state(
    spec: ModelSpec,
    skip: set[str] | frozenset[str] = frozenset(),
    dtype: torch.dtype = torch.float32,
    device: torch.device | None = None,
    quantize: str | None = None,
) -> tuple[dict, dict[str, Any]]:
    """(config, tensors).  A quantized checkpoint's layers come as QuantLinear when ``device`` is CUDA, else
    dequantised to ``dtype``; its config without ``quantization_config``.  ``quantize``: ``--quantize``."""
    check_arch(spec)
    if quantize:
        refuse_quantized(spec, f"--quantize {quantize}")
    if spec.format == "gguf":
        from swiftlm.convert import hf_config

        state = load_gguf_state(spec)
        return hf_config(spec, "float32"), quantize_state(state, quantize, device) if quantize else state
    if skip:
        refuse_quantized(spec, "--stream-experts")
    config = dict(spec.config)
    config.pop("quantization_config", None)
    cuda = device is not None and device.type == "cuda"
    state = load_hf_state(spec, skip, dtype, keep_quantized=cuda)
    return config, quantize_state(state, quantize, device) if quantize else state
