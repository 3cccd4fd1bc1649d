"""The FP8 KV cache (``--kv-cache-dtype fp8``, backends/torch/kv_fp8.py) on CPU.

Reference: the same tiny model with a 16-bit (here float32) cache whose K and V rows are rounded through e4m3
before they are stored (``x / scale -> e4m3 -> * scale``, written out below, not through kv_fp8): a
monkeypatched ``SeqCache.update`` (and the numba batch attention off, which reads fp32 caches directly).
The fp8 cache stores the e4m3 bytes and dequantises on read, so its attention sees the same float32 values:
first logits and greedy tokens are equal exactly.  The paged pool (the CUDA layout, run on CPU as in
test_paged_kv.py), the Triton paged decode kernel (TRITON_INTERPRET=1) and checkpoint scales are checked
against the same arithmetic."""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import needs_torch
from torch_layout import relayout

from swiftlm import SamplingParams

CTX = 512
PROMPTS = [
    "a b c a b c a b",
    "the cat sat on the mat the cat " * 3,
    "one two three",
    "Once upon a time in a land far away there lived " * 2,
]
GREEDY = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)


def e4m3_round(x, scale):
    """x -> e4m3(clamp(x / scale, +-448)) -> float32 * scale, in x's dtype (the reference rounding)."""
    import torch

    return ((x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale).to(x.dtype)


def rounded_reference(m, monkeypatch, scales):
    """Switch ``m`` (an fp8 model) to a float32 cache whose rows are rounded through e4m3 on write."""
    from swiftlm.backends.torch import cpu_batch_attention
    from swiftlm.backends.torch.kv_cache import SeqCache

    orig = SeqCache.update

    def update(self, layer, start, k, v):
        sk, sv = scales.k[layer].view(-1, 1, 1), scales.v[layer].view(-1, 1, 1)
        return orig(self, layer, start, e4m3_round(k, sk), e4m3_round(v, sv))

    monkeypatch.setattr(SeqCache, "update", update)
    monkeypatch.setattr(cpu_batch_attention, "usable", lambda *a: False)
    monkeypatch.setattr(m.seqs, "fp8", None)  # the caches part makes the sequences' caches


def first_logits(m, text: str):
    """The logits after prefilling ``text`` in a fresh sequence (freed afterwards)."""
    ids = m.tokenizer.encode(text)
    try:
        return m.logits(10_000, ids, 0).clone()
    finally:
        m.free([10_000])


@pytest.fixture(scope="module")
def fp8_llm(tiny_llama):
    from swiftlm import LLM

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, prompt_cache_bytes=0, kv_cache_dtype="fp8") as llm:
        yield llm


@needs_torch
def test_seqcache_fp8_equals_e4m3_rounded_reference(fp8_llm, monkeypatch):
    import torch

    m = fp8_llm.engine.model
    assert m.kv_fp8 is not None and m.info.kv_dtype.startswith("fp8")
    assert m.info.kv_bytes_per_token == 2 * 2 * 2 * 32  # layers * KVH * head_dim bytes, K and V: 1 byte each
    scales = m.kv_fp8
    got_logits = first_logits(m, PROMPTS[1])
    got = [o.token_ids for o in fp8_llm.generate(PROMPTS[:2], GREEDY)]
    c = SeqCacheProbe.cache(m, PROMPTS[0])
    assert c._k[0].dtype == torch.float8_e4m3fn and c.fp8 is not None
    ids = m.tokenizer.encode(PROMPTS[0])
    m.logits(10_002, ids, 0)
    try:  # /health's kv_cache figures: 1 byte per element, half of 16-bit
        assert m.kv_stats() == {"bytes": len(ids) * 256, "fp16_bytes": len(ids) * 512}
    finally:
        m.free([10_002])
    with monkeypatch.context() as mp:  # plain float32 KV: it must differ, or the test proves nothing
        mp.setattr(m.seqs, "fp8", None)
        plain_logits = first_logits(m, PROMPTS[1])
    assert not torch.equal(plain_logits, got_logits)
    rounded_reference(m, monkeypatch, scales)
    want_logits = first_logits(m, PROMPTS[1])
    want = [o.token_ids for o in fp8_llm.generate(PROMPTS[:2], GREEDY)]
    assert torch.equal(got_logits, want_logits)
    assert got == want and all(len(t) == 32 for t in got)


class SeqCacheProbe:
    @staticmethod
    def cache(m, text):
        ids = m.tokenizer.encode(text)
        try:
            m.logits(10_001, ids, 0)
            return m.caches[10_001]
        finally:
            m.free([10_001])


@pytest.fixture(scope="module")
def fp8_solo(fp8_llm):
    """Each prompt alone through the fp8 SeqCache path (the eager CPU path)."""
    return [fp8_llm.generate(q, GREEDY).token_ids for q in PROMPTS]


def make_paged_fp8(llm, parallel: int, num_blocks: int | None = None, block_size: int = 16) -> None:
    """test_paged_kv.make_paged with an fp8 pool (the model's scales)."""
    import torch

    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.kv_pool import SlotPool

    eng, m = llm.engine, llm.engine.model
    cpu = torch.device("cpu")
    pool = SlotPool(
        m.module.a, parallel, CTX, torch.float32, cpu, block_size=block_size, num_blocks=num_blocks, fp8=m.kv_fp8
    )
    relayout(m, static=True, context=CTX, pool=pool, graphs=GraphDecoder(m.module, cpu, use_graph=False, fused=False))
    eng.kv.attach_pool(True)  # with a pool, the prompt cache is its blocks


@pytest.fixture(scope="module")
def paged4(tiny_llama):
    """Four slots over an fp8 pool of 12 blocks of 16 positions: too small for four of PROMPTS at once."""
    from swiftlm import LLM

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, parallel=4, kv_cache_dtype="fp8") as llm:
        make_paged_fp8(llm, 4, num_blocks=12)
        yield llm


@needs_torch
def test_paged_fp8_batched_and_preempted_equal_solo(paged4, fp8_solo):
    """Four streams at once in a pool too small for them (preemption): every output equals its solo run
    over the fp8 SeqCache."""
    import torch

    llm = paged4
    assert llm.engine.model.pool.k[0].dtype == torch.float8_e4m3fn
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == fp8_solo
    assert llm.engine.scheduler.preemptions > 0
    llm.engine.kv_blocks.check()
    assert llm.engine.kv_blocks.used() == 0


@needs_torch
def test_paged_fp8_prefix_cached_equals_uncached(paged4, fp8_llm):
    """A shared system prompt: the later request starts from the cached e4m3 blocks (shared as they are)
    and gives the tokens of the uncached fp8 run."""
    system = {"role": "system", "content": "You are a terse assistant who answers in one line. " * 6}
    chats = [[system, {"role": "user", "content": q}] for q in ("One?", "Two, please.")]
    p = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    want = [fp8_llm.generate(c, p).token_ids for c in chats]  # the SeqCache path, no prompt cache
    got = [paged4.generate(c, p) for c in chats]
    assert [o.token_ids for o in got] == want
    assert got[1].usage["cached_tokens"] > 0


@needs_torch
def test_paged_fp8_ngram_speculative_equals_plain(tiny_llama, fp8_solo):
    """n-gram speculation over the fp8 pool (verification reads the gathered, dequantised blocks)."""
    from swiftlm import LLM

    with LLM(str(tiny_llama), backend="torch", ctx_size=CTX, kv_cache_dtype="fp8", speculative="ngram") as llm:
        make_paged_fp8(llm, 1)
        outs = llm.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == fp8_solo
        assert llm.engine.speculator.stats.steps > 0  # (the repetitive prompts give drafts to verify)


@needs_torch
def test_pool_sizing_doubles_blocks():
    import torch

    from swiftlm.backends.torch.devices import kv_pool_size
    from swiftlm.backends.torch.kv_fp8 import FP8, KVScales
    from swiftlm.backends.torch.kv_pool import SlotPool
    from swiftlm.config import Settings

    class A:
        layers, kv_heads, head_dim = 4, 2, 64

    cfg = Settings(kv_cache_memory="8MB", kv_block_size=16)
    bs, n16 = kv_pool_size(cfg, A, torch.device("cpu"), torch.bfloat16, 4, 256)
    bs8, n8 = kv_pool_size(cfg, A, torch.device("cpu"), FP8, 4, 256)
    assert bs == bs8 == 16 and n8 == 2 * n16
    p16 = SlotPool(A, 2, 64, torch.bfloat16, torch.device("cpu"), block_size=16)
    p8 = SlotPool(A, 2, 64, torch.float32, torch.device("cpu"), block_size=16, fp8=KVScales.ones(4, 2))
    assert p8.block_bytes * 2 == p16.block_bytes and p8.nbytes() * 2 == p16.nbytes()


def kernel_errors() -> dict[str, float]:
    """Run in a subprocess under TRITON_INTERPRET=1 (chosen when Triton compiles, so before the import):
    the Triton kernel over an e4m3 pool with per-head scales vs the plain float32 attention over the
    dequantised rows; relative max error per (q dtype, splits)."""
    import torch

    from swiftlm.cuda_ext.paged_attention import paged_decode_attention

    g = torch.Generator().manual_seed(0)
    B, KVH, rep, D, BS, MB = 3, 2, 2, 32, 16, 4
    NB = B * MB + 2
    kc = (torch.randn(NB, KVH, BS, D, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    vc = (torch.randn(NB, KVH, BS, D, generator=g) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
    bt = torch.randperm(NB, generator=g)[: B * MB].view(B, MB).int()
    lens = torch.tensor([1, 37, MB * BS], dtype=torch.int32)
    ks, vs = torch.tensor([0.01, 0.03]), torch.tensor([0.02, 0.005])
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(B, KVH * rep, D, generator=g).to(dtype)
        want = torch.empty(B, KVH * rep, D)
        for b in range(B):  # the plain attention over the dequantised rows, float32
            L = int(lens[b])
            blocks = bt[b, : -(-L // BS)].long()
            k = kc[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :L].float() * ks.view(KVH, 1, 1)
            v = vc[blocks].transpose(0, 1).reshape(KVH, -1, D)[:, :L].float() * vs.view(KVH, 1, 1)
            qb = q[b].float().view(KVH, rep, D)
            p = torch.softmax(qb @ k.transpose(1, 2) * D**-0.5, dim=-1)
            want[b] = (p @ v).reshape(-1, D)
        for splits in (1, 3):
            got = paged_decode_attention(q, kc, vc, bt, lens, D**-0.5, num_splits=splits, k_scale=ks, v_scale=vs)
            err = (got.float() - want).abs().max().item() / want.abs().max().item()
            out[f"{str(dtype)[6:]}/{splits}"] = err
    # the fused rope + KV row write into an e4m3 pool vs its torch reference: the same scaled, saturated values
    # rounded to e4m3.  Triton's interpreter downcasts float32 -> e4m3 in software with two faults that the GPU's
    # cvt.rn.satfinite does not have: exact ties round away from zero (torch: to even), and a value that rounds up
    # to a power of two keeps the exponent (127 -> 64, not 128).  Such entries are allowed; any other is counted.
    from swiftlm.cuda_ext.decode_kernels import rope_kv_write_rows, rope_kv_write_rows_ref

    H, S, C = 4, 5, 16
    qkv = torch.randn(B, (H + 2 * KVH) * D, generator=g) * 5
    cos, sin = torch.randn(64, D, generator=g), torch.randn(64, D, generator=g)
    pos, slots, rows = torch.tensor([3, 10, 63]), torch.tensor([0, 2, 4]), torch.tensor([1, 5, 15])
    pools = [torch.zeros(S, KVH, C, D, dtype=torch.float8_e4m3fn) for _ in range(4)]
    rope_kv_write_rows(qkv, cos, sin, pos, slots, pools[0], pools[1], H, KVH, D, rows, k_scale=ks, v_scale=vs)
    rope_kv_write_rows_ref(qkv, cos, sin, pos, slots, pools[2], pools[3], H, KVH, D, rows, k_scale=ks, v_scale=vs)
    for name, got, want in (("rope_k", pools[0], pools[2]), ("rope_v", pools[1], pools[3])):
        got, want = got.float(), want.float()
        step = 2.0 ** (torch.floor(torch.log2(torch.maximum(got.abs(), want.abs()).clamp_min(2**-6))) - 3)
        tie = (got - want).abs() <= step  # the neighbouring e4m3 value
        power = want.abs() == 2.0 ** torch.round(torch.log2(want.abs().clamp_min(2**-9)))
        carry = power & (got == want / 2)  # the interpreter's downcast drops the carry into the exponent
        out[name] = float((~(tie | carry)).sum())  # anything else: a real difference
        out[name + "_differ"] = float((got != want).float().sum() / (want != 0).float().sum())
    return out


@needs_torch
@pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
)
def test_triton_paged_decode_kernel_reads_e4m3():
    """The Triton kernel (TRITON_INTERPRET=1, CPU tensors) over an e4m3 pool equals the torch reference
    attention over the dequantised rows: float32 q up to the accumulation order (tiles, exp2, split merge:
    relative 1e-5); bfloat16 q: the kernel rounds the softmax weights and the output to bf16 (relative 2e-2,
    a few bf16 ulps).  The fused rope + e4m3 row write: the reference's values but for the interpreter's two
    downcast faults (``kernel_errors``); its exactness on a GPU is for a GPU run to check."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).parent
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{here}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    code = "import json, test_fp8_kv as t; print(json.dumps(t.kernel_errors()))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    errs = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(errs) == 8
    for key in ("float32/1", "float32/3", "bfloat16/1", "bfloat16/3"):
        assert errs[key] < (1e-5 if key.startswith("float32") else 2e-2), (key, errs[key])
    for key in ("rope_k", "rope_v"):  # the fused decode's row write (decode_kernels.rope_kv_write_rows)
        assert errs[key] == 0 and errs[key + "_differ"] < 0.1, (key, errs)


@needs_torch
def test_checkpoint_scales_are_loaded_and_used(tiny_llama, tmp_path, monkeypatch):
    """A checkpoint with llm-compressor's ``self_attn.k_scale`` / ``v_scale`` (layer 0 per tensor, layer 1
    per KV head) loads with those scales, and its greedy run equals the e4m3-rounded reference using them."""
    import torch
    from safetensors.torch import save_file

    from swiftlm import LLM

    ck = tmp_path / "scaled"
    shutil.copytree(tiny_llama, ck)
    tensors = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.02),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.005]),
        "model.layers.1.self_attn.k_scale": torch.tensor([0.01, 0.04]),
        "model.layers.1.self_attn.v_scale": torch.tensor([0.003, 0.008]),
    }
    save_file(tensors, str(ck / "kv_scales.safetensors"))
    index = json.loads((ck / "model.safetensors.index.json").read_text())
    index["weight_map"].update({n: "kv_scales.safetensors" for n in tensors})
    (ck / "model.safetensors.index.json").write_text(json.dumps(index))
    with LLM(str(ck), backend="torch", ctx_size=CTX, prompt_cache_bytes=0, kv_cache_dtype="fp8") as llm:
        m = llm.engine.model
        s = m.kv_fp8
        assert s.source == "checkpoint" and "checkpoint" in m.info.kv_dtype
        assert torch.equal(s.k, torch.tensor([[0.02, 0.02], [0.01, 0.04]]))
        assert torch.equal(s.v, torch.tensor([[0.005, 0.005], [0.003, 0.008]]))
        got = llm.generate(PROMPTS[0], GREEDY).token_ids
        got_logits = first_logits(m, PROMPTS[3])
        rounded_reference(m, monkeypatch, s)
        assert torch.equal(first_logits(m, PROMPTS[3]), got_logits)
        assert llm.generate(PROMPTS[0], GREEDY).token_ids == got


@pytest.mark.parametrize(
    "kw, flag",
    [
        ({"turbo_kv": "k4v3"}, "--turbo-kv"),
        ({"backend": "mlx"}, "torch backend only"),
        ({"tensor_parallel": 2}, "--tensor-parallel"),
    ],
)
def test_bad_combinations_are_refused(kw, flag):
    from swiftlm.config import Settings
    from swiftlm.errors import ConfigError

    s = Settings(kv_cache_dtype="fp8", **kw)
    with pytest.raises(ConfigError, match="--kv-cache-dtype fp8") as e:
        s.check_supported()
    assert flag in str(e.value)
    Settings(kv_cache_dtype="auto", **kw).check_supported()  # the other settings alone are fine


def test_flag_and_env(monkeypatch):
    from swiftlm.config import Settings

    assert Settings().kv_cache_dtype == "auto"
    monkeypatch.setenv("SWIFTLM_KV_CACHE_DTYPE", "FP8")
    assert Settings().kv_cache_dtype == "fp8"
    with pytest.raises(ValueError, match="auto or fp8"):
        Settings(kv_cache_dtype="int8")


def test_kv_formats_bench_runs_fp8_on_its_own_server(tmp_path, monkeypatch, capsys):
    """scripts/bench_kv_formats_serve.py's "fp8": a server started with --kv-cache-dtype fp8 (even with
    --one-server: it is not a request field), held to its own bar (TTFT <= 1.1x, decode >= 1.2x)."""
    import importlib.util

    from conftest import ROOT

    spec = importlib.util.spec_from_file_location(
        "bench_kv_formats_serve", ROOT / "scripts" / "bench_kv_formats_serve.py"
    )
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    started, sent = [], []

    class FakeServer:
        def __init__(self, args, flags, log):
            self.flags = flags
            started.append(flags)

        def stop(self):
            pass

    def fake_bench(args, srv, fields, out, streams=1, lengths=None):
        sent.append(fields)
        itl = 8.0 if srv.flags else 10.0  # fp8 decodes 1.25x faster; TTFT 1.05x
        ttft = 105.0 if srv.flags else 100.0
        return [
            {"prompt_tokens": n, "ttft_ms_p50": ttft, "itl_ms_p50": itl, "itl_ms_p99": itl, "requests_ok": 1}
            for n in lengths or args.prompt_tokens
        ]

    monkeypatch.setattr(m, "Server", FakeServer)
    monkeypatch.setattr(m, "bench", fake_bench)
    argv = ["x", "--formats", "16bit,fp8", "--prompt-tokens", "32000", "--one-server", "--check"]
    monkeypatch.setattr("sys.argv", [*argv, "--tag", "t", "--out", str(tmp_path)])
    assert m.main() == 0
    assert started == [[], ["--kv-cache-dtype", "fp8"]] and sent == [{}, {}]
    doc = json.loads((tmp_path / "kv_formats_serve_t.json").read_text())
    assert doc["config"]["acceptance_per_format"] == {"fp8": [1.1, 1.2]} and doc["accepted"] is True
    assert m.acceptance("fp8", None) == (1.1, 1.2)
    capsys.readouterr()


@needs_torch
def test_prompt_cache_copies_keep_the_e4m3_rows(fp8_llm):
    """The CPU prompt cache's snapshot of an fp8 SeqCache holds its e4m3 bytes (1 per element) and a restore
    gives the logits of recomputing the prefix (the same two chunks, uncached)."""
    import torch

    m = fp8_llm.engine.model
    ids = m.tokenizer.encode(PROMPTS[3])
    n = len(ids) - 1
    try:
        m.logits(20_000, ids[:n], 0)
        payload, nbytes, held = m.snapshot_prefix(20_000)
        assert held == n and nbytes == n * 256 and payload[0][0].dtype == torch.float8_e4m3fn
        want = m.logits(20_000, ids[n:], n).clone()
        m.restore_prefix(20_001, payload, n)
        assert m.caches[20_001]._k[0].dtype == torch.float8_e4m3fn
        assert torch.equal(m.logits(20_001, ids[n:], n), want)
    finally:
        m.free([20_000, 20_001])


@needs_torch
@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_pool_reads_equal_float32_dequantisation(dtype):
    """The paged pool's cheaper reads (a cast for scales 1.0; a cast and a multiply in the compute dtype for
    scales exact there) give exactly float32(e4m3) * scale rounded once, as the float32 path does."""
    import torch

    from swiftlm.backends.torch.kv_fp8 import KVScales, dequantize
    from swiftlm.backends.torch.kv_pool import SlotPool

    class A:
        layers, kv_heads, head_dim = 2, 2, 8

    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = (torch.randn(2, 16, 8, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    modes = []
    for sc in ([1.0, 1.0], [0.5, 0.125], [0.0123, 3.3]):
        s = KVScales(torch.tensor([sc, sc]), torch.tensor([sc, sc]))
        p = SlotPool(A, 1, 16, dt, torch.device("cpu"), block_size=16, fp8=s)
        k, v = p.dequantize(1, q, q)
        want = dequantize(q, s.k[1].view(-1, 1, 1), dt)
        assert torch.equal(k, want) and torch.equal(v, want) and k.dtype == dt
        modes.append(p._deq)
    assert modes == ["unit", "cast", "cast" if dtype == "float32" else "f32"]
