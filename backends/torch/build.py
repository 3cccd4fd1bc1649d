"""The load of a native torch model: checkpoint names to ours (``hf_state_to_ours``), the model built
on the meta device and filled (``build``: model.py's ``Transformer``, archs.py's / archs_moe.py's
subclasses, streamed_moe.py's experts; or the ``Part`` of it one process of a group holds), and the steps
every load ends with (``finish_load``, ``tokenizer_and_info``)."""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from swiftlm.backend import ModelInfo
from swiftlm.errors import UnsupportedArchitecture
from swiftlm.registry import ModelSpec
from swiftlm.tokenizer import load_gguf_tokenizer, load_hf_tokenizer

from . import archs, archs_moe
from .archs_config import refuse_flag
from .devices import CUDA_DEFAULT_CTX
from .loader import Cut
from .model import MLP, Transformer
from .model_config import MOE_ARCHS, Args
from .offload import place
from .quant_linear import QuantLinear, QuantProj, weight_bytes
from .streamed_moe import StreamedMoE


def hf_state_to_ours(a: Args, sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF checkpoint names -> model.py's names (strip 'model.', stack experts).  Consumes ``sd``."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[tuple[int, str, int], torch.Tensor] = {}
    for k in list(sd):  # pops: the caller's dict empties as ours fills (no second copy held)
        v = sd.pop(k)
        name = k[len("model.") :] if k.startswith("model.") else k
        parts = name.split(".")
        if "experts" in parts and parts[0] == "layers":
            # layers.L.mlp.experts.E.gate_proj.weight  |  layers.L.block_sparse_moe.experts.E.w1.weight
            li, ei = int(parts[1]), int(parts[parts.index("experts") + 1])
            proj = parts[parts.index("experts") + 2]
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(proj, proj)
            experts[(li, proj, ei)] = v
            continue
        name = name.replace("block_sparse_moe.gate.", "mlp.gate.").replace("block_sparse_moe.", "mlp.")
        for proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            name = name.replace(f"mlp.switch_mlp.{proj}.weight", f"mlp.{ours}")  # stacked [E, out, in]
        out[name] = v
    for li in range(a.layers):
        for proj, ours in (("gate_proj", "w_gate"), ("up_proj", "w_up"), ("down_proj", "w_down")):
            if (li, proj, 0) in experts:
                out[f"layers.{li}.mlp.{ours}"] = torch.stack([experts[(li, proj, e)] for e in range(a.experts)])
    if a.tie:
        out.pop("lm_head.weight", None)
    return out


class Part(Protocol):
    """The piece of the model that one process of a group holds (parallel.Plan: a tensor-parallel rank's slices;
    pipeline.Stage: a pipeline stage's layers): what it reads of the checkpoint (``pick``, loader.read_tensors'
    policy), its ``Args``, and how its module tree differs from the whole model's (``shape``, on the meta device)."""

    def pick(self, name: str) -> tuple[str, Cut | None] | None: ...

    def args(self, a: Args) -> Args: ...

    def shape(self, model: Transformer) -> None: ...


def build(
    config: dict,
    state: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: torch.device,
    expert_reader: Any = None,
    first_cpu_layer: int | None = None,
    offload_dtype: torch.dtype = torch.float32,
    part: Part | None = None,
) -> Transformer:
    """``expert_reader`` (a swiftlm.experts.ExpertReader): MoE layers stream their experts.  ``part``: the model
    of one tensor-parallel rank or pipeline stage (llama-family layers only: make_plan / check_split refuse the
    others), which has no eager path on CUDA (``finish_load`` without ``eager``: ``check_device``)."""
    a = Args.from_config(config)
    if not a.tie and not any(k.endswith("lm_head.weight") for k in state):
        a.tie = True  # an embedding-only checkpoint (e.g. Qwen3Model) or a stage without the head: no head
    a = part.args(a) if part is not None else a
    with torch.device("meta"):
        model = Transformer(a) if a.ext is None else ext_model(a, first_cpu_layer, expert_reader)
        if expert_reader is not None:
            for i, layer in enumerate(model.layers):
                if i in expert_reader.layout.slabs:
                    layer.mlp = StreamedMoE(a, expert_reader, i, device, dtype)
        if part is not None:
            part.shape(model)
    if a.arch in MOE_ARCHS:  # GPT-OSS's fused experts, DeepSeek's interleaved rope rows
        sd = archs_moe.convert_state(a, state)
    else:
        sd = hf_state_to_ours(a, state)
    if a.ext is not None and a.arch not in MOE_ARCHS:  # Phi-3's fused projections, split
        sd = archs.convert_state(a, sd)
    if a.gemma:  # Gemma's RMSNorm multiplies by (1 + w): fold the 1 into the weights once
        sd = {k: (v.float() + 1.0 if k.endswith("norm.weight") else v) for k, v in sd.items()}
    quant = {k: sd.pop(k) for k in [k for k, v in sd.items() if isinstance(v, QuantLinear)]}
    if quant and (a.ext is not None or a.experts or first_cpu_layer is not None):  # no kernels there: 16-bit
        sd.update({k: q.dequantized(dtype) for k, q in quant.items()})
        quant = {}
    # convert one tensor at a time, dropping the stored one: peak = the model + one tensor
    missing, unexpected = model.load_state_dict(
        {k: sd.pop(k).to(dtype) for k in list(sd)}, strict=not quant, assign=True
    )
    if quant:
        install_quantized(model, quant, missing, unexpected, device, dtype)
    model.init_rope()
    if first_cpu_layer is not None:  # --gpu-layers: layers [first_cpu_layer, L) stay on the CPU
        place(model, first_cpu_layer, device, offload_dtype)
    else:
        model.to(device)
    for layer in model.layers:
        if hasattr(layer.mlp, "to_device"):
            layer.mlp.to_device()
    return finish_load(model, dtype, eager=part is None)  # one process: runner.TorchModel picks the path


def install_quantized(
    model: nn.Module,
    quant: dict[str, QuantLinear],
    missing: list[str],
    unexpected: list[str],
    device: torch.device,
    dtype: torch.dtype,
) -> None:
    """Each quantized weight's ``nn.Linear`` replaced by a ``QuantProj`` on ``device`` (its bias kept)."""
    if unexpected or set(missing) != set(quant):
        extra = sorted(unexpected) or sorted(set(missing) ^ set(quant))
        raise RuntimeError(f"quantized state does not match the model: {extra[:3]}")
    for name, q in quant.items():
        path = name[: -len(".weight")]
        parent, _, attr = path.rpartition(".")
        owner = model.get_submodule(parent)
        lin = getattr(owner, attr)
        bias = lin.bias if isinstance(lin, nn.Linear) and lin.bias is not None else None
        setattr(owner, attr, QuantProj(q.with_dtype(dtype).to(device), bias))


def ext_model(a: Args, first_cpu_layer: int | None, expert_reader: Any = None) -> Transformer:
    if first_cpu_layer is not None:
        refuse_flag(a, "--gpu-layers")
    if expert_reader is not None:
        refuse_flag(a, "--stream-experts")
    if a.arch in MOE_ARCHS:
        return archs_moe.MoeTransformer(a)
    return archs.ExtTransformer(a)


def check_device(a: Args, device: torch.device, eager: bool = False) -> None:
    """On CUDA, archs.py's / archs_moe.py's architectures and live sliding windows run on the eager path
    only (``Args.eager_reason``): a single-process model picks it (``eager``: runner.TorchModel runs it
    so); tensor-parallel ranks and pipeline stages (which call ``finish_load`` without ``eager``) are
    refused.  Nothing is refused on the CPU."""
    why = a.eager_reason() if device.type == "cuda" and not eager else None
    if why is not None:
        raise UnsupportedArchitecture(
            f"{why} runs on CUDA only in a single-process model (on the eager path), so "
            "serve it without --tensor-parallel and --pipeline-parallel"
        )


def finish_load(model: Transformer, dtype: torch.dtype, eager: bool = False) -> Transformer:
    """The last steps of every load (one process, a tensor-parallel rank, a pipeline stage), once the
    weights are on their device: rope tables in the model's dtype (as HF), eval mode, fused projections.
    ``eager``: the caller can run the model on the eager path on CUDA (``check_device``)."""
    check_device(model.a, model.cos.device, eager)
    model.cos, model.sin = model.cos.to(dtype), model.sin.to(dtype)
    model.eval()
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()
    return model


def param_bytes(model: Any) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for layer in model.layers:  # fused weights are plain tensors, not parameters
        w, b = layer.self_attn.qkv
        n += weight_bytes(w) + weight_bytes(b)
        if hasattr(layer.mlp, "gate_up"):
            n += weight_bytes(layer.mlp.gate_up)
    n += sum(weight_bytes(m.weight) for m in model.modules() if isinstance(m, QuantProj))
    return n


def tokenizer_and_info(
    spec: ModelSpec,
    cfg: Any,
    module: Any,
    whole: Args,
    device: torch.device,
    dtype: torch.dtype,
    kv_store: torch.dtype | None = None,
    **fields: Any,
) -> tuple[Any, ModelInfo]:
    """The tokenizer and ``ModelInfo`` of a loaded model (one process, a tensor-parallel rank, a pipeline stage).
    Served context: --ctx-size, else the model's, on CUDA at most ``CUDA_DEFAULT_CTX`` (the default KV pool holds
    every --parallel sequence at the full context, devices.kv_pool_size; with --kv-cache-memory the pool's size no
    longer follows the context).  Layers and vocabulary are the whole model's (``whole``); weight and KV bytes this
    process's ``module``'s (its layers, its KV heads; KV rows in ``kv_store``, default ``dtype``)."""
    gguf = spec.format == "gguf"
    tokenizer = load_gguf_tokenizer(spec.gguf_meta or {}) if gguf else load_hf_tokenizer(spec.path, spec.config)
    cap = whole.ctx if device.type == "cpu" else min(whole.ctx, CUDA_DEFAULT_CTX)
    m = module.a
    return tokenizer, ModelInfo(
        arch=spec.arch,
        num_layers=whole.layers,
        context_length=min(int(getattr(cfg, "ctx_size", None) or cap), whole.ctx),
        vocab_size=whole.vocab,
        num_params=spec.num_params,
        quantization=f"{spec.quantization} -> {str(dtype)[6:]}",
        weight_bytes=param_bytes(module),
        kv_bytes_per_token=2 * m.layers * m.kv_heads * m.head_dim * torch.finfo(kv_store or dtype).bits // 8,
        **fields,
    )
