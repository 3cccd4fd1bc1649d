"""torch backend: qwen2 / qwen3 (and llama) GGUFs load natively and equal the HF checkpoint they came
from; what the GGUF reader cannot do is refused in one sentence naming the GGUF key and value.

Checkpoints: tiny random fp32 ones (the bundled SmolLM2 tokenizer): qwen3 from scripts/make_checkpoint.py
(head_dim 32 != hidden / heads, so ``qwen3.attention.key_length`` matters), qwen2 written with
transformers' own Qwen2ForCausalLM (make_checkpoint.py has no qwen2) with random, nonzero q/k/v
biases.  GGUFs: scripts/write_gguf.py, which names and lays out tensors and metadata as llama.cpp's
convert_hf_to_gguf.py (gguf-py's TensorNameMap; Q/K rows permuted for llama only).

Tolerances.  F32 GGUF vs the HF directory, both through the torch backend: the same fp32 weights in
the same code, so the first-step logits agree within 1e-5 x max |logit| (they are expected identical).  Against
transformers' AutoModelForCausalLM on the HF directory: the fp32 summation-order bound of
tests/tolerances.py.  Q8_0: the reference is an HF directory holding the Q8_0 round-tripped weights
(gguf-py's quantize then dequantize), so the same 1e-5 bound applies and the test checks that the
quantized blocks are read, not only that the model is close.  Greedy tokens must be identical.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import ROOT, make_ckpt, needs_torch
from tolerances import transformer_logits_tol

pytestmark = [needs_torch]

sys.path.insert(0, str(ROOT / "scripts"))

PROMPT = [1, 17, 300, 4021, 77, 901, 12, 5, 6000, 33, 2048, 700, 18, 19, 4000, 8, 9, 10, 11, 1200]
N_TOKENS = 16
REL_TOL = 1e-5
SHAPE = [
    "--hidden",
    "64",
    "--layers",
    "2",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--intermediate",
    "128",
    "--dtype",
    "float32",
    "--ctx",
    "256",
]


def _tokenizer():
    from swiftlm.registry import resolve
    from swiftlm.tokenizer import load_gguf_tokenizer

    return load_gguf_tokenizer(resolve(None).gguf_meta or {})


def make_qwen2(out: Path, tie: bool, seed: int = 0) -> Path:
    """A random Qwen2 checkpoint written by transformers itself (config.json as the hub has it)."""
    import torch
    import transformers

    tok = _tokenizer()
    cfg = transformers.Qwen2Config(
        vocab_size=tok.vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_theta=1000000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
        use_sliding_window=False,
    )
    model = transformers.Qwen2ForCausalLM(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith(".bias"):
                p.copy_(0.5 * r)  # biases that move the logits (HF initialises them to 0)
            elif "embed_tokens" in name:
                p.copy_(0.5 * r)
            else:
                p.copy_(r / p.shape[1] ** 0.5)
    model.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(out)
    return out


def gguf(hf_dir: Path, out: Path, qtype: str = "f32", **kw) -> Path:
    from write_gguf import write_gguf

    return write_gguf(hf_dir, out, qtype, **kw)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf_archs")
    return {
        "qwen2": make_qwen2(root / "qwen2", tie=False),
        "qwen2-tied": make_qwen2(root / "qwen2-tied", tie=True, seed=1),
        "qwen3": make_ckpt(root / "qwen3", "--arch", "qwen3", *SHAPE, "--head-dim", "32", "--no-tie"),
        "qwen3-tied": make_ckpt(root / "qwen3-tied", "--arch", "qwen3", *SHAPE, "--head-dim", "32", "--seed", "1"),
        "llama": make_ckpt(root / "llama", "--arch", "llama", *SHAPE, "--no-tie"),
    }


def torch_run(source: Path) -> tuple[np.ndarray, list[int], object]:
    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    llm = LLM(str(source), backend="torch")
    try:
        model = llm.engine.model
        model.free([-1])
        first = model.logits(-1, PROMPT, 0).float().numpy()
        model.free([-1])
        toks = llm.generate(PROMPT, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True)).token_ids
        return first, toks, model.info
    finally:
        llm.close()


def hf_run(path: Path) -> tuple[np.ndarray, list[int], object]:
    import torch
    import transformers

    m = transformers.AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        first = m(torch.tensor([PROMPT])).logits[0, -1].numpy()
        out = m.generate(
            torch.tensor([PROMPT]),
            max_new_tokens=N_TOKENS,
            min_new_tokens=N_TOKENS,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
    return first, out[0, len(PROMPT) :].tolist(), m.config


def assert_rel(mine: np.ndarray, ref: np.ndarray, what: str) -> None:
    diff = float(np.abs(mine - ref).max())
    assert diff <= REL_TOL * float(np.abs(ref).max()), (what, diff)


@pytest.mark.parametrize("name", ["qwen2", "qwen2-tied", "qwen3", "qwen3-tied", "llama"])
def test_f32_gguf_equals_hf_dir_and_transformers(name, ckpts, tmp_path):
    from swiftlm.registry import resolve

    hf_dir = ckpts[name]
    path = gguf(hf_dir, tmp_path / f"{name}.gguf")
    spec = resolve(str(path))
    arch = name.split("-")[0]
    assert spec.format == "gguf" and spec.arch == arch
    assert spec.config["tie_word_embeddings"] == name.endswith("-tied")
    g_first, g_toks, info = torch_run(path)
    assert info.arch == arch
    h_first, h_toks, _ = torch_run(hf_dir)
    assert_rel(g_first, h_first, name)
    assert g_toks == h_toks, name
    t_first, t_toks, t_cfg = hf_run(hf_dir)
    diff = float(np.abs(g_first - t_first).max())
    tol = transformer_logits_tol(t_cfg, float(np.abs(t_first).max()), len(PROMPT))
    assert diff <= tol, (name, diff, tol)
    assert g_toks == t_toks, name


def test_gguf_layout_as_llama_cpp(ckpts, tmp_path):
    """What the reader relies on, checked on the files: qwen2's biases and qwen3's q/k norms under
    llama.cpp's names, no ``output`` when tied, the head width in ``qwen3.attention.key_length``, and
    Q/K rows stored unpermuted for qwen (llama.cpp permutes them for llama only)."""
    from safetensors.numpy import load_file

    from swiftlm.convert import iter_dequantized
    from swiftlm.gguf_file import read_gguf_header
    from swiftlm.registry import resolve

    p2 = gguf(ckpts["qwen2-tied"], tmp_path / "q2.gguf")
    meta, tensors = read_gguf_header(p2)
    names = {t.name for t in tensors}
    assert {"blk.0.attn_q.bias", "blk.0.attn_k.bias", "blk.0.attn_v.bias"} <= names and "output.weight" not in names
    assert meta["qwen2.rope.freq_base"] == 1e6 and meta["general.architecture"] == "qwen2"
    p3 = gguf(ckpts["qwen3"], tmp_path / "q3.gguf")
    meta, tensors = read_gguf_header(p3)
    names = {t.name for t in tensors}
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight", "output.weight"} <= names
    assert meta["qwen3.attention.key_length"] == 32 and resolve(str(p3)).config["head_dim"] == 32
    for hf_dir, path, tied in ((ckpts["qwen2-tied"], p2, True), (ckpts["qwen3"], p3, False)):
        ref = load_file(str(hf_dir / "model.safetensors"))
        got = dict(iter_dequantized(resolve(str(path))))
        assert set(got) == {k for k in ref if not (tied and k == "lm_head.weight")}
        for k, v in got.items():
            np.testing.assert_array_equal(v, ref[k], err_msg=k)  # F32: bit for bit, rows as HF's


def _q8_roundtrip_dir(src: Path, out: Path) -> Path:
    """``src`` with every 2-D weight replaced by its Q8_0 round trip (gguf-py), as float32."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, out)
    for f in out.glob("*.safetensors"):
        w = load_file(str(f))
        w = {
            k: (
                dequantize(quantize(v, GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0)
                .reshape(v.shape)
                .astype(np.float32)
                if v.ndim == 2
                else v
            )
            for k, v in w.items()
        }
        save_file(w, str(f), metadata={"format": "pt"})
    return out


@pytest.mark.parametrize("name", ["qwen2", "qwen3-tied"])
def test_q8_0_gguf_reads_the_quantized_blocks(name, ckpts, tmp_path):
    path = gguf(ckpts[name], tmp_path / f"{name}.q8_0.gguf", "q8_0")
    from swiftlm.registry import resolve

    assert resolve(str(path)).quantization.startswith("gguf Q8_0")
    g_first, g_toks, _ = torch_run(path)
    r_first, r_toks, _ = torch_run(_q8_roundtrip_dir(ckpts[name], tmp_path / "ref"))
    assert_rel(g_first, r_first, name)
    assert g_toks == r_toks, name
    f_first, _, _ = torch_run(ckpts[name])  # and the quantization error is a quantization error's size
    assert float(np.abs(g_first - f_first).max()) <= 0.05 * float(np.abs(f_first).max())


def test_convert_qwen_gguf_to_hf_dir(ckpts, tmp_path):
    """``swiftlm convert`` on a qwen2 GGUF: a directory transformers loads, with the original logits."""
    from swiftlm.convert import convert_gguf

    path = gguf(ckpts["qwen2"], tmp_path / "q2.gguf")
    out = convert_gguf(str(path), str(tmp_path / "hf"), dtype="float32")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert cfg["rms_norm_eps"] == 1e-6 and cfg["attention_bias"] is True
    a, ta, _ = hf_run(out)
    b, tb, _ = hf_run(ckpts["qwen2"])
    assert_rel(a, b, "convert")
    assert ta == tb


def _refused(path: Path) -> str:
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture) as ei:
        LLM(str(path), backend="torch")
    msg = str(ei.value)
    assert "\n" not in msg and msg.count(". ") == 0, msg  # one sentence
    return msg


@pytest.mark.parametrize(
    "src,kw,want",
    [
        (
            "qwen2",
            {"arch": "qwen2moe", "extra": {"qwen2moe.expert_count": 4, "qwen2moe.expert_used_count": 2}},
            "GGUF architecture 'qwen2moe' (general.architecture) is not supported by the torch backend",
        ),
        (
            "qwen3",
            {"arch": "qwen3moe", "extra": {"qwen3moe.expert_count": 8}},
            "GGUF architecture 'qwen3moe' (general.architecture) is not supported by the torch backend",
        ),
        ("qwen3", {"arch": "phi3"}, "GGUF architecture 'phi3' (general.architecture) is not supported"),
        (
            "qwen2",
            {"extra": {"qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0}},
            "GGUF field qwen2.rope.scaling.type='yarn' is not implemented by the torch backend's GGUF reader",
        ),
        ("qwen3", {"extra": {"qwen3.rope.scaling.factor": 2.0}}, "GGUF field qwen3.rope.scaling.factor=2.0 is not"),
        ("qwen3", {"extra": {"qwen3.attention.sliding_window": 16}}, "GGUF field qwen3.attention.sliding_window=16 is"),
        ("qwen3", {"extra": {"qwen3.expert_count": 8}}, "GGUF field qwen3.expert_count=8 is not implemented"),
        ("qwen3", {"extra": {"qwen3.rope.dimension_count": 16}}, "GGUF field qwen3.rope.dimension_count=16 is not"),
        ("llama", {"extra": {"llama.final_logit_softcapping": 30.0}}, "GGUF field llama.final_logit_softcapping=30.0"),
    ],
)
def test_refused_naming_the_key(src, kw, want, ckpts, tmp_path):
    path = gguf(ckpts[src], tmp_path / "x.gguf", **kw)
    assert want in _refused(path)


def test_unknown_tensor_refused():
    from swiftlm.convert import hf_name
    from swiftlm.errors import UnsupportedArchitecture

    assert hf_name("blk.2.attn_q_norm.weight") == "model.layers.2.self_attn.q_norm.weight"
    assert hf_name("blk.0.attn_v.bias") == "model.layers.0.self_attn.v_proj.bias"
    for t in ("rope_freqs.weight", "blk.0.ffn_gate_exps.weight"):
        with pytest.raises(UnsupportedArchitecture, match=f"GGUF tensor '{t}' has no HF-format counterpart"):
            hf_name(t)


def test_qwen2_pre_tokenizer():
    """``tokenizer.ggml.pre = qwen2`` (Qwen2 / 2.5 / 3 GGUFs): Qwen's split regex (digits one by one,
    a punctuation character joined to the word after it), not GPT-2's."""
    from swiftlm.registry import resolve
    from swiftlm.tokenizer import _SPLIT_PRE, load_gguf_tokenizer

    meta = dict(resolve(None).gguf_meta or {})
    meta["tokenizer.ggml.pre"] = "qwen2"
    tok = load_gguf_tokenizer(meta)
    words = [w for w, _ in tok.tok.pre_tokenizer.pre_tokenize_str("I'LL pay 1234 (x)ok!\n\n  hi")]
    assert words == ["I", "'LL", "Ġpay", "Ġ", "1", "2", "3", "4", "Ġ(", "x", ")ok", "!ĊĊ", "Ġ", "Ġhi"]
    import regex  # the same pattern through another engine: the tokenizers regex is read as written

    assert regex.findall(_SPLIT_PRE["qwen2"], "I'LL pay 1234 (x)ok!\n\n  hi") == [
        "I",
        "'LL",
        " pay",
        " ",
        "1",
        "2",
        "3",
        "4",
        " (",
        "x",
        ")ok",
        "!\n\n",
        " ",
        " hi",
    ]
