"""--gpu-layers N (partial offload, backends/torch/offload.py): layers [0, N) on the main device,
[N, L) on the CPU in --offload-dtype.  The equality tests pin --device cpu (the "GPU" is the CPU
too, on any machine), so the split is checked where it shows: with --offload-dtype float32 every
number is the plain run's (greedy tokens and embeddings equal exactly); with bfloat16 the offloaded
layers' parameters and KV rows really are bf16 and the first layers' are not.  On a CUDA machine
one more test checks the real placement (cuda / cpu) and that both boundaries run."""

from __future__ import annotations

import json

import pytest
from conftest import make_ckpt, needs_torch, run_cli

torch = pytest.importorskip("torch")

PROMPTS = ["hello world this is", "the quick brown fox jumps over", "a b c d e f g", "one two three"]


@pytest.fixture(scope="module")
def ckpt4(tmp_path_factory):
    """Four layers, so that a split has layers on both sides and more than one on each."""
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "llama4",
        "--arch",
        "llama",
        "--layers",
        "4",
        "--dtype",
        "float32",
        "--shard-mb",
        "4",
    )


def _run(path, **kw):
    from swiftlm import LLM, SamplingParams

    with LLM(str(path), backend="torch", parallel=4, device="cpu", **kw) as llm:
        p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        out = [o.token_ids for o in llm.generate(PROMPTS, p)]  # concurrent: batched decode rows
        solo = llm.generate(PROMPTS[1], p).token_ids  # alone: the single-sequence forward
        emb = llm.engine.model.hidden_states([[5, 6, 7, 8], [9, 10]])  # packed prompts (embeddings path)
        return out, solo, emb, llm.engine.model


@needs_torch
@pytest.mark.parametrize("n", [2, 0])
def test_greedy_tokens_equal_the_plain_run(ckpt4, n):
    ref, ref_solo, ref_emb, _ = _run(ckpt4)
    out, solo, emb, model = _run(ckpt4, gpu_layers=n)
    assert out == ref and solo == ref_solo
    for a, b in zip(emb, ref_emb):
        assert (a == b).all()
    assert model.module.a.offload == (n, torch.device("cpu"), torch.float32)
    assert model.graphs is None and model.pool is None and not model.overlap


@needs_torch
def test_layers_are_where_the_split_says(ckpt4):
    _, _, _, model = _run(ckpt4, gpu_layers=1, offload_dtype="bfloat16")
    m = model.module
    assert m.a.offload[0] == 1
    dtypes = [{p.dtype for p in layer.parameters()} | {layer.self_attn.qkv[0].dtype} for layer in m.layers]
    assert dtypes == [{torch.float32}, {torch.bfloat16}, {torch.bfloat16}, {torch.bfloat16}]
    assert m.embed_tokens.weight.dtype == m.norm.weight.dtype == torch.float32  # the main side
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.offload import split_report

    c = SeqCache(m.a, torch.float32, torch.device("cpu"))
    assert [t.dtype for t in c.k] == [t.dtype for t in c.v] == [torch.float32] + [torch.bfloat16] * 3
    rep = split_report(m)
    assert rep["gpu_layers"] == 1 and rep["cpu_layers"] == 3
    assert set(rep["bytes_by_place"]) == {"cpu/float32", "cpu/bfloat16"}
    # KV bytes per token count each layer in its own dtype
    per = 2 * m.a.kv_heads * m.a.head_dim
    assert model.info.kv_bytes_per_token == per * 4 + 3 * per * 2


@needs_torch
def test_bf16_offload_stays_close_to_the_plain_run(ckpt4):
    """Layers 1-3 in bf16 (8 mantissa bits): last-position logits agree with the fp32 run within 5%
    of their spread; the tolerance is bf16 rounding of weights and activations over three layers."""
    from swiftlm import LLM

    ids = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    outs = []
    for kw in ({}, {"gpu_layers": 1, "offload_dtype": "bfloat16"}):
        with LLM(str(ckpt4), backend="torch", device="cpu", **kw) as llm:
            m = llm.engine.model
            from swiftlm.backends.torch.kv_cache import SeqCache

            with torch.inference_mode():
                outs.append(m.module(ids, SeqCache(m.module.a, m.dtype, m.device), 0).float())
    ref, got = outs
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() < 0.05 * (ref.max() - ref.min())
    assert not torch.equal(got, ref)  # the bf16 layers did run


@needs_torch
def test_refused_combinations(ckpt4):
    from swiftlm import LLM
    from swiftlm.errors import ConfigError

    with pytest.raises(ConfigError, match="--gpu-layers does not combine with --turbo-kv"):
        LLM(str(ckpt4), backend="torch", gpu_layers=1, turbo_kv="k4v3")


def test_info_shows_the_split_and_the_memory_plan(ckpt4):
    r = run_cli("info", "--model", str(ckpt4), "--backend", "torch", "--gpu-layers", "1", "--json", timeout=120)
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["memory_plan"]
    assert plan["gpu_layers"] == 1 and plan["cpu_layers"] == 3 and plan["offload_dtype"] == "float32"
    cfg = json.loads((ckpt4 / "config.json").read_text())
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kvd = cfg["num_key_value_heads"] * cfg["head_dim"]
    layer = H * cfg["num_attention_heads"] * cfg["head_dim"] * 2 + 2 * H * kvd + 3 * H * I + 2 * H
    outside = V * H + H + (0 if cfg.get("tie_word_embeddings") else V * H)
    import torch

    main = 2 if torch.cuda.is_available() else 4  # the device's dtype: bf16 on a GPU, fp32 on a CPU-only machine
    assert plan["device_weights_bytes"] == (outside + layer) * main
    assert plan["cpu_weights_bytes"] == 3 * layer * 4  # offloaded layers: fp32
    assert plan["weights_bytes"] == plan["device_weights_bytes"] + plan["cpu_weights_bytes"]
    assert plan["device_kv_cache_bytes"] * 3 * 4 == plan["cpu_kv_cache_bytes"] * main
    r = run_cli("info", "--model", str(ckpt4), "--gpu-layers", "-1", timeout=120)
    assert r.returncode == 2 and "gpu" in r.stderr.lower() and "Traceback" not in r.stderr


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_split_places_layers_and_kv_and_runs(ckpt4):
    """On a GPU: layers [0, 2) and the embedding / norm / head on cuda (bf16), layers [2, 4) and their KV
    rows on the CPU (fp32); a batch and a lone sequence decode through both boundaries."""
    from swiftlm import LLM, SamplingParams

    with LLM(str(ckpt4), backend="torch", parallel=4, gpu_layers=2) as llm:
        model = llm.engine.model
        m = model.module
        places = [{(p.device.type, p.dtype) for p in layer.parameters()} for layer in m.layers]
        assert places == [{("cuda", torch.bfloat16)}] * 2 + [{("cpu", torch.float32)}] * 2
        assert m.embed_tokens.weight.is_cuda and m.norm.weight.is_cuda and model.graphs is None
        from swiftlm.backends.torch.kv_cache import SeqCache

        c = SeqCache(m.a, model.dtype, model.device)
        assert [t.device.type for t in c.k] == ["cuda", "cuda", "cpu", "cpu"]
        p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        outs = llm.generate(PROMPTS, p)
        assert all(len(o.token_ids) == 8 for o in outs)
        assert len(llm.generate(PROMPTS[0], p).token_ids) == 8  # alone: the single-sequence forward


def test_gpu_layers_on_mlx_is_refused_not_ignored(tiny_llama):
    pytest.importorskip("mlx.core", reason="mlx is not installed on this machine")
    from swiftlm import LLM
    from swiftlm.errors import ConfigError

    with pytest.raises(ConfigError, match="--gpu-layers is built for the torch backend only"):
        LLM(str(tiny_llama), backend="mlx", gpu_layers=1)
