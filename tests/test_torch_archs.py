"""torch backend: the architectures of backends/torch/archs.py (Gemma 2, Gemma 3 text, Phi-3 / Phi-4,
OLMo 2, SmolLM3) run natively and equal transformers' own implementation.

Checkpoints: random weights from scripts/make_checkpoint.py (hub layout, the bundled SmolLM2
tokenizer), fp32, with small sliding windows, soft caps and a longrope switch at 40 positions so that
every feature bites at these prompt lengths (``test_feature_bites`` checks that it does).  The
reference is transformers' model on the same directory: fp32, CPU, eager attention (the path that
applies Gemma's attention soft cap).

Tolerance of the first-step logits: 1e-4 x max(1, max |logit|).  Both sides compute in fp32; what
differs is the order of operations (fused QKV / gate-up matmuls, SDPA against eager softmax, rope
tables computed in fp64 then rounded), which moves the logits by rounding only, while a feature left
out moves them by far more than the tolerance (``test_feature_bites``
requires 100x).  Greedy tokens must be identical.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from conftest import make_ckpt, needs_torch

pytestmark = [needs_torch]

N_TOKENS = 32
BASE = [1, 17, 300, 4021, 77, 901, 12, 5, 6000, 33, 2048, 700, 18, 19, 4000, 8, 9, 10, 11, 1200, 3, 50, 51, 52]
PROMPT = BASE * 2  # 48 tokens: past the windows (8, 12) and the longrope switch (40)
PROMPTS = [PROMPT, PROMPT[:11], PROMPT[5:30]]  # the short ones cross the window / the switch while decoding
SHAPE = [
    "--hidden",
    "64",
    "--layers",
    "4",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--intermediate",
    "128",
    "--dtype",
    "float32",
    "--ctx",
    "256",
]
ARCHS = {
    "gemma2": ["--sliding-window", "8", "--attn-softcap", "3", "--final-softcap", "2", "--query-pre-attn-scalar", "24"],
    "gemma3_text": ["--sliding-window", "8", "--query-pre-attn-scalar", "24"],
    "phi3": ["--sliding-window", "12", "--partial-rotary", "0.5", "--longrope", "40", "--no-tie"],
    "olmo2": ["--no-tie"],
    "smollm3": [],
}
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs")
    return {arch: make_ckpt(root / arch, "--arch", arch, *SHAPE, *extra) for arch, extra in ARCHS.items()}


def hf_model(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_first(path: Path, ids: list[int]) -> np.ndarray:
    import torch

    with torch.no_grad():
        return hf_model(path)(torch.tensor([ids])).logits[0, -1].numpy()


def hf_greedy(path: Path, prompts: list[list[int]], n: int) -> tuple[list[list[int]], np.ndarray]:
    import torch

    m = hf_model(path)
    outs = []
    with torch.no_grad():
        first = m(torch.tensor([prompts[0]])).logits[0, -1].numpy()
        for p in prompts:
            out = m.generate(
                torch.tensor([p]),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            outs.append(out[0, len(p) :].tolist())
    return outs, first


def assert_close(mine: np.ndarray, ref: np.ndarray, what: str) -> None:
    diff = float(np.abs(mine - ref).max())
    assert diff <= REL_TOL * max(1.0, float(np.abs(ref).max())), (what, diff)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_matches_transformers(arch, ckpts):
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    path = ckpts[arch]
    want, ref_first = hf_greedy(path, PROMPTS, N_TOKENS)
    # three prompts at once: the engine's batched decode (decode_rows.decode_batch -> ExtTransformer.decode_rows);
    # prefill chunks of 10 (chunked prefill past the window; Phi-3's switch to the long factors mid-prompt)
    llm = LLM(str(path), backend="torch", parallel=3, prefill_size=10)
    try:
        model = llm.engine.model
        assert model.info.arch == arch  # native: no "(transformers fallback)"
        assert type(model.module).__name__ == "ExtTransformer"
        model.free([-1])
        assert_close(model.logits(-1, PROMPT, 0).float().numpy(), ref_first, arch)
        model.free([-1])
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == want, arch
    finally:
        llm.close()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_decode_equals_solo(arch, ckpts):
    """decode_batch over three sequences of different lengths gives each the logits it gets alone."""
    import torch

    from swiftlm import LLM
    from swiftlm.backends.torch.decode_rows import decode_batch

    prompts = PROMPTS + [PROMPT[:38]]  # the last one reaches Phi-3's switch (40) in the batch: rows one at a time
    llm = LLM(str(ckpts[arch]), backend="torch")
    try:
        tm = llm.engine.model
        steps = 6
        solo = []
        for i, p in enumerate(prompts):
            rows, ids = [tm.logits(100 + i, p, 0)], list(p)
            for _ in range(steps):
                ids.append(int(rows[-1].argmax()))
                rows.append(tm.logits(100 + i, ids[-1:], len(ids) - 1))
            solo.append((rows, ids))
        for i, p in enumerate(prompts):
            tm.logits(200 + i, p, 0)
        for s in range(steps):
            with torch.inference_mode():
                out = decode_batch(
                    tm.module,
                    [tm._cache(200 + i, len(p) + s) for i, p in enumerate(prompts)],
                    [solo[i][1][len(p) + s] for i, p in enumerate(prompts)],
                    [len(p) + s for p in prompts],
                )
            for i in range(len(prompts)):
                assert_close(out[i].float().numpy(), solo[i][0][s + 1].float().numpy(), (arch, s, i))
    finally:
        llm.close()


@pytest.mark.parametrize("arch", ["gemma2", "phi3", "smollm3"])
def test_packed_equals_per_sequence(arch, ckpts):
    """Several sequences packed in one forward (the embeddings path, PackedAttend) as each alone."""
    import torch

    from swiftlm import LLM
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.model import PackedAttend

    llm = LLM(str(ckpts[arch]), backend="torch")
    try:
        m = llm.engine.model.module
        with torch.inference_mode():
            packed = m.hidden(torch.tensor(sum(PROMPTS, [])), PackedAttend([len(p) for p in PROMPTS], "cpu"), 0)
            alone = torch.cat(
                [m.hidden(torch.tensor(p), SeqCache(m.a, torch.float32, torch.device("cpu")), 0) for p in PROMPTS]
            )
        assert_close(packed.numpy(), alone.numpy(), arch)
    finally:
        llm.close()


def test_gemma3_transformers5_layout(tmp_path):
    """A Gemma 3 config as transformers 5 writes it (nested rope_parameters per layer type, explicit
    layer_types with a global layer between sliding ones, linear scaling on the global rope)."""
    from test_torch_config_fields import hf_greedy as hf_sdpa_greedy
    from test_torch_config_fields import ours, write_hf

    tok = make_ckpt(
        tmp_path / "tok",
        "--arch",
        "llama",
        "--hidden",
        "64",
        "--layers",
        "1",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "64",
        "--dtype",
        "float32",
    )
    path = write_hf(
        tok,
        tmp_path / "g3",
        "gemma3_text",
        num_hidden_layers=3,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
        query_pre_attn_scalar=24,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
        },
    )
    cfg = json.loads((path / "config.json").read_text())
    assert "full_attention" in cfg["rope_parameters"]  # the layout this test is about
    ref_tokens, ref_first = hf_sdpa_greedy(path, PROMPT, N_TOKENS)
    (mine, other), first = ours(path, [PROMPT, PROMPT[:11]], N_TOKENS, parallel=2, prefill_size=10)
    assert_close(first, ref_first, "gemma3 tf5")
    assert mine == ref_tokens
    assert other == hf_sdpa_greedy(path, PROMPT[:11], N_TOKENS)[0]


# config edits that switch one feature off (or change it): transformers' logits move by far more than
# the tolerance, so the equality tests above would catch a native path that ignored the feature
BITES = {
    "gemma2 attn_logit_softcapping": ("gemma2", {"attn_logit_softcapping": None}),
    "gemma2 final_logit_softcapping": ("gemma2", {"final_logit_softcapping": None}),
    "gemma2 query_pre_attn_scalar": ("gemma2", {"query_pre_attn_scalar": 16}),
    "gemma2 sliding_window": ("gemma2", {"sliding_window": 4096}),
    "gemma3 rope_local_base_freq": ("gemma3_text", {"rope_local_base_freq": 1_000_000.0}),
    "gemma3 rope_scaling": ("gemma3_text", {"rope_scaling": None}),
    "gemma3 sliding_window_pattern": ("gemma3_text", {"sliding_window_pattern": 4}),
    "phi3 long_factor": ("phi3", {"rope_scaling.long_factor": [1.0] * 4}),
    "phi3 partial_rotary_factor (with longrope)": ("phi3", {"partial_rotary_factor": 1.0, "rope_scaling": None}),
    "phi3 sliding_window": ("phi3", {"sliding_window": None}),
    "smollm3 no_rope_layers": ("smollm3", {"no_rope_layers": [1, 1, 1, 1]}),
}


@pytest.mark.parametrize("case", sorted(BITES))
def test_feature_bites(case, ckpts, tmp_path):
    arch, edit = BITES[case]
    path = tmp_path / "edited"
    shutil.copytree(ckpts[arch], path)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in edit.items():
        if k.startswith("rope_scaling."):
            cfg["rope_scaling"][k.split(".", 1)[1]] = v
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
    a, b = hf_first(ckpts[arch], PROMPT), hf_first(path, PROMPT)
    assert float(np.abs(a - b).max()) > 100 * REL_TOL * max(1.0, float(np.abs(a).max())), case


REFUSED = {
    "gemma2": {"hidden_activation": "gelu"},
    "gemma3_text": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "phi3": {"rope_scaling": {"type": "longrope", "short_factor": [1.0] * 3, "long_factor": [1.0] * 4}},
    "olmo2": {"attention_bias": True},
    "smollm3": {"no_rope_layers": [1, 0]},
}
REFUSED_FIELD = {
    "gemma2": "hidden_activation='gelu'",
    "gemma3_text": "rope_parameters.full_attention.rope_type='yarn'",
    "phi3": "rope_scaling.short_factor=[1.0, 1.0, 1.0]",
    "olmo2": "attention_bias=True",
    "smollm3": "no_rope_layers=[1, 0]",
}


@pytest.mark.parametrize("arch", sorted(REFUSED))
def test_unimplemented_value_refused(arch, ckpts, tmp_path):
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    path = tmp_path / "ck"
    shutil.copytree(ckpts[arch], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(REFUSED[arch])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture) as exc:
        LLM(str(path), backend="torch")
    assert f"config field {REFUSED_FIELD[arch]} ({arch}) is not implemented" in str(exc.value)
    assert str(exc.value).count(". ") == 0  # one sentence


def test_llama_still_refuses_their_fields():
    """Soft caps, longrope and partial rotary stay refused on the llama family (implemented per architecture)."""
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.errors import UnsupportedArchitecture

    base = {
        "model_type": "llama",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 4,
        "intermediate_size": 8,
    }
    for extra in (
        {"attn_logit_softcapping": 50.0},
        {"partial_rotary_factor": 0.5},
        {
            "rope_scaling": {
                "rope_type": "longrope",
                "short_factor": [1.0],
                "long_factor": [1.0],
                "original_max_position_embeddings": 4,
            }
        },
    ):
        with pytest.raises(UnsupportedArchitecture):
            Args.from_config({**base, **extra})


CUDA_FEATURE = {
    "gemma2": "attn_logit_softcapping=3.0",
    "gemma3_text": "q/k norms and a rope base per layer type",
    "phi3": "rope_scaling.rope_type='longrope'",
    "olmo2": "norms after attention and MLP",
    "smollm3": "no_rope_layers",
}


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_eager_on_cuda(arch, ckpts):
    """On CUDA these layers run on the eager path (the graphs, slot pool prefill and paged attention run the
    llama-family layer): a single process picks it, a tensor-parallel rank / pipeline stage is refused."""
    import torch

    from swiftlm.backends.torch.build import check_device
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.runner import cuda_eager_reason
    from swiftlm.errors import UnsupportedArchitecture

    a = Args.from_config(json.loads((ckpts[arch] / "config.json").read_text()))
    assert a.needs_eager
    why = cuda_eager_reason(a, torch.device("cuda"), 256)
    assert why.startswith(f"architecture {arch!r} ({CUDA_FEATURE[arch]}")
    assert cuda_eager_reason(a, torch.device("cpu"), 256) is None
    check_device(a, torch.device("cpu"))
    check_device(a, torch.device("cuda"), eager=True)
    with pytest.raises(UnsupportedArchitecture) as exc:
        check_device(a, torch.device("cuda"))
    msg = str(exc.value)
    assert msg.startswith(f"architecture {arch!r} ({CUDA_FEATURE[arch]}") and "--tensor-parallel" in msg
    assert msg.count(". ") == 0


def test_single_process_flags_refused(ckpts):
    """--tensor-parallel, --pipeline-parallel, --adapter and --gpu-layers run the llama-family layer only."""
    from types import SimpleNamespace

    import torch

    from swiftlm.backends.torch.build import build
    from swiftlm.backends.torch.lora import attach
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.parallel import make_plan
    from swiftlm.backends.torch.pipeline import check_split
    from swiftlm.errors import ConfigError

    cfg = json.loads((ckpts["gemma2"] / "config.json").read_text())
    for call, flag in (
        (lambda: make_plan(cfg, 0, 2), "--tensor-parallel"),
        (lambda: check_split(cfg, 2), "--pipeline-parallel"),
        (lambda: attach(SimpleNamespace(a=Args.from_config(cfg)), ["x=/nonexistent"]), "--adapter"),
        (lambda: build(cfg, {}, torch.float32, torch.device("cpu"), first_cpu_layer=1), "--gpu-layers"),
    ):
        with pytest.raises(ConfigError, match=f"^{flag} is not available for architecture 'gemma2'"):
            call()


def test_compressed_cache_and_restored_longrope_refused(ckpts):
    import torch

    from swiftlm import LLM
    from swiftlm.backends.torch.kv_cache import SeqCache

    llm = LLM(str(ckpts["phi3"]), backend="torch")
    try:
        m = llm.engine.model.module
        with torch.inference_mode(), pytest.raises(NotImplementedError, match="compressed KV cache is not implemented"):
            m(torch.tensor(PROMPT[:4]), object(), 0)
        # rows 0..35 restored from the prompt cache (no tokens known): the switch at 40 cannot re-run them
        c = SeqCache(m.a, torch.float32, torch.device("cpu"))
        with torch.inference_mode():
            m(torch.tensor(PROMPT[:36]), c, 0)
        del c.longrope_ids
        with torch.inference_mode(), pytest.raises(NotImplementedError, match="restored from the prompt cache"):
            m(torch.tensor(PROMPT[36:44]), c, 36)
    finally:
        llm.close()


def test_info_says_native(ckpts):
    from swiftlm.backends.torch import TorchBackend
    from swiftlm.registry import resolve

    for arch, path in ckpts.items():
        assert TorchBackend().model_path(resolve(str(path))) == "native", arch
