"""torch backend on CUDA: which architectures run on the eager (dynamic) path, decided without a GPU.

The CUDA fast path (runner.TorchModel.static: the slot pool, CUDA graphs, packed prefill, paged attention,
overlapped steps) runs the llama-family layer over every key.  archs.py / archs_moe.py layers and live
sliding windows run on the eager path there, as --gpu-layers offload does: per-sequence growing caches,
eager forwards.  This machine has no GPU, so these tests check the decision (``runner.cuda_eager_reason``,
``model_config.Args.eager_reason``) and that ``TorchModel`` wires it (a real module on the CPU handed a CUDA
``torch.device``: the eager path allocates nothing at construction).  The forwards themselves are the CPU
path's (tests/test_torch_archs*.py, tests/test_torch_config_fields.py); scripts/gpu_archs.py checks them
against transformers on a GPU.
"""

from __future__ import annotations

import logging

import pytest
from conftest import needs_torch

pytestmark = [needs_torch]

BASE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 8,
    "intermediate_size": 64,
    "vocab_size": 64,
    "max_position_embeddings": 128,
    "rms_norm_eps": 1e-6,
}
MOE = {"num_local_experts": 4, "num_experts_per_tok": 2}
MLA = {
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "kv_lora_rank": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 4,
    "v_head_dim": 8,
    "moe_intermediate_size": 16,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": False,
    "num_key_value_heads": 4,
}
EAGER = {  # model_type -> (config fields, what the runner names)
    "gemma2": ({"sliding_window": 8}, "architecture 'gemma2' (attn_logit_softcapping=50.0)"),
    "gemma3_text": ({"sliding_window": 8}, "architecture 'gemma3_text' (q/k norms and a rope base per layer type)"),
    "phi3": ({}, "architecture 'phi3' (fused qkv_proj / gate_up_proj)"),
    "olmo2": ({}, "architecture 'olmo2' (norms after attention and MLP, q/k norms over the whole projection)"),
    "smollm3": ({}, "architecture 'smollm3' (no_rope_layers)"),
    "gpt_oss": ({**MOE, "sliding_window": 8}, "architecture 'gpt_oss' (attention sinks)"),
    "deepseek_v2": ({**MLA, "topk_method": "greedy"}, "architecture 'deepseek_v2' (multi-head latent attention)"),
    "deepseek_v3": (MLA, "architecture 'deepseek_v3' (multi-head latent attention)"),
    "mistral": ({"sliding_window": 8}, "config field sliding_window=8"),
    "mixtral": ({**MOE, "sliding_window": 8}, "config field sliding_window=8"),
    "qwen3_moe": (
        {
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "sliding_window": 8,
            "use_sliding_window": True,
        },
        "config field sliding_window=8",
    ),
    "qwen2": (
        {"sliding_window": 8, "use_sliding_window": True, "max_window_layers": 1},
        "config field sliding_window=8",
    ),
    "qwen3": (
        {"sliding_window": 8, "use_sliding_window": True, "layer_types": ["full_attention", "sliding_attention"]},
        "config field sliding_window=8",
    ),
}
STATIC = {  # the llama family without a live window keeps the CUDA fast path
    "llama": {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 32}},
    "qwen2": {"sliding_window": 8, "use_sliding_window": False},  # the window is off
    "qwen3": {},
    "qwen3_moe": {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16},
    "mixtral": {**MOE, "sliding_window": None},
    "mistral": {"sliding_window": 4096},  # no shorter than the context: changes nothing
    "gemma": {},
}


def args(model_type: str, fields: dict):
    from swiftlm.backends.torch.model_config import Args

    return Args.from_config({**BASE, "model_type": model_type, **fields})


@pytest.mark.parametrize("arch", sorted(EAGER))
def test_eager_on_cuda_only(arch):
    import torch

    from swiftlm.backends.torch.runner import cuda_eager_reason

    fields, why = EAGER[arch]
    a = args(arch, fields)
    assert a.needs_eager
    assert cuda_eager_reason(a, torch.device("cuda"), 128) == why
    assert cuda_eager_reason(a, torch.device("cuda:1"), 128) == why
    assert cuda_eager_reason(a, torch.device("cpu"), 128) is None  # the CPU has only the eager path


@pytest.mark.parametrize("arch", sorted(STATIC))
def test_llama_family_keeps_static_path(arch):
    import torch

    from swiftlm.backends.torch.runner import cuda_eager_reason

    a = args(arch, STATIC[arch])
    assert not a.needs_eager
    assert cuda_eager_reason(a, torch.device("cuda"), 128) is None


def test_window_only_counts_below_served_context():
    """A window as long as the served context (--ctx-size) never hides a key: the static path stays."""
    import torch

    from swiftlm.backends.torch.runner import cuda_eager_reason

    a = args("mistral", {"sliding_window": 64})
    assert a.needs_eager  # 64 < max_position_embeddings 128
    assert cuda_eager_reason(a, torch.device("cuda"), 128) == "config field sliding_window=64"
    assert cuda_eager_reason(a, torch.device("cuda"), 64) is None
    assert cuda_eager_reason(args("gemma2", {"sliding_window": 8}), torch.device("cuda"), 8) is not None  # the layer


def test_offload_is_eager():
    import torch

    from swiftlm.backends.torch.runner import cuda_eager_reason

    a = args("llama", {})
    a.offload = (1, torch.device("cpu"), torch.float32)
    assert cuda_eager_reason(a, torch.device("cuda"), 128) == "--gpu-layers keeps layers on the CPU"


def _module(arch: str, fields: dict):
    from swiftlm.backends.torch.build import ext_model
    from swiftlm.backends.torch.model import Transformer

    a = args(arch, fields)
    return Transformer(a) if a.ext is None else ext_model(a, None)


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "gpt_oss", "deepseek_v3", "mistral"])
def test_torch_model_wires_eager_path(arch, caplog):
    """TorchModel on a CUDA device with such a model: no slot pool, CUDA graphs or overlapped steps, and one
    load log line naming the reason (the module stays on the CPU: nothing is allocated on the device)."""
    import torch

    from swiftlm.backend import ModelInfo
    from swiftlm.backends.torch.runner import TorchModel

    fields, why = EAGER[arch]
    module = _module(arch, fields)
    info = ModelInfo(arch=arch, num_layers=2, context_length=128, vocab_size=64, num_params=0, quantization="f32")
    with caplog.at_level(logging.INFO, logger="swiftlm.backends.torch.runner"):
        m = TorchModel(module, None, info, torch.device("cuda"), torch.bfloat16, slots=4)
    assert (m.static, m.pool, m.graphs, m.overlap) == (False, None, None, False)
    assert m.eager_reason == why
    lines = [r.getMessage() for r in caplog.records if "runs eagerly on CUDA" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith(f"{arch} runs eagerly on CUDA") and lines[0].endswith(why)
    # the CPU: eager as always, nothing logged
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="swiftlm.backends.torch.runner"):
        cpu = TorchModel(module, None, info, torch.device("cpu"), torch.float32)
    assert (cpu.static, cpu.pool, cpu.graphs, cpu.eager_reason) == (False, None, None, None)
    assert not [r for r in caplog.records if "runs eagerly" in r.getMessage()]


@pytest.mark.parametrize("arch", ["gemma2", "deepseek_v3", "mistral"])
def test_build_lets_runner_choose(arch, monkeypatch):
    """build.build (one process: runner.TorchModel then picks the eager path) passes ``eager`` to the device
    check, so it refuses nothing on CUDA; tensor-parallel ranks and pipeline stages (finish_load without
    ``eager``) are still refused there, naming both flags."""
    import torch

    from swiftlm.backends.torch import build as M
    from swiftlm.errors import UnsupportedArchitecture

    fields = EAGER[arch][0]
    state = {k: v.detach().clone().normal_(0, 0.02) for k, v in _module(arch, fields).state_dict().items()}
    if arch == "deepseek_v3":  # checkpoint names: per-expert tensors (archs_moe.convert_state stacks them)
        state = None
    seen = []
    real = M.check_device
    monkeypatch.setattr(M, "check_device", lambda a, device, eager=False: seen.append(eager) or real(a, device, eager))
    if state is not None:
        built = M.build({**BASE, "model_type": arch, **fields}, state, torch.float32, torch.device("cpu"))
        assert seen == [True] and built.a.needs_eager
    monkeypatch.undo()
    a = args(arch, fields)
    M.check_device(a, torch.device("cuda"), eager=True)
    with pytest.raises(UnsupportedArchitecture, match="without --tensor-parallel and --pipeline-parallel$"):
        M.check_device(a, torch.device("cuda"))
