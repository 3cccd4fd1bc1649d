"""Weights for the torch backend: HF safetensors directories (16-bit, or quantized FP8 / AWQ / GPTQ /
compressed-tensors layouts), and GGUF (dequantized), all read by one walk over the checkpoint (``read_tensors``)
that takes the load's policy per tensor: the whole model (``load_state``), a tensor-parallel rank's slices, a
pipeline stage's layers.  A quantized checkpoint's layers stay quantized on CUDA (``<module>.weight`` ->
quant_linear.QuantLinear, which build.build installs where its kernels run) and are dequantised on the CPU
(quant_weights.py).  ``--quantize fp8`` quantises a 16-bit checkpoint's projections at load (per-output-channel
e4m3 scales): kept as FP8 on CUDA, the FP8-rounded weights in float on the CPU."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from safetensors import safe_open

from swiftlm.convert import GGUF_ARCHS, hf_config, hf_name, iter_dequantized
from swiftlm.errors import CorruptModel, UnsupportedArchitecture
from swiftlm.gguf_file import read_gguf_header
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


Cut = tuple[int, int, int]  # (dim, start, stop): the rows (dim 0) or columns (dim 1) of a tensor a process reads
# HF name -> (the name this process keeps the tensor under, the part of it it reads; None: all), or None: not read
Pick = Callable[[str], "tuple[str, Cut | None] | None"]


def checkpoint_config(spec: ModelSpec) -> dict:
    """The HF config the torch backend builds from: config.json's, or the one a GGUF's metadata gives."""
    return hf_config(spec, "float32") if spec.format == "gguf" else dict(spec.config)


def checkpoint_names(spec: ModelSpec) -> list[str]:
    """The HF names of a checkpoint's tensors, from the file headers alone (no tensor is read)."""
    if spec.format == "gguf":
        return [hf_name(t.name) for t in read_gguf_header(spec.path)[1]]
    names: list[str] = []
    for f in spec.weight_files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                names += fh.keys()
        except Exception as exc:
            raise CorruptModel(f"{f} could not be read: {exc}") from exc
    return names


def _cut(x: Any, cut: Cut) -> Any:
    """``x`` (a numpy array, or a safetensors ``get_slice``: only the cut's bytes are read) cut."""
    dim, start, stop = cut
    return x[start:stop] if dim == 0 else x[:, start:stop]


def read_tensors(spec: ModelSpec, pick: Pick | None = None, flag: str | None = None) -> dict[str, torch.Tensor]:
    """The one walk over a checkpoint's tensors (the shards of an HF directory, or a GGUF file) that every load
    makes: ``pick`` (None: every tensor, whole) is the load's policy, per HF name: keep it or not, under which
    name, whole or a cut (a tensor-parallel rank's slices: parallel.Plan; a pipeline stage's layers, renumbered:
    pipeline.Stage).  Safetensors read only what is kept, and of a cut tensor only its slice; a GGUF file is
    dequantized (gguf-py, fp32, Q/K rows in HF order) tensor by tensor, each dropped or cut at once, so one whole
    tensor at a time is in memory besides what is kept.  KV-cache scales are never kept (kv_fp8.checkpoint_scales
    reads them).  ``flag`` (an option that does not read quantized weights): refused for a quantized checkpoint."""
    state: dict[str, torch.Tensor] = {}

    def keep(name: str) -> tuple[str, Cut | None] | None:
        return None if scale_names(name) else pick(name) if pick else (name, None)

    if spec.format == "gguf":
        for name, arr in iter_dequantized(spec):
            if (got := keep(name)) is not None:
                state[got[0]] = torch.from_numpy(arr if got[1] is None else _cut(arr, got[1]).copy())
        return state
    if (spec.config.get("quantization") or {}).get("bits"):
        raise UnsupportedArchitecture(
            f"{spec.path} holds MLX-quantized weights, which the torch backend does "
            "not read; use the mlx backend or a 16-bit checkpoint"
        )
    if flag:
        refuse_quantized(spec, flag)
    for f in spec.weight_files:
        try:
            with safe_open(str(f), framework="pt") as fh:
                for name in fh.keys():
                    if (got := keep(name)) is not None:
                        ours, cut = got
                        state[ours] = fh.get_tensor(name) if cut is None else _cut(fh.get_slice(name), cut)
        except Exception as exc:
            raise CorruptModel(f"{f} could not be read: {exc}") from exc
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
    """(config, tensors) of the whole model, but the tensors named in ``skip`` (streamed experts: never read).
    A quantized checkpoint's layers come as QuantLinear when ``device`` is CUDA, else dequantised to ``dtype``; its
    config without ``quantization_config``.  ``quantize``: ``--quantize``."""
    check_arch(spec)
    if quantize:
        refuse_quantized(spec, f"--quantize {quantize}")
    pick = (lambda name: None if name in skip else (name, None)) if skip else None
    state: dict[str, Any] = read_tensors(spec, pick, "--stream-experts" if skip else None)
    scheme = quant_scheme(spec)
    if scheme is not None and device is not None and device.type == "cuda":
        quantized_state(state, scheme)
    elif scheme is not None:
        dequantize_state(state, scheme, dtype)
    config = checkpoint_config(spec)
    config.pop("quantization_config", None)
    return config, quantize_state(state, quantize, device) if quantize else state
