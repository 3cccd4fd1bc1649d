"""SSD expert streaming (--stream-experts): exactness against the in-memory model, counted I/O,
the safetensors layout scan, run-time experts per token, prefetch scoring, errors, and the
server's metrics.  Checkpoints: tiny random MoE models from scripts/make_checkpoint.py in the
three layouts (per-expert 16-bit, stacked 16-bit, stacked MLX 4-bit)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import HAS_MLX, HAS_TORCH, make_ckpt, needs_mlx, needs_torch, run_cli

from swiftlm.experts import ExpertReader, scan_experts
from swiftlm.experts.reader import proc_io
from swiftlm.registry import resolve

SMALL = ("--hidden", "64", "--layers", "3", "--heads", "4", "--kv-heads", "2", "--dtype", "bfloat16")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("moe")
    out = {
        # per-expert HF tensors, sharded so experts span files
        "qwen3_moe": make_ckpt(
            d / "q3",
            "--arch",
            "qwen3_moe",
            *SMALL,
            "--experts",
            "8",
            "--experts-per-token",
            "2",
            "--moe-intermediate",
            "32",
            "--shard-mb",
            "0.2",
        ),
        "mixtral_stacked": make_ckpt(
            d / "mx",
            "--arch",
            "mixtral",
            *SMALL,
            "--intermediate",
            "48",
            "--experts",
            "4",
            "--experts-per-token",
            "2",
            "--stacked-experts",
            "--shard-mb",
            "0.3",
        ),
        "dense": make_ckpt(d / "dense", "--arch", "llama", *SMALL),
    }
    if HAS_MLX:
        out["qwen3_moe_4bit"] = make_ckpt(
            d / "q3q",
            "--arch",
            "qwen3_moe",
            *SMALL,
            "--experts",
            "8",
            "--experts-per-token",
            "2",
            "--moe-intermediate",
            "64",
            "--quantize",
            "4",
            "--group-size",
            "32",
        )
    return out


def _cfg(**kw):
    base = dict(
        stream_experts=True,
        expert_read_mode="pread",
        expert_read_threads=8,
        expert_prefetch=False,
        expert_top_k=0,
        mem_limit=None,
        ctx_size=None,
        parallel=1,
        turbo_kv=None,
    )
    base.update(kw)
    return SimpleNamespace(**base)


# ---------------------------------------------------------------- layout and reader (no backend)
def _tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor as raw little-endian bytes per name (numpy cannot hold bf16)."""
    from swiftlm.experts.layout import read_header

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        base, header = read_header(f)
        raw = f.read_bytes()
        for k, m in header.items():
            if k != "__metadata__":
                out[k] = raw[base + m["data_offsets"][0] : base + m["data_offsets"][1]]
    return out


def test_layout_per_expert_and_stacked(ckpts):
    lay = scan_experts(resolve(str(ckpts["qwen3_moe"])).weight_files)
    assert lay.style == "per_expert" and lay.num_experts == 8 and lay.layers == [0, 1, 2] and not lay.quantized
    tensors = _tensors(ckpts["qwen3_moe"])
    assert lay.total_bytes == sum(len(v) for v in tensors.values())
    assert lay.expert_bytes_total == sum(len(v) for k, v in tensors.items() if ".experts." in k)
    # one expert = gate + up + down, bf16
    assert lay.bytes_per_expert() == 3 * 64 * 32 * 2
    assert lay.bytes_per_token(2) == 3 * 2 * lay.bytes_per_expert()
    assert len(lay.files) > 1 and len({s.file for s in lay.slabs[2][("down", "weight")]}) >= 1

    st = scan_experts(resolve(str(ckpts["mixtral_stacked"])).weight_files)
    assert st.style == "stacked" and st.num_experts == 4
    assert st.module_prefix[0] == "model.layers.0.block_sparse_moe"
    assert scan_experts(resolve(str(ckpts["dense"])).weight_files) is None


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_stacked", "qwen3_moe_4bit"])
@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_reader_returns_the_files_bytes(ckpts, name, mode):
    if name not in ckpts:
        pytest.skip("mlx / mlx-lm not installed on this machine (needed to write the 4-bit checkpoint)")
    path = ckpts[name]
    lay = scan_experts(resolve(str(path)).weight_files)
    tensors = _tensors(path)
    r = ExpertReader(lay, mode=mode, workers=4)
    try:
        rng = np.random.default_rng(0)
        for layer in lay.layers:
            experts = sorted(rng.choice(lay.num_experts, size=3, replace=False).tolist())
            before = r.stats.bytes_read
            got = r.read(layer, experts)
            want_bytes = 0
            for (proj, comp), arr in got.items():
                assert arr.shape[0] == 3
                for j, e in enumerate(experts):
                    slab = lay.slabs[layer][(proj, comp)][e]
                    want_bytes += slab.nbytes
                    if lay.style == "per_expert":
                        names = [
                            k
                            for k in tensors
                            if f"layers.{layer}." in k
                            and f"experts.{e}." in k
                            and k.endswith(f".{comp}")
                            and proj in k.replace("w1", "gate").replace("w3", "up").replace("w2", "down")
                        ]
                        assert len(names) == 1
                        want = tensors[names[0]]
                    else:
                        stacked = [
                            k
                            for k in tensors
                            if f"layers.{layer}." in k and "switch_mlp" in k and f"{proj}_proj.{comp}" in k
                        ][0]
                        want = tensors[stacked][e * slab.nbytes : (e + 1) * slab.nbytes]
                    assert arr[j].tobytes() == want, (proj, comp, e)
            assert r.stats.bytes_read - before == want_bytes
        assert r.stats.experts_read == 3 * len(lay.layers)
        assert sum(r.stats.latency_counts) == r.stats.reads
    finally:
        r.close()


@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_split_reads_and_widening_are_exact(ckpts, mode, monkeypatch):
    """Slabs split into many small reads, and bf16 widened to fp32 by the reader threads, give
    exactly the file's bytes / the exact fp32 values of the bf16 numbers."""
    import swiftlm.experts.reader as rd

    lay = scan_experts(resolve(str(ckpts["qwen3_moe"])).weight_files)
    whole = ExpertReader(lay, mode=mode, workers=4)
    split = ExpertReader(lay, mode=mode, workers=4)
    try:
        raw = {k: v.copy() for k, v in whole.read(1, [2, 3, 7]).items()}
        monkeypatch.setattr(rd, "MAX_READ", 1000)  # not a multiple of anything: pieces end mid-row
        wide = split.read(1, [2, 3, 7], float32=True)
        assert split.stats.reads > whole.stats.reads
        for key, bits in raw.items():
            assert bits.dtype == np.uint16 and wide[key].dtype == np.float32
            want = (bits.astype(np.uint32) << 16).view(np.float32)
            assert np.array_equal(wide[key].view(np.uint32), want.view(np.uint32))
    finally:
        whole.close()
        split.close()


def test_pread_bytes_match_proc_io(ckpts):
    """rchar in /proc/self/io counts every byte read() / preadv() returned: it must grow by
    exactly the bytes the reader says it read."""
    lay = scan_experts(resolve(str(ckpts["qwen3_moe"])).weight_files)
    r = ExpertReader(lay, mode="pread", workers=4)
    try:
        r.read(0, [0])  # warm the pool's threads
        if "rchar" not in proc_io():
            pytest.skip("/proc/self/io is not readable here")
        ia, ib = proc_io(), proc_io()
        own = ib["rchar"] - ia["rchar"]  # reading /proc/self/io counts too
        io0, b0 = proc_io(), r.stats.bytes_read
        for layer in lay.layers:
            r.read(layer, [1, 5, 6])
        io1 = proc_io()
        assert r.stats.bytes_read - b0 == 3 * 3 * lay.bytes_per_expert()
        assert io1["rchar"] - io0["rchar"] - own == r.stats.bytes_read - b0
        # adjacent slabs are coalesced: one expert's three projections are contiguous on disk
        assert r.stats.reads < r.stats.experts_read * 3
    finally:
        r.close()


def test_reader_rejects_unknown_mode(ckpts):
    lay = scan_experts(resolve(str(ckpts["qwen3_moe"])).weight_files)
    with pytest.raises(ValueError, match="pread"):
        ExpertReader(lay, mode="aio")


# ---------------------------------------------------------------- exactness: MLX
def _mlx_logits(model, tokens):
    import mlx.core as mx

    return np.array(model(mx.array([tokens])).astype(mx.float32))


@needs_mlx
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_stacked", "qwen3_moe_4bit"])
@pytest.mark.parametrize("mode", ["pread", "mmap"])
def test_mlx_streamed_logits_bit_identical(ckpts, name, mode):
    from swiftlm.backends.mlx.loader import load_hf

    spec = resolve(str(ckpts[name]))
    resident, *_ = load_hf(spec, None)
    streamed, _, _, reader = load_hf(spec, _cfg(expert_read_mode=mode, expert_prefetch=True))
    # 5 tokens: the unsorted gather path; 80 tokens x 2 experts >= 64: mlx-lm's sorted path
    for n in (5, 80):
        toks = list(range(3, 3 + n))
        a, b = _mlx_logits(resident, toks), _mlx_logits(streamed, toks)
        assert np.array_equal(a, b), f"{name} {mode} T={n}: max diff {np.abs(a - b).max()}"
    # only expert bytes were read (never at load: the weights were loaded lazily, experts dropped)
    assert (
        reader.stats.bytes_read
        <= 2 * len(reader.layout.layers) * reader.layout.num_experts * reader.layout.bytes_per_expert()
    )
    snap = reader.stats.snapshot()
    assert snap["prefetch_bytes"] > 0 and 0.0 <= snap["prefetch_hit_rate"] <= 1.0


@needs_mlx
def test_mlx_decode_reads_layers_x_k_experts(ckpts):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from swiftlm.backends.mlx.loader import load_hf

    model, _, _, reader = load_hf(resolve(str(ckpts["qwen3_moe"])), _cfg())
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5, 6, 7, 8]]), cache=cache))
    for tok in (9, 10, 11):
        before = reader.stats.bytes_read
        mx.eval(model(mx.array([[tok]]), cache=cache))
        lay = reader.layout
        assert reader.stats.bytes_read - before == len(lay.layers) * 2 * lay.bytes_per_expert()


@needs_mlx
def test_mlx_engine_greedy_tokens_identical(ckpts):
    from swiftlm import LLM, SamplingParams

    p = (
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        if "ignore_eos" in SamplingParams.__dataclass_fields__
        else SamplingParams(max_tokens=16, temperature=0.0)
    )
    prompts = ["Hello there", "Count: one two three"]
    with LLM(str(ckpts["qwen3_moe"]), backend="mlx") as ref:
        want = [o.token_ids for o in ref.generate(prompts, p)]
    with LLM(str(ckpts["qwen3_moe"]), backend="mlx", stream_experts=True, parallel=2) as llm:
        got = [o.token_ids for o in llm.generate(prompts, p)]
        stats = llm.engine.expert_stream_stats()
    assert got == want and all(want)
    assert stats["bytes_read"] > 0 and stats["mode"] == "pread"


@needs_mlx
def test_mlx_expert_top_k_lowers_reads_and_clamps(ckpts, caplog):
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from swiftlm.backends.mlx.model import load_model

    spec = resolve(str(ckpts["qwen3_moe"]))
    one = load_model(spec, _cfg(expert_top_k=1))
    two = load_model(spec, _cfg())
    assert one.info.experts_per_token == 1 and two.info.experts_per_token == 2
    outs = []
    for m in (one, two):
        cache = make_prompt_cache(m.module)
        mx.eval(m.module(mx.array([[5, 6, 7]]), cache=cache))
        before = m.expert_stream.stats.bytes_read
        outs.append(np.array(m.module(mx.array([[9]]), cache=cache)))
        lay = m.expert_stream.layout
        assert (
            m.expert_stream.stats.bytes_read - before
            == len(lay.layers) * m.info.experts_per_token * lay.bytes_per_expert()
        )
    assert not np.array_equal(outs[0], outs[1])
    with caplog.at_level("WARNING"):
        big = load_model(spec, _cfg(stream_experts=False, expert_top_k=9))
    assert big.info.experts_per_token == 2 and "above the model's 2" in caplog.text


# ---------------------------------------------------------------- exactness: torch
@needs_torch
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral_stacked"])
def test_torch_streamed_logits_bit_identical(ckpts, name):
    import torch

    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.runner import load_model

    spec = resolve(str(ckpts[name]))
    resident = load_model(spec, _cfg(stream_experts=False))
    streamed = load_model(spec, _cfg(expert_prefetch=True))
    assert streamed.info.weight_bytes < resident.info.weight_bytes
    for n in (5, 80):
        toks = torch.arange(3, 3 + n)
        with torch.no_grad():
            a = resident.module(toks, SeqCache(resident.module.a, resident.dtype, resident.device), 0, last_only=False)
            b = streamed.module(toks, SeqCache(streamed.module.a, streamed.dtype, streamed.device), 0, last_only=False)
        assert torch.equal(a, b), f"{name} T={n}: max diff {(a - b).abs().max()}"
    assert streamed.expert_stream.stats.bytes_read > 0


@needs_torch
def test_torch_engine_greedy_and_top_k(ckpts):
    from swiftlm import LLM, SamplingParams

    p = SamplingParams(max_tokens=12, temperature=0.0)
    with LLM(str(ckpts["qwen3_moe"]), backend="torch") as ref:
        want = ref.generate("The sea is", p).token_ids
    with LLM(str(ckpts["qwen3_moe"]), backend="torch", stream_experts=True) as llm:
        assert llm.generate("The sea is", p).token_ids == want
    with LLM(str(ckpts["qwen3_moe"]), backend="torch", stream_experts=True, expert_top_k=1) as llm:
        before = llm.engine.expert_stream_stats()["bytes_read"]
        llm.generate("The sea is", SamplingParams(max_tokens=1, temperature=0.0))
        assert llm.engine.info.experts_per_token == 1
        assert llm.engine.expert_stream_stats()["bytes_read"] > before


# ---------------------------------------------------------------- errors, CLI plan, server
@pytest.mark.parametrize("backend", [pytest.param("mlx", marks=needs_mlx), pytest.param("torch", marks=needs_torch)])
def test_stream_experts_on_dense_model_is_a_clear_error(ckpts, backend):
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="not a mixture-of-experts"):
        LLM(str(ckpts["dense"]), backend=backend, stream_experts=True)


@needs_torch
def test_torch_refuses_mlx_quantized_experts(ckpts):
    if "qwen3_moe_4bit" not in ckpts:
        pytest.skip("mlx / mlx-lm not installed on this machine (needed to write the 4-bit checkpoint)")
    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    with pytest.raises(UnsupportedArchitecture, match="MLX-quantized"):
        LLM(str(ckpts["qwen3_moe_4bit"]), backend="torch", stream_experts=True)


def test_info_plans_streaming(ckpts):
    r = run_cli("info", "--model", str(ckpts["qwen3_moe"]), "--stream-experts", "--expert-top-k", "1", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["memory_plan"]
    lay = scan_experts(resolve(str(ckpts["qwen3_moe"])).weight_files)
    assert plan["stream_resident_bytes"] + plan["stream_expert_bytes"] == lay.total_bytes
    assert plan["stream_experts_per_token"] == 1 and plan["stream_model_experts_per_token"] == 2
    assert plan["stream_expert_bytes_per_token"] == 3 * 1 * lay.bytes_per_expert()
    assert plan["weights_bytes"] == plan["stream_resident_bytes"] + plan["stream_read_buffer_bytes"]
    bad = run_cli("info", "--model", str(ckpts["dense"]), "--stream-experts")
    assert bad.returncode == 2 and "not a mixture-of-experts" in bad.stderr and "Traceback" not in bad.stderr


def test_settings_validation():
    from swiftlm.config import Settings, parse_bytes

    assert parse_bytes("8GB") == 8 * 10**9 and parse_bytes("512MiB") == 512 << 20 and parse_bytes("1000") == 1000
    for bad in ("lots", "-1GB", "0"):
        with pytest.raises(ValueError):
            parse_bytes(bad)
    with pytest.raises(ValueError, match="pread or mmap"):
        Settings(expert_read_mode="aio")
    with pytest.raises(ValueError):
        Settings(mem_limit="a lot")
    with pytest.raises(ValueError):
        Settings(expert_top_k=-1)


@pytest.mark.skipif(not (HAS_MLX or HAS_TORCH), reason="no backend installed")
def test_server_metrics_count_expert_reads(ckpts):
    from server_util import ServerProc

    backend = "torch" if HAS_TORCH else "mlx"
    srv = ServerProc("--model", str(ckpts["qwen3_moe"]), "--backend", backend, "--stream-experts")
    try:
        body = json.dumps({"model": "x", "prompt": "hi", "max_tokens": 3, "temperature": 0}).encode()
        req = urllib.request.Request(srv.base + "/v1/completions", body, {"Content-Type": "application/json"})
        assert json.load(urllib.request.urlopen(req, timeout=120))["usage"]["completion_tokens"] >= 1
        health = json.load(urllib.request.urlopen(srv.base + "/health", timeout=30))
        es = health["stats"]["expert_streaming"]
        assert es["bytes_read"] > 0 and es["experts_per_token"] == 2
        text = urllib.request.urlopen(srv.base + "/metrics", timeout=30).read().decode()
        line = [x for x in text.splitlines() if x.startswith("swiftlm_ssd_bytes_read_total ")][0]
        assert float(line.split()[1]) == es["bytes_read"]
        assert "swiftlm_ssd_read_latency_seconds_bucket" in text and "swiftlm_ssd_reads_total" in text
    finally:
        srv.stop()
