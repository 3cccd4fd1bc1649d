"""torch backend: every config field that changes the math is implemented (and matches
transformers) or refused with one sentence naming the field and value.

Checkpoints are written by transformers itself (its config class + ``from_config`` +
``save_pretrained``, random weights), with the bundled SmolLM2 tokenizer copied in; the
reference is transformers' own model on the same directory, fp32 on CPU.
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
PROMPT = [1, 17, 300, 4021, 77, 901, 12, 5, 6000, 33, 2048, 700, 18, 19, 4000, 8, 9, 10, 11, 1200, 3, 50, 51, 52]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    return make_ckpt(
        tmp_path_factory.mktemp("tok") / "base",
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


def write_hf(tok_dir: Path, out: Path, model_type: str, **extra) -> Path:
    """A random transformers checkpoint of ``model_type`` (hidden 64, 2 layers) with our tokenizer."""
    import torch
    import transformers

    base = json.loads((tok_dir / "config.json").read_text())
    kw = dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=base["vocab_size"],
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=base["bos_token_id"],
        eos_token_id=base["eos_token_id"],
        initializer_range=0.25,
        rms_norm_eps=1e-6,
    )
    kw.update(extra)
    cfg = transformers.AutoConfig.for_model(model_type, **kw)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in tok_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special_tokens") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def hf_greedy(path: Path, ids: list[int], n: int) -> tuple[list[int], np.ndarray]:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    with torch.no_grad():
        first = m(torch.tensor([ids])).logits[0, -1].float().numpy()
        out = m.generate(
            torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n, pad_token_id=0, eos_token_id=None
        )
    return out[0, len(ids) :].tolist(), first


def ours(path: Path, prompts: list[list[int]], n: int, **kw):
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    llm = LLM(str(path), backend="torch", **kw)
    try:
        model = llm.engine.model
        model.free([-1])
        first = model.logits(-1, prompts[0], 0).float().numpy()
        model.free([-1])
        outs = llm.generate(prompts, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return [o.token_ids for o in outs], first
    finally:
        llm.close()


CASES = {
    "linear": ("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "dynamic": ("llama", dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    "yarn": (
        "qwen2",
        dict(
            rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
            max_position_embeddings=64,
        ),
    ),
    "llama3": (
        "llama",
        dict(
            rope_scaling={
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        ),
    ),
    "mistral_window": ("mistral", dict(sliding_window=8)),
    "qwen2_window": ("qwen2", dict(sliding_window=8, use_sliding_window=True, max_window_layers=1)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_field_matches_transformers(case, tok_dir, tmp_path):
    arch, extra = CASES[case]
    path = write_hf(tok_dir, tmp_path / case, arch, **extra)
    ref_tokens, ref_first = hf_greedy(path, PROMPT, N_TOKENS)
    # two prompts at once: the batched decode path (decode_batch) as well as the single-row one;
    # a small prefill chunk: chunked prefill past the window / original context
    (mine, other), first = ours(path, [PROMPT, PROMPT[:11]], N_TOKENS, parallel=2, prefill_size=10)
    diff = float(np.abs(first - ref_first).max())
    assert diff <= 1e-4 * max(1.0, float(np.abs(ref_first).max())), (case, diff)
    assert mine == ref_tokens, case
    assert other == hf_greedy(path, PROMPT[:11], N_TOKENS)[0], case


def test_window_changes_output(tok_dir, tmp_path):
    """The sliding window really bites at this prompt length (else the window tests prove nothing)."""
    a = write_hf(tok_dir, tmp_path / "w", "mistral", sliding_window=8)
    b = write_hf(tok_dir, tmp_path / "full", "mistral", sliding_window=None)
    assert hf_greedy(a, PROMPT, 8)[1].tolist() != hf_greedy(b, PROMPT, 8)[1].tolist()


REFUSED = {
    "rope_scaling.rope_type='longrope'": {
        "rope_scaling": {
            "rope_type": "longrope",
            "long_factor": [1.0] * 8,
            "short_factor": [1.0] * 8,
            "original_max_position_embeddings": 64,
        }
    },
    "rope_scaling.rope_type='su'": {"rope_scaling": {"type": "su", "factor": 2.0}},
    "partial_rotary_factor=0.5": {"partial_rotary_factor": 0.5},
    "attn_logit_softcapping=50.0": {"attn_logit_softcapping": 50.0},
    "final_logit_softcapping=30.0": {"final_logit_softcapping": 30.0},
    "hidden_act='gelu'": {"hidden_act": "gelu"},
    "mlp_bias=True": {"mlp_bias": True},
    "rope_scaling.mscale=0.707": {
        "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "mscale": 0.707, "original_max_position_embeddings": 64}
    },
    "rope_scaling.original_max_position_embeddings=None": {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
    "layer_types='chunked_attention'": {"layer_types": ["chunked_attention", "full_attention"]},
    "decoder_sparse_step=2": {"decoder_sparse_step": 2},
    "mlp_only_layers=[0]": {"mlp_only_layers": [0]},
}


@pytest.mark.parametrize("sentence", sorted(REFUSED))
def test_unknown_value_refused(sentence, tok_dir, tmp_path):
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    path = tmp_path / "ck"
    shutil.copytree(tok_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(REFUSED[sentence])
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitecture) as exc:
        LLM(str(path), backend="torch")
    assert f"config field {sentence} " in str(exc.value)
    assert str(exc.value).count(". ") == 0  # one sentence


def test_window_eager_on_cuda():
    """CUDA graphs / paged attention attend to the whole context: a live window runs on the eager path there
    (one process), and is refused for tensor-parallel ranks / pipeline stages; a window no shorter than the
    served context changes nothing, so such a model keeps the static path."""
    import torch

    from swiftlm.backends.torch.build import check_device
    from swiftlm.backends.torch.model_config import Args
    from swiftlm.backends.torch.runner import cuda_eager_reason
    from swiftlm.errors import UnsupportedArchitecture

    c = {
        "model_type": "mistral",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 4,
        "sliding_window": 4,
        "max_position_embeddings": 16,
        "intermediate_size": 8,
    }
    a = Args.from_config(c)
    assert a.windows == (4,) and a.needs_eager
    assert cuda_eager_reason(a, torch.device("cuda"), 16) == "config field sliding_window=4"
    assert cuda_eager_reason(a, torch.device("cuda"), 4) is None  # --ctx-size 4: the window never bites
    check_device(a, torch.device("cpu"))
    check_device(a, torch.device("cuda"), eager=True)
    with pytest.raises(
        UnsupportedArchitecture,
        match="^config field sliding_window=4 runs on CUDA only in a single-process model .*--tensor-parallel",
    ):
        check_device(a, torch.device("cuda"))


def test_window_not_applied_when_off():
    from swiftlm.backends.torch.model_config import Args

    base = {
        "hidden_size": 8,
        "num_hidden_layers": 3,
        "num_attention_heads": 2,
        "vocab_size": 4,
        "max_position_embeddings": 64,
        "intermediate_size": 8,
        "sliding_window": 16,
    }
    assert Args.from_config({**base, "model_type": "qwen2"}).windows == ()  # use_sliding_window false
    assert Args.from_config(
        {**base, "model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 2}
    ).windows == (0, 0, 16)
    assert Args.from_config({**base, "model_type": "mistral", "sliding_window": 64}).windows == ()  # >= ctx
    assert Args.from_config({**base, "model_type": "llama"}).windows == ()


@pytest.mark.parametrize(
    "arch,meta,field",
    [
        ("qwen2moe", {}, "GGUF architecture 'qwen2moe' (general.architecture) is not supported by the torch backend"),
        ("phi3", {}, "GGUF architecture 'phi3' (general.architecture) is not supported by the torch backend"),
        ("llama", {"llama.expert_count": 8}, "GGUF field llama.expert_count=8 is not implemented"),
        ("llama", {"llama.rope.scaling.type": "yarn"}, "GGUF field llama.rope.scaling.type='yarn' is not implemented"),
    ],
)
def test_gguf_non_llama_refused(arch, meta, field):
    from types import SimpleNamespace

    from swiftlm.backends.torch.loader import check_arch
    from swiftlm.errors import UnsupportedArchitecture

    spec = SimpleNamespace(format="gguf", arch=arch, gguf_meta=meta, config={"model_type": arch})
    with pytest.raises(UnsupportedArchitecture, match=field.replace("(", r"\(").replace(")", r"\)")):
        check_arch(spec)


def test_gguf_llama_accepted(bundled_gguf):
    from swiftlm.backends.torch.loader import check_arch
    from swiftlm.registry import resolve

    spec = resolve(str(bundled_gguf))
    assert spec.arch == "llama"
    check_arch(spec)  # the bundled SmolLM2 GGUF: no refusal
