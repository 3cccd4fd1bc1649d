#!/usr/bin/env python3
"""Decode speed and KV memory of compressed KV caches against the uncompressed cache, same run.

    python scripts/bench_turboquant.py --backend torch [--contexts 4096,16384]   # CPU: SmolLM2's shape
    python scripts/bench_turboquant.py --backend torch --prefill 16384 --presets fp16,k4v3
    python scripts/bench_turboquant.py --backend mlx
    python scripts/bench_turboquant.py --backend torch --shape 8b --contexts 32768   # on a GPU

A random-weight model of the chosen shape is built in memory (``tiny``: 4 layers, hidden 512,
8 heads / 2 KV heads, head_dim 64; ``smollm2``: SmolLM2-135M's shape; ``8b``: Llama-3-8B's shape).
For each context length the cache is filled with random keys/values (decode cost does not depend on
their values) through the cache's own write/compress path, then ``--steps`` tokens are decoded
through the model and timed.  Baselines: the plain cache in the model's dtype (fp32 on CPU, bf16 on
CUDA), run eagerly like the compressed caches, and on CUDA also the CUDA-graph decode that plain
caches get in the server.  On CUDA, TurboQuant and ``kv_bits`` formats also run as static caches
decoding through one CUDA graph per cache ("cuda-graph": ``GraphDecoder.run_turbo``).  Every ratio is against a baseline measured in the same process.
``--prefill N``: instead, the time to prefill an N-token prompt (2,048-token chunks, compression
included) per format, against the plain cache in the same process.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SHAPES = {
    "tiny": dict(
        hidden_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=64,
        intermediate_size=1024,
        vocab_size=4096,
    ),
    "smollm2": dict(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        intermediate_size=1536,
        vocab_size=49152,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=14336,
        vocab_size=128256,
    ),
}


def config(shape: str, ctx: int) -> dict:
    c = dict(
        SHAPES[shape],
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=ctx,
        tie_word_embeddings=False,
    )
    return c


def random_model(cfg: dict, dev, dtype):
    """Our torch Transformer of ``cfg`` with N(0, 0.02) weights (seed 0), fused projections."""
    import torch

    from swiftlm.backends.torch.model import MLP, Transformer
    from swiftlm.backends.torch.model_config import Args

    torch.manual_seed(0)
    with torch.device(dev):
        model = Transformer(Args.from_config(cfg))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
    model.to(dtype).eval()
    model.init_rope()
    model.cos, model.sin = model.cos.to(dtype), model.sin.to(dtype)
    with torch.no_grad():
        for layer in model.layers:
            layer.self_attn.fuse()
            if isinstance(layer.mlp, MLP):
                layer.mlp.fuse()
    return model


def fmt_of(name: str):
    from swiftlm.turboquant.presets import KVFormat, affine, parse_turbo

    if name == "fp16":
        return KVFormat()
    if name.startswith("kv_bits="):
        return affine(int(name.split("=")[1]), 64)
    return parse_turbo(name.removesuffix("@paged"))


def code_pool(ma, fmt, positions: int, seqs: int, dev):
    """A ``@paged`` preset's code pages (backends/torch/code_pages.py): room for ``seqs`` sequences of
    ``positions``, handed out in a shuffled order (a server's pool after some churn: no sequence's pages in one
    run)."""
    import random

    from swiftlm.backends.torch.code_pages import PAGE_ROWS, CodePages

    pool = CodePages(ma, fmt, seqs * -(-positions // PAGE_ROWS) + 1, dev)
    random.Random(0).shuffle(pool.free)
    return pool


# ---------------------------------------------------------------------------------------- torch
def _setup(a, contexts):
    """(device, dtype, random model for the longest context, Triton kernels usable, device sync)."""
    import torch

    from swiftlm import cuda_ext

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model = random_model(config(a.shape, max(contexts) + a.warmup + a.steps + 8), dev, dtype)
    use_triton = dev.type == "cuda" and cuda_ext.enabled("cuda")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    return dev, dtype, model, use_triton, sync


def torch_bench(a, presets, contexts):
    import torch

    from swiftlm.backends.torch.affine_decode import static_ok as affine_static_ok
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.backends.torch.graphs import GraphDecoder
    from swiftlm.backends.torch.kv_cache import SeqCache

    dev, dtype, model, use_triton, sync = _setup(a, contexts)
    ma = model.a
    rows = []
    runners: list = []
    for L in contexts:
        base: dict = {}
        for name in presets:
            fmt = fmt_of(name)
            paged = name.endswith("@paged")  # codes in pages of a shared pool: the graphed variant only
            variants = [] if paged else [("eager", False)]
            if dev.type == "cuda" and (
                not fmt.compressed
                or (fmt.kind == "turbo" and use_triton)
                or (fmt.kind == "affine" and use_triton and affine_static_ok(ma, fmt))
            ):
                variants.append(("cuda-graph", True))  # kv_bits: the affine kernel's graph step
            for mode, graphed in variants:
                with torch.inference_mode():
                    cap = L + a.warmup + a.steps + 1
                    if fmt.compressed:
                        dense = dtype if dtype != torch.float32 else torch.float16
                        pool = code_pool(ma, fmt, cap, 1, dev) if paged else None
                        cache = CompressedCache(
                            ma, fmt, dtype, dev, dense_dtype=dense, capacity=cap if graphed else None, pages=pool
                        )
                        cache.use_triton = use_triton
                        if fmt.kind == "turbo":
                            cache.kc.use_triton = cache.vc.use_triton = use_triton
                    else:
                        cache = SeqCache(ma, dtype, dev, capacity=cap)
                    g = torch.Generator(device=dev).manual_seed(L)
                    for s in range(0, L, 2048):
                        T = min(2048, L - s)
                        for i in range(ma.layers):
                            k = torch.randn(ma.kv_heads, T, ma.head_dim, generator=g, device=dev, dtype=dtype)
                            v = torch.randn(ma.kv_heads, T, ma.head_dim, generator=g, device=dev, dtype=dtype)
                            if fmt.compressed:
                                cache.append(i, s, k, v)
                            else:
                                cache.update(i, s, k, v)
                    cache.length = L
                    nbytes = cache.nbytes() if fmt.compressed and not graphed else _held_bytes(cache, fmt, ma, L, dtype)
                    gd = GraphDecoder(model, dev) if graphed else None
                    tok = torch.tensor([1], device=dev)

                    def step(pos, cache=cache, gd=gd, fmt=fmt):
                        if gd is None:
                            return model(tok, cache, pos)
                        if fmt.compressed:
                            return gd.run_turbo(cache, 1, pos)
                        return gd.run(cache, 1, pos)

                    for w in range(a.warmup):  # warm-up (graph capture, Triton compile, clocks)
                        step(L + w)
                    runners.append((name, mode, step, nbytes))
        # rounds: every format once per round, each round decoding the same positions again (the
        # caches roll back by position), median per format: a shared machine's speed drifts between runs
        times: dict[tuple[str, str], list[float]] = {}
        with torch.inference_mode():
            for _ in range(a.rounds):
                for name, mode, step, _nb in runners:
                    sync()
                    t0 = time.perf_counter()
                    for i in range(a.steps):
                        step(L + i)
                    sync()
                    times.setdefault((name, mode), []).append((time.perf_counter() - t0) / a.steps)
        if a.profile and dev.type == "cuda":
            _profile_runners(runners, L, a.steps)
        for name, mode, _step, nbytes in runners:
            dt = statistics.median(times[(name, mode)])
            r = {
                "backend": "torch",
                "device": str(dev),
                "context": L,
                "format": name,
                "mode": mode,
                "tok_s": 1 / dt,
                "ms_per_token": dt * 1000,
                "kv_bytes": nbytes,
                "round_ms": [t * 1000 for t in times[(name, mode)]],
            }
            base.setdefault(mode, r)
            r["speed_vs_plain"] = r["tok_s"] / base[mode]["tok_s"]
            r["speed_vs_plain_eager"] = r["tok_s"] / base["eager"]["tok_s"]
            r["kv_vs_plain"] = nbytes / base["eager"]["kv_bytes"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        runners.clear()
        _print_split_registers()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def _profile_runners(runners: list, L: int, steps: int) -> None:
    """torch.profiler over ``steps`` decode steps of each graphed runner: its kernels by GPU time per
    step (what a step spends where, e.g. the compressed cache's attention against the 16-bit one's)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for name, mode, step, _nb in runners:
        if mode != "cuda-graph":
            continue
        torch.cuda.synchronize()
        with torch.inference_mode(), profile(activities=[ProfilerActivity.CUDA]) as prof:
            for i in range(steps):
                step(L + i)
            torch.cuda.synchronize()
        rows = [(e.device_time_total, e.count, e.key) for e in prof.key_averages() if e.device_time_total > 0]
        rows.sort(reverse=True)
        total = sum(r[0] for r in rows)
        print(f"# profile {name} {mode} at {L}: {total / steps / 1e3:.3f} ms of kernels per step", flush=True)
        for t, n, key in rows[:14]:
            print(f"#   {t / steps:9.1f} us/step  {n / steps:6.1f} calls/step  {key[:90]}", flush=True)


def batch_bench(a, presets, contexts):
    """``--batch B``: B sequences, each holding the context, decode one token each per step.  16-bit: a
    slot pool of B sequences through the server's batched CUDA graph (``GraphDecoder.run_batch``);
    compressed formats on CUDA: B static caches through one graph (``GraphDecoder.run_compressed_batch``:
    the weights read once for all rows, each row's attention over its own cache by the format's kernels),
    as the server runs several compressed sequences; elsewhere ``decode_batch``.  Rounds and medians as ``torch_bench``; the baseline is the 16-bit row of the same run."""
    import torch

    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.backends.torch.decode_rows import decode_batch
    from swiftlm.backends.torch.graphs import GraphDecoder, SlotPool

    dev, dtype, model, use_triton, sync = _setup(a, contexts)
    ma, B = model.a, a.batch
    rows = []
    for L in contexts:
        runners = []
        for name in presets:
            fmt = fmt_of(name)
            cap = L + a.warmup + a.steps + 1
            with torch.inference_mode():
                g = torch.Generator(device=dev).manual_seed(L)
                if fmt.compressed:
                    dense = dtype if dtype != torch.float32 else torch.float16
                    caches = []
                    gd = GraphDecoder(model, dev) if use_triton else None
                    pool = code_pool(ma, fmt, cap, B, dev) if name.endswith("@paged") and gd else None
                    for _ in range(B):
                        c = CompressedCache(
                            ma, fmt, dtype, dev, dense_dtype=dense, capacity=cap if gd else None, pages=pool
                        )
                        c.use_triton = use_triton
                        if fmt.kind == "turbo":
                            c.kc.use_triton = c.vc.use_triton = use_triton
                        for s in range(0, L, 2048):
                            T = min(2048, L - s)
                            for i in range(ma.layers):
                                k = torch.randn(ma.kv_heads, T, ma.head_dim, generator=g, device=dev, dtype=dtype)
                                v = torch.randn(ma.kv_heads, T, ma.head_dim, generator=g, device=dev, dtype=dtype)
                                c.append(i, s, k, v)
                        c.length = L
                        caches.append(c)
                    nbytes = sum(c.nbytes() for c in caches)

                    def step(pos, caches=caches, gd=gd):
                        if gd is not None:  # static caches: one graph for the B rows (as the server runs them)
                            return gd.run_compressed_batch(caches, [1] * B, [pos] * B)
                        return decode_batch(model, caches, [1] * B, [pos] * B)
                else:
                    pool = SlotPool(ma, B, cap, dtype, dev)
                    for t in pool.k + pool.v:
                        t.normal_(generator=g)
                    gd = GraphDecoder(model, dev)
                    slots = list(range(B))
                    nbytes = (
                        B * ma.layers * 2 * ma.kv_heads * L * ma.head_dim * torch.tensor([], dtype=dtype).element_size()
                    )

                    def step(pos, pool=pool, gd=gd, slots=slots):
                        return gd.run_batch(pool, slots, [1] * B, [pos] * B)

                for w in range(a.warmup):
                    step(L + w)
            runners.append((name, step, nbytes))
        times: dict[str, list[float]] = {}
        with torch.inference_mode():
            for _ in range(a.rounds):
                for name, step, _nb in runners:
                    sync()
                    t0 = time.perf_counter()
                    for i in range(a.steps):
                        step(L + i)
                    sync()
                    times.setdefault(name, []).append((time.perf_counter() - t0) / a.steps)
        base = None
        for name, _step, nbytes in runners:
            dt = statistics.median(times[name])
            r = {
                "backend": "torch",
                "device": str(dev),
                "context": L,
                "batch": B,
                "format": name,
                "mode": ("batched graph" if dev.type == "cuda" else "batched eager")
                if name == "fp16" or use_triton
                else "decode_batch",
                "tok_s": B / dt,
                "ms_per_step": dt * 1000,
                "kv_bytes": nbytes,
                "round_ms": [t * 1000 for t in times[name]],
            }
            base = base or r
            r["speed_vs_plain"] = r["tok_s"] / base["tok_s"]
            r["kv_vs_plain"] = nbytes / base["kv_bytes"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        runners.clear()
        _print_split_registers()
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def prefill_bench(a, presets):
    """Seconds to prefill ``a.prefill`` tokens (chunks of 2,048) into a fresh cache, per format;
    rounds interleave the formats, median per format."""
    import torch

    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.backends.torch.kv_cache import SeqCache

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    n = a.prefill
    model = random_model(config(a.shape, n + 8), dev, dtype)
    ids = torch.randint(0, SHAPES[a.shape]["vocab_size"], (n,), device=dev)
    times: dict[str, list[float]] = {}
    with torch.inference_mode():
        for _ in range(a.rounds):
            for name in presets:
                fmt = fmt_of(name)
                t0 = time.perf_counter()
                if fmt.compressed:
                    dense = dtype if dtype != torch.float32 else torch.float16
                    cache = CompressedCache(model.a, fmt, dtype, dev, dense_dtype=dense)
                else:
                    cache = SeqCache(model.a, dtype, dev, capacity=n + 8)
                for s in range(0, n, 2048):
                    model(ids[s : s + 2048], cache, s)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                times.setdefault(name, []).append(time.perf_counter() - t0)
                del cache
    rows = []
    for name in presets:
        sec = statistics.median(times[name])
        r = {
            "backend": "torch",
            "device": str(dev),
            "prefill_tokens": n,
            "format": name,
            "seconds": sec,
            "tok_s": n / sec,
            "rounds_s": times[name],
        }
        r["speed_vs_plain"] = r["tok_s"] / (n / statistics.median(times[presets[0]]))
        rows.append(r)
        print(json.dumps(r), flush=True)
    return rows


def _held_bytes(cache, fmt, ma, L, dtype) -> int:
    """KV bytes for L positions by the layout: a static cache allocates the whole capacity up front
    (like the 16-bit slot pool), so its figure is what the rows held need."""
    import torch

    from swiftlm.turboquant.presets import turbo_layout_bytes

    if not fmt.compressed:
        return 2 * ma.layers * ma.kv_heads * ma.head_dim * L * torch.finfo(dtype).bits // 8
    n_code, n_dense = cache.counts()
    if fmt.kind == "affine":  # codes + fp16 scale and bias per group, keys and values, per position
        per_pos = sum(
            t[:, :1].numel() * t.element_size()
            for L_ in cache.layers
            for t in (*L_.kp, L_.kn, L_.ks, *L_.vp, L_.vn, L_.vb)
        )
        return n_code * per_pos + n_dense * 2 * ma.layers * ma.kv_heads * ma.head_dim * cache.dense_dtype.itemsize
    f = turbo_layout_bytes(
        fmt,
        n_code=n_code,
        n_dense=n_dense,
        layers=ma.layers,
        kv_heads=ma.kv_heads,
        head_dim=ma.head_dim,
        dense_bytes=torch.finfo(cache.dense_dtype).bits // 8,
    )
    return f["codes_used"] + f["dense_used"] + f["uncompressed_layers"]


# ---------------------------------------------------------------------------------------- mlx
def mlx_bench(a, presets, contexts):
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import KVCache, QuantizedKVCache

    from swiftlm.backends.mlx.model import _arrays
    from swiftlm.backends.mlx.turbo_cache import install_attention_hook, make_turbo_cache

    cfg = config(a.shape, max(contexts) + a.steps + 8)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    mx.eval(model.parameters())
    install_attention_hook(model)
    c = SHAPES[a.shape]
    layers, kvh, d = c["num_hidden_layers"], c["num_key_value_heads"], c["head_dim"]
    dtype = mx.float32
    rows = []
    runners: list = []
    for L in contexts:
        for name in presets:
            fmt = fmt_of(name)
            if fmt.kind == "turbo":
                cache = make_turbo_cache(model, fmt, d)
            elif fmt.kind == "affine":
                cache = [QuantizedKVCache(group_size=fmt.group_size, bits=fmt.key_bits) for _ in range(layers)]
            else:
                cache = [KVCache() for _ in range(layers)]
            key = mx.random.key(L)
            for s in range(0, L, 2048):
                T = min(2048, L - s)
                for cc in cache:
                    key, k1, k2 = mx.random.split(key, 3)
                    k = mx.random.normal((1, kvh, T, d), key=k1).astype(dtype)
                    v = mx.random.normal((1, kvh, T, d), key=k2).astype(dtype)
                    cc.update_and_fetch(k, v)
                    if fmt.kind == "turbo":
                        cc._compress()
                mx.eval([x for cc in cache for x in _arrays(cc)])
            nbytes = sum(x.nbytes for cc in cache for x in _arrays(cc))
            if fmt.kind == "fp16":  # mlx-lm's KVCache grows in steps of 256: count the rows held
                nbytes = 2 * layers * kvh * d * L * 4
            tok = mx.array([[1]], dtype=mx.int32)
            for _ in range(2):
                mx.eval(model(tok, cache=cache))
            runners.append((name, cache, nbytes))
        times: dict[str, list[float]] = {}
        for _ in range(a.rounds):
            for name, cache, _nb in runners:
                for cc in cache:
                    cc.trim(cc.offset - L)  # decode the same positions every round
                t0 = time.perf_counter()
                for _ in range(a.steps):
                    mx.eval(model(tok, cache=cache))
                times.setdefault(name, []).append((time.perf_counter() - t0) / a.steps)
        base = None
        for name, _cache, nbytes in runners:
            dt = statistics.median(times[name])
            r = {
                "backend": "mlx",
                "device": str(mx.default_device()),
                "context": L,
                "format": name,
                "mode": "eager",
                "tok_s": 1 / dt,
                "ms_per_token": dt * 1000,
                "kv_bytes": nbytes,
                "round_ms": [t * 1000 for t in times[name]],
            }
            if base is None:
                base = r
            r["speed_vs_plain"] = r["tok_s"] / base["tok_s"]
            r["kv_vs_plain"] = nbytes / base["kv_bytes"]
            rows.append(r)
            print(json.dumps(r), flush=True)
        runners.clear()
    return rows


def memory_table(a, presets):
    """KV bytes at ``--memory-context`` positions (torch caches, 16-bit rows in fp16, filled through
    the cache's own write/compress path): measured storage vs the layout formula vs a 16-bit cache."""
    import torch

    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import turbo_layout_bytes

    rows = []
    for shape in ("smollm2", "8b"):
        c = SHAPES[shape]
        ma = argparse.Namespace(
            layers=c["num_hidden_layers"],
            kv_heads=c["num_key_value_heads"],
            heads=c["num_attention_heads"],
            head_dim=c["head_dim"],
        )
        L = a.memory_context
        fp16 = 2 * ma.layers * ma.kv_heads * ma.head_dim * 2 * L
        for name in presets:
            fmt = fmt_of(name)
            if fmt.kind != "turbo":
                continue
            cache = CompressedCache(ma, fmt, torch.float32, torch.device("cpu"), dense_dtype=torch.float16)
            for s in range(0, L, 512):
                kv = torch.randn(ma.kv_heads, 512, ma.head_dim)
                for i in range(ma.layers):
                    cache.append(i, s, kv, kv)
            n_code, n_dense = cache.counts()
            f = turbo_layout_bytes(
                fmt, n_code=n_code, n_dense=n_dense, layers=ma.layers, kv_heads=ma.kv_heads, head_dim=ma.head_dim
            )
            formula = f["codes_allocated"] + f["dense_allocated"] + f["uncompressed_layers"]
            r = {
                "shape": shape,
                "context": L,
                "format": name,
                "measured_bytes": cache.nbytes(),
                "formula_bytes": formula,
                "fp16_bytes": fp16,
                "ratio": cache.nbytes() / fp16,
                "compressed_rows": n_code,
                "window_rows": n_dense,
                "bits_per_dim": fmt.bits_per_dim(ma.head_dim),
            }
            rows.append(r)
            print(json.dumps(r), flush=True)
    return rows


def _print_split_registers() -> None:
    """The TurboQuant split kernels' registers / spills per variant launched so far (CUDA only)."""
    try:
        from swiftlm.cuda_ext import turboquant_kernels as tk
    except Exception:  # no Triton
        return
    for key, (regs, spills) in sorted(tk._REGS.items(), key=str):
        if regs is not None:
            print(
                f"# split kernel (key bits, value bits, TRANS, N_PTR, BATCH)={key}: {regs} registers, {spills} spills",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", choices=("torch", "mlx"), default="torch")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2")
    ap.add_argument("--contexts", default="4096,16384")
    ap.add_argument("--presets", default="fp16,k4v3,k3qjl-v3,k3v2,kv_bits=8,kv_bits=4")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of each graphed format's step")
    ap.add_argument(
        "--batch",
        type=int,
        default=1,
        help="B sequences of the context each, decoding together (torch on CUDA: the 16-bit cache as "
        "a slot pool through the batched graph, compressed caches through decode_batch)",
    )
    ap.add_argument("--memory", action="store_true", help="only the KV-bytes table (8K positions, no model)")
    ap.add_argument("--memory-context", type=int, default=8192)
    ap.add_argument("--prefill", type=int, default=0, help="time prefilling this many tokens instead of decode")
    a = ap.parse_args()
    if a.memory:
        rows = memory_table(a, a.presets.split(","))
        out = Path(a.json or "bench_results/bench_turboquant_memory.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"rows": rows}, indent=2))
        return
    contexts = [int(x) for x in a.contexts.split(",")]
    presets = a.presets.split(",")
    if a.prefill:
        rows = prefill_bench(a, presets)
        out = Path(a.json or f"bench_results/bench_turboquant_prefill_{a.shape}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"backend": "torch", "shape": a.shape, "rows": rows}, indent=2))
        return
    if a.batch > 1:
        rows = batch_bench(a, presets, contexts)
    else:
        rows = (torch_bench if a.backend == "torch" else mlx_bench)(a, presets, contexts)
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"decode with compressed KV caches, {a.backend}, shape {a.shape}, {platform.machine()}, "
        f"{_threads(a.backend)} (random weights; ratios against the plain cache in the same run)"
    )
    for col in ("context", "format", "mode", "tok/s", "vs plain (same mode)", "KV bytes", "KV vs plain"):
        t.add_column(col)
    for r in rows:
        t.add_row(
            str(r["context"]),
            r["format"],
            r["mode"],
            f"{r['tok_s']:.1f}",
            f"{r['speed_vs_plain']:.2f}x",
            f"{r['kv_bytes'] / 2**20:.1f} MiB",
            f"{r['kv_vs_plain']:.3f}x",
        )
    Console().print(t)
    out = Path(a.json or f"bench_results/bench_turboquant_{a.backend}_{a.shape}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "backend": a.backend,
                "shape": a.shape,
                "steps": a.steps,
                "rounds": a.rounds,
                "threads": _threads(a.backend),
                "rows": rows,
            },
            indent=2,
        )
    )


def _threads(backend: str) -> str:
    if backend != "torch":
        return "mlx"
    import torch

    return f"{torch.get_num_threads()} torch threads"


if __name__ == "__main__":
    main()
