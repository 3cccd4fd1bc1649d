"""CLI on the bundled model, `swiftlm info`, and the `swiftlm convert` round trip."""

from __future__ import annotations

import json

import pytest
from conftest import HAS_MLX, needs_mlx, run_cli


@needs_mlx
def test_generate_paris_on_bundled_default():
    r = run_cli(
        "generate", "--backend", "mlx", "-p", "What is the capital of France?", "--max-tokens", "16", "--temp", "0"
    )
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_info_json_lists_backends_and_model_plan():
    r = run_cli("info", "--json", "--model", "smollm2-135m-instruct")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["backends"]["mlx"]["available"] is HAS_MLX
    assert info["model"]["architecture"] == "llama" and info["model"]["context_length"] == 8192
    plan = info["memory_plan"]
    # K+V, 30 layers, 3 KV heads, head_dim 64, in the chosen backend's KV dtype (fp32 on a CPU)
    assert plan["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * plan["kv_element_size"]
    assert plan["total_bytes"] == plan["weights_bytes"] + plan["kv_cache_bytes"] + plan["prompt_cache_bytes"]


def test_serve_info_flag_prints_plan_and_exits():
    r = run_cli("--info")
    assert r.returncode == 0 and json.loads(r.stdout)["model"]["model"] == "smollm2-135m-instruct"


def _greedy_mlx_lm(path, ids, n):
    import mlx.core as mx
    from mlx_lm import load
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    model, _ = load(str(path))
    out = []
    for (t, _), _i in zip(generate_step(mx.array(ids), model, sampler=make_sampler(0.0)), range(n)):
        out.append(int(t))
    return out


@needs_mlx
@pytest.mark.parametrize(
    "extra", [["--keep-quantized", "--dtype", "float32"], ["--dtype", "float32"]], ids=["mlx-4bit", "dequantized-fp32"]
)
def test_convert_round_trip_with_mlx_lm_load(tmp_path, mlx_llm, extra):
    from swiftlm.sampling import SamplingParams

    out = tmp_path / "conv"
    r = run_cli("convert", "smollm2-135m-instruct", str(out), *extra)
    assert r.returncode == 0, r.stderr
    ids = mlx_llm.engine.chat_prompt([{"role": "user", "content": "Name a famous painter."}])
    ours = mlx_llm.generate(ids, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).token_ids
    # Both directions hold the very same weight values (the 4-bit codes, or their fp32
    # dequantization), so greedy tokens must be identical.
    assert _greedy_mlx_lm(out, ids, 12) == ours
    # the converted tokenizer and chat template travel along
    from swiftlm.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(out)
    assert tok.encode("Hello 123 world") == mlx_llm.tokenizer.encode("Hello 123 world")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == mlx_llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}]
    )


@pytest.mark.slow
def test_converted_directory_loads_in_transformers(tmp_path, hf_reference):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "conv"
    assert run_cli("convert", "smollm2-135m-instruct", str(out), "--dtype", "float32").returncode == 0
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.no_grad():
        a = model(ids).logits[0, -1]
        b = hf_reference(ids).logits[0, -1]
    # the same fp32 weights bit for bit (gguf-py's dequantization on both sides; ours un-permuted
    # by us, theirs by transformers' GGUF loader) in the same transformers code: identical logits
    sa, sb = model.state_dict(), hf_reference.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert torch.equal(a, b)


def test_convert_refuses_non_empty_output(tmp_path):
    (tmp_path / "x").write_text("keep me")
    r = run_cli("convert", "smollm2-135m-instruct", str(tmp_path))
    assert r.returncode == 2 and "--force" in r.stderr


@pytest.mark.skipif(not __import__("conftest").HAS_TORCH, reason="torch not installed on this machine")
def test_chat_repl_multi_turn(tiny_llama):
    import subprocess
    import sys

    from conftest import ROOT

    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "swiftlm.cli",
            "chat",
            "--model",
            str(tiny_llama),
            "--backend",
            "torch",
            "--max-tokens",
            "5",
            "--temp",
            "0",
        ],
        input="hello\n/reset\nagain\n\n",
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr
    assert "swiftlm chat" in r.stdout and r.stdout.count("> ") >= 3
