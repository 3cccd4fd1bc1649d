"""torch backend: the architectures of backends/torch/archs_moe.py (GPT-OSS; DeepSeek-V2 / V3 with
multi-head latent attention) run natively and equal transformers' own implementation.

Checkpoints: random weights from scripts/make_checkpoint.py (hub layout, the bundled SmolLM2 tokenizer),
fp32, with a sliding window of 8 (GPT-OSS), YaRN rope from an original context of 64 to 256 (all three;
DeepSeek with ``mscale`` / ``mscale_all_dim``), a tight SwiGLU clamp (GPT-OSS), grouped routing with 4 groups
of 2 experts (DeepSeek-V2 ``group_limited_greedy`` keeping 1 group -- with its best-expert group score, keeping
as many groups as experts chosen would change nothing --, V3 ``noaux_tc`` keeping 2, with a score correction
bias), a dense
first layer, shared experts, DeepSeek-V2 without and V3 with ``q_lora_rank``, so that every feature bites at
these prompt lengths (``test_feature_bites`` checks that it does).  The reference is transformers' model on
the same directory: fp32, CPU, eager attention (the path that applies GPT-OSS's sinks in plain torch).

Tolerance of the first-step logits: 1e-4 x max(1, max |logit|).  Both sides compute in fp32; what differs is
the order of operations (fused projections, SDPA against eager softmax, MLA decode in the latent space
against transformers' expanded keys and values, rope tables computed in fp64 then rounded), which moves the
logits by rounding only, while a feature left out moves them by far more than the tolerance
(``test_feature_bites`` requires 100x).  Greedy tokens must be identical.
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
PROMPT = BASE * 2  # 48 tokens: past GPT-OSS's window (8)
PROMPTS = [PROMPT, PROMPT[:7], PROMPT[5:30]]  # the short one crosses the window while decoding
MOE = [
    "--hidden",
    "64",
    "--heads",
    "4",
    "--experts",
    "8",
    "--experts-per-token",
    "2",
    "--moe-intermediate",
    "32",
    "--dtype",
    "float32",
    "--ctx",
    "256",
    "--no-tie",
    "--yarn",
    "64",
]
ARCHS = {
    "gpt_oss": [
        "--layers",
        "4",
        "--kv-heads",
        "2",
        "--head-dim",
        "16",
        "--sliding-window",
        "8",
        "--swiglu-limit",
        "1.5",
    ],
    "deepseek_v2": [
        "--layers",
        "3",
        "--intermediate",
        "128",
        "--q-lora-rank",
        "0",
        "--shared-experts",
        "2",
        "--n-group",
        "4",
        "--topk-group",
        "1",
        "--routed-scale",
        "1.5",
        "--mscale",
        "0.707",
        "0.707",
    ],
    "deepseek_v3": [
        "--layers",
        "3",
        "--intermediate",
        "128",
        "--n-group",
        "4",
        "--topk-group",
        "2",
        "--routed-scale",
        "2.5",
        "--mscale",
        "1.0",
        "0.8",
    ],
}
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("archs_moe")
    return {arch: make_ckpt(root / arch, "--arch", arch, *MOE, *extra) for arch, extra in ARCHS.items()}


def hf_model(path: Path):
    import torch
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()


def hf_first(path: Path, ids: list[int], edit=None) -> np.ndarray:
    import torch

    m = hf_model(path)
    with torch.no_grad():
        if edit is not None:
            edit(m)
        return m(torch.tensor([ids])).logits[0, -1].numpy()


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


def assert_close(mine: np.ndarray, ref: np.ndarray, what) -> None:
    diff = float(np.abs(mine - ref).max())
    assert diff <= REL_TOL * max(1.0, float(np.abs(ref).max())), (what, diff)


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_matches_transformers(arch, ckpts):
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    path = ckpts[arch]
    want, ref_first = hf_greedy(path, PROMPTS, N_TOKENS)
    # three prompts at once: the engine's batched decode (decode_rows.decode_batch -> MoeTransformer.decode_rows);
    # prefill chunks of 10 (chunked prefill past the window; MLA's expanded chunk attention over cached latents)
    llm = LLM(str(path), backend="torch", parallel=3, prefill_size=10)
    try:
        model = llm.engine.model
        assert model.info.arch == arch  # native: no "(transformers fallback)"
        assert type(model.module).__name__ == "MoeTransformer"
        model.free([-1])
        assert_close(model.logits(-1, PROMPT, 0).float().numpy(), ref_first, arch)
        model.free([-1])
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == want, arch
    finally:
        llm.close()


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_batched_decode_equals_solo(arch, ckpts):
    """decode_batch over four sequences of different lengths gives each the logits it gets alone."""
    import torch

    from swiftlm import LLM
    from swiftlm.backends.torch.decode_rows import decode_batch

    prompts = PROMPTS + [PROMPT[:38]]
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


@pytest.mark.parametrize("arch", sorted(ARCHS))
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


def test_latent_cache(ckpts):
    """MLA caches the latent (kv_lora_rank + qk_rope_head_dim per position and layer), not per-head K/V."""
    from swiftlm import LLM

    for arch in ("deepseek_v2", "deepseek_v3"):
        cfg = json.loads((ckpts[arch] / "config.json").read_text())
        width = cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]
        llm = LLM(str(ckpts[arch]), backend="torch")
        try:
            tm = llm.engine.model
            a = tm.module.a
            assert (a.kv_heads, a.head_dim) == (1, -(-width // 2))
            assert tm.info.kv_bytes_per_token == cfg["num_hidden_layers"] * width * 4  # fp32
            tm.logits(7, PROMPT, 0)
            c = tm.caches[7]
            assert tuple(c.k[0].shape[::2]) == (1, -(-width // 2)) and c.length == len(PROMPT)
        finally:
            llm.close()


def _zero(*names):
    """A model edit: these parameters (a suffix of their names) set to zero in every layer."""

    def edit(m):
        for n, p in m.named_parameters():
            if n.endswith(names):
                p.zero_()
        for n, b in m.named_buffers():
            if n.endswith(names):
                b.zero_()

    return edit


def _sinks_off(m):
    for layer in m.model.layers:
        layer.self_attn.sinks.fill_(-1e30)


# edits that switch one feature off (or change it): transformers' logits move by far more than the tolerance,
# so the equality tests above would catch a native path that ignored the feature.  (arch, config edit, model edit)
BITES = {
    "gpt_oss sinks": ("gpt_oss", {}, _sinks_off),
    "gpt_oss sliding_window": ("gpt_oss", {"sliding_window": 4096}, None),
    "gpt_oss yarn": ("gpt_oss", {"rope_scaling": None}, None),
    "gpt_oss swiglu_limit": ("gpt_oss", {"swiglu_limit": 7.0}, None),
    "gpt_oss swiglu_alpha": ("gpt_oss", {"swiglu_alpha": 1.0}, None),
    "gpt_oss router bias": ("gpt_oss", {}, _zero("router.bias")),
    "gpt_oss expert biases": ("gpt_oss", {}, _zero("gate_up_proj_bias", "down_proj_bias")),
    "gpt_oss attention bias": ("gpt_oss", {}, _zero("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")),
    "deepseek_v2 group_limited_greedy": ("deepseek_v2", {"topk_method": "greedy"}, None),
    "deepseek_v2 routed_scaling_factor": ("deepseek_v2", {"routed_scaling_factor": 1.0}, None),
    "deepseek_v2 shared experts": ("deepseek_v2", {}, _zero("shared_experts.down_proj.weight")),
    "deepseek_v2 yarn": ("deepseek_v2", {"rope_scaling": None}, None),
    "deepseek_v2 mscale_all_dim": ("deepseek_v2", {"rope_scaling.mscale_all_dim": 0.0}, None),
    "deepseek_v3 e_score_correction_bias": ("deepseek_v3", {}, _zero("e_score_correction_bias")),
    "deepseek_v3 topk_group": ("deepseek_v3", {"topk_group": 4}, None),
    "deepseek_v3 norm_topk_prob": ("deepseek_v3", {"norm_topk_prob": False}, None),
    "deepseek_v3 mscale": ("deepseek_v3", {"rope_scaling.mscale": 0.0}, None),
    "deepseek_v3 rope_interleave": ("deepseek_v3", {"rope_interleave": False}, None),
    "deepseek_v3 dense first layer": ("deepseek_v3", {}, _zero("layers.0.mlp.down_proj.weight")),
}


@pytest.mark.parametrize("case", sorted(BITES))
def test_feature_bites(case, ckpts, tmp_path):
    arch, cfg_edit, model_edit = BITES[case]
    path = tmp_path / "edited"
    shutil.copytree(ckpts[arch], path)
    cfg = json.loads((path / "config.json").read_text())
    for k, v in cfg_edit.items():
        if k.startswith("rope_scaling."):
            cfg["rope_scaling"][k.split(".", 1)[1]] = v
        else:
            cfg[k] = v
    (path / "config.json").write_text(json.dumps(cfg))
    a, b = hf_first(ckpts[arch], PROMPT), hf_first(path, PROMPT, model_edit)
    assert float(np.abs(a - b).max()) > 100 * REL_TOL * max(1.0, float(np.abs(a).max())), case


REFUSED = [
    ("gpt_oss", {"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config.quant_method='mxfp4'"),
    ("gpt_oss", {"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, "rope_scaling.rope_type='longrope'"),
    ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob=True"),
    ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ("deepseek_v2", {"mlp_bias": True}, "mlp_bias=True"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ("deepseek_v3", {"n_group": 3}, "n_group=3"),
    ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq=2"),
    ("deepseek_v3", {"num_key_value_heads": 2}, "num_key_value_heads=2"),
]


@pytest.mark.parametrize("arch,edit,field", REFUSED, ids=[f for _, _, f in REFUSED])
def test_unimplemented_value_refused(arch, edit, field, ckpts, tmp_path):
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.errors import UnsupportedArchitecture

    cfg = json.loads((ckpts[arch] / "config.json").read_text())
    cfg.update(edit)
    with pytest.raises(UnsupportedArchitecture) as exc:
        Args.from_config(cfg)
    assert f"config field {field} ({arch}) is not implemented" in str(exc.value)
    assert str(exc.value).count(". ") == 0  # one sentence


def test_unimplemented_value_refused_at_load(ckpts, tmp_path):
    """The same refusal through LLM(...) (GPT-OSS's published MXFP4 experts)."""
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    path = tmp_path / "ck"
    shutil.copytree(ckpts["gpt_oss"], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4"}
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture, match="quantization_config.quant_method='mxfp4'"):
        LLM(str(path), backend="torch")


CUDA_FEATURE = {
    "gpt_oss": "attention sinks",
    "deepseek_v2": "multi-head latent attention",
    "deepseek_v3": "multi-head latent attention",
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
    assert cuda_eager_reason(a, torch.device("cuda"), 256) == f"architecture {arch!r} ({CUDA_FEATURE[arch]})"
    assert cuda_eager_reason(a, torch.device("cpu"), 256) is None
    check_device(a, torch.device("cpu"))
    check_device(a, torch.device("cuda"), eager=True)
    with pytest.raises(UnsupportedArchitecture) as exc:
        check_device(a, torch.device("cuda"))
    msg = str(exc.value)
    assert msg.startswith(f"architecture {arch!r} ({CUDA_FEATURE[arch]})") and "--pipeline-parallel" in msg
    assert msg.count(". ") == 0


def test_single_process_flags_refused(ckpts):
    """--tensor-parallel, --pipeline-parallel, --adapter, --gpu-layers and --stream-experts run the llama-family
    layer only."""
    from types import SimpleNamespace

    import torch

    from swiftlm.backends.torch.build import build
    from swiftlm.backends.torch.lora import attach
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.parallel import make_plan
    from swiftlm.backends.torch.pipeline import check_split
    from swiftlm.errors import ConfigError

    for arch in ("gpt_oss", "deepseek_v3"):
        cfg = json.loads((ckpts[arch] / "config.json").read_text())
        cpu = torch.device("cpu")
        for call, flag in (
            (lambda: make_plan(cfg, 0, 2), "--tensor-parallel"),
            (lambda: check_split(cfg, 2), "--pipeline-parallel"),
            (lambda: attach(SimpleNamespace(a=Args.from_config(cfg)), ["x=/nonexistent"]), "--adapter"),
            (lambda: build(cfg, {}, torch.float32, cpu, first_cpu_layer=1), "--gpu-layers"),
            (lambda: build(cfg, {}, torch.float32, cpu, expert_reader=object()), "--stream-experts"),
        ):
            with pytest.raises(ConfigError, match=f"^{flag} is not available for architecture '{arch}'"):
                call()


def test_compressed_cache_refused(ckpts):
    import torch

    from swiftlm import LLM

    llm = LLM(str(ckpts["deepseek_v2"]), backend="torch")
    try:
        m = llm.engine.model.module
        with torch.inference_mode(), pytest.raises(NotImplementedError, match="compressed KV cache is not implemented"):
            m(torch.tensor(PROMPT[:4]), object(), 0)
    finally:
        llm.close()


def test_info_says_native(ckpts):
    from swiftlm.backends.torch import TorchBackend
    from swiftlm.registry import resolve

    for arch, path in ckpts.items():
        assert TorchBackend().model_path(resolve(str(path))) == "native", arch
