#!/usr/bin/env python3
"""Quantized weights on one GPU: correctness first, then decode speed through ``swiftlm serve`` for 16-bit weights,
``--quantize fp8`` and an int4 (GPTQ, group 128) checkpoint, as ratios to 16-bit and fractions of the memory bound.

1. Kernels (8B-shaped matrices): ``QuantLinear(x)`` (the path quant_linear.PATHS picks) against
   ``x @ dequantised(W).T`` in fp32 at 1, 16, 64 and 128 rows for FP8 per-row (``--quantize fp8``), FP8 128x128
   blocks and int4; each also timed against the bf16 matmul the model would run (a diagnostic: acceptance is end
   to end).  The sweep times every other way too (the Triton kernel at each launch configuration of
   quant_gemv.TILE_CANDIDATES, dequantise + cuBLAS, _scaled_mm) and prints the fastest per (format, rows): the
   data for PATHS and quant_gemv._tiles.
2. Model: a small random checkpoint with ``--quantize fp8`` against the same weights FP8-rounded and served in
   bf16 (the dequantised reference): every position's logits of a 10-token (kernel rows), a 40- and a 128-token
   prompt (``_scaled_mm`` rows), relative error and finiteness; then greedy agreement of the 8B servers (fp8 and int4 vs bf16) over a few
   prompts, reported (random weights have near-flat logits: a low agreement there says little).
3. Speed: per format one server (``--parallel`` the largest stream count), ``swiftlm bench serve`` at each stream
   count (short prompts, ``--ignore-eos``); decode tok/s per stream = 1000 / ITL p50 (steady ITL with several
   streams), aggregate = streams x that.  A row is refused (no number, the reasons printed) when a request
   failed, a stream ended early or carried text for fewer tokens than it counted, or the streams did not decode
   together long enough for a steady window (``check_row``); with several streams the same load is also read
   directly (``stream_probe``: finish reasons, error events, tokens received).  Memory bound at one stream = bandwidth / the weight bytes a step reads
   (the projections in their format plus the 16-bit LM head).

    python scripts/bench_quant_serve.py --model /tmp/m8b --int4 /tmp/m8b-gptq --json docs/results/quant_formats_h100.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
from bench_kv_formats_serve import Server, bench  # noqa: E402

BW = 3.35e12  # H100 SXM HBM3, bytes/s (datasheet)
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / (b.float().norm() + 1e-12))


def _time(fn, reps: int = 50) -> float:
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        g.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1e6


def _candidates(q, M: int) -> list[tuple[str, object]]:
    """(name, call) of every way to run ``q`` on M rows: the Triton kernel at each launch configuration of
    quant_gemv.TILE_CANDIDATES for M, the dequantising pass + cuBLAS, and _scaled_mm for per-row FP8."""
    from swiftlm.cuda_ext import quant_gemv as QG

    out = []
    for t in QG.TILE_CANDIDATES.get(M, []):
        name = "kernel " + "x".join(str(v) for v in t)
        if q.kind == "int4":
            out.append((name, lambda x, t=t: QG.int4_linear(x, q.weight, q.scale, q.zeros, q.group, tiles=t)))
        else:
            out.append((name, lambda x, t=t: QG.fp8_linear(x, q.weight, q.scale, q.block, tiles=t)))
    out.append(("dequant", lambda x: q._cuda(x, "dequant")))
    if q.kind == "fp8" and q.block is None and M > 1:
        out.append(("scaled_mm", lambda x: q._cuda(x, "scaled_mm")))
    return out


def kernel_checks(rows_list=(1, 16, 64, 128), sweep: bool = True) -> tuple[list[dict], list[dict]]:
    """Per 8B matrix, format and row count: ``QuantLinear(x)`` (the path PATHS picks) against the fp32 reference
    and the bf16 matmul; with ``sweep``, every candidate (``_candidates``) timed too, each checked against the
    reference (a wrong candidate is never the fastest)."""
    from swiftlm.backends.torch.linear_rows import rows_linear
    from swiftlm.backends.torch.quant_linear import QuantLinear, pack_rows, path_for, quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    rows, cands = [], []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02
        fp8 = quantize_fp8(w).with_dtype(torch.bfloat16)
        sblk = torch.rand(N // 128, K // 128, device="cuda", generator=g) * 1e-3
        blk = QuantLinear("fp8", fp8.weight, sblk, block=(128, 128), dtype=torch.bfloat16)
        codes = torch.randint(0, 16, (N, K), device="cuda", generator=g)
        s4 = (torch.rand(N, K // 128, device="cuda", generator=g) * 0.01).half()
        z4 = torch.full((N, K // 128), 8.0, device="cuda").half()
        int4 = QuantLinear("int4", pack_rows(codes), s4, z4, group=128, dtype=torch.bfloat16)
        for M in rows_list:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            t16 = _time(lambda: rows_linear(x, w))
            for kind, q in (("fp8-row", fp8), ("fp8-block", blk), ("int4-g128", int4)):
                ref = x.float() @ q.dequantized(torch.float32).T
                err = _rel(q(x), ref)
                us = _time(lambda: q(x))
                path = path_for(q.fmt, M)
                bound = 0.2 if path == "scaled_mm" else 1e-2  # _scaled_mm rounds x to e4m3 as well
                rows.append({
                    "matrix": name, "N": N, "K": K, "M": M, "format": kind, "path": path, "rel_err": err,
                    "bound": err <= bound, "us": round(us, 2), "bf16_us": round(t16, 2),
                    "speedup": round(t16 / us, 2), "frac_bw": round(q.nbytes / (us * 1e-6) / BW, 3),
                })  # fmt: skip
                if not sweep:
                    continue
                for cname, fn in _candidates(q, M):
                    try:
                        cerr = _rel(fn(x), ref)
                        cus = _time(lambda fn=fn: fn(x)) if cerr <= 0.2 else None
                    except Exception as exc:  # a configuration that does not compile or fit: reported, skipped
                        cerr, cus = None, None
                        cname += f" ({type(exc).__name__})"
                    cands.append({
                        "matrix": name, "M": M, "format": kind, "candidate": cname, "rel_err": cerr,
                        "us": None if cus is None else round(cus, 2), "bf16_us": round(t16, 2),
                    })  # fmt: skip
        del w, fp8, blk, int4
        torch.cuda.empty_cache()
    return rows, cands


def best_table(cands: list[dict]) -> dict:
    """Per (format, rows): the fastest candidate summed over the four matrices (a decode step runs each once),
    with the kernel's best launch configuration per matrix and rows (the values for quant_gemv._tiles)."""
    by: dict = {}
    for c in cands:
        if c["us"] is None:
            continue
        kind = "kernel" if c["candidate"].startswith("kernel") else c["candidate"]
        key = (c["format"], c["M"])
        by.setdefault(key, {}).setdefault(kind, {}).setdefault(c["matrix"], []).append((c["us"], c["candidate"]))
    out = {}
    for (fmt, M), kinds in sorted(by.items()):
        totals = {}
        for kind, per in kinds.items():
            if len(per) == len(SHAPES):  # a path measured on every matrix
                totals[kind] = sum(min(v)[0] for v in per.values())
        bf16 = sum({c["matrix"]: c["bf16_us"] for c in cands if c["format"] == fmt and c["M"] == M}.values())
        best = min(totals, key=totals.get) if totals else None
        tiles = {m: min(v)[1] for m, v in kinds.get("kernel", {}).items()}
        out[f"{fmt}/{M}"] = {"best": best, "us_step": {k: round(v, 1) for k, v in totals.items()},
                             "bf16_us_step": round(bf16, 1), "kernel_tiles": tiles}  # fmt: skip
    return out


def model_check(root: Path) -> dict:
    """Small model: --quantize fp8 (QuantLinear on CUDA) against the FP8-rounded weights in bf16.  Every position's
    logits of a 10-, 40- and 128-token prompt through the model's forward on a cache of its own (``SeqCache``:
    the engine's paged pool only serves sequences the scheduler gave blocks), so the rows go through each
    (format, rows) path of ``PATHS`` (``kernel`` at 10, ``scaled_mm`` at 40 and 128)."""
    import subprocess

    from safetensors.torch import load_file, save_file

    from swiftlm import LLM
    from swiftlm.backends.torch.kv_cache import SeqCache
    from swiftlm.backends.torch.packed_attention import prefill_attention

    src, ref = root / "small", root / "small-rounded"
    if not (src / "config.json").exists():
        subprocess.run(
            [sys.executable, str(ROOT / "scripts/make_checkpoint.py"), str(src), "--hidden", "1024", "--layers", "4",
             "--heads", "8", "--kv-heads", "2", "--intermediate", "2816", "--dtype", "bfloat16", "--tokenizer-from",
             str(ROOT / ".gpu/tok")], check=True, capture_output=True,
        )  # fmt: skip
    if not (ref / "config.json").exists():
        import shutil

        shutil.copytree(src, ref)
        for f in ref.glob("*.safetensors"):
            st = load_file(str(f))
            for k, w in st.items():
                if k.endswith("_proj.weight") and ".layers." in k:
                    s = (w.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
                    w8 = (w.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
                    st[k] = (w8.float() * s[:, None]).to(w.dtype).contiguous()
            save_file(st, str(f))
    out = {}
    logits = {}
    lengths = (10, 40, 128)
    for tag, path, q in (("fp8", src, "fp8"), ("ref", ref, None)):
        llm = LLM(str(path), backend="torch", device="cuda", quantize=q)
        try:
            m = llm.engine.model
            with torch.inference_mode():
                for n in lengths:
                    ids = torch.tensor([1 + (7 * i) % 4000 for i in range(n)], device=m.device)
                    cache = SeqCache(m.module.a, m.dtype, m.device, capacity=256)
                    with prefill_attention(m.device, n):
                        logits[(tag, n)] = m.module(ids, cache, 0, last_only=False).float().cpu()
            out[f"{tag}_weight_bytes"] = m.info.weight_bytes
        finally:
            llm.close()
        del llm
        torch.cuda.empty_cache()
    for n in lengths:
        a, b = logits[("fp8", n)], logits[("ref", n)]
        out[f"rel_err_{n}"] = _rel(a, b)
        out[f"finite_{n}"] = bool(torch.isfinite(a).all())
        out[f"argmax_agree_{n}"] = round(float((a.argmax(-1) == b.argmax(-1)).float().mean()), 3)
    # bounds: bf16 outputs and activations (~1e-2); >16 rows also round activations to e4m3 (_scaled_mm): 1e-1
    out["ok"] = (
        out["rel_err_10"] <= 2e-2
        and all(out[f"rel_err_{n}"] <= 1e-1 for n in lengths[1:])
        and all(out[f"finite_{n}"] for n in lengths)
    )
    return out


def make_int4(src: Path, dst: Path, group: int = 128) -> None:
    """GPTQ (symmetric, ``group``) of ``src``'s projections, written by scripts/quantize_checkpoint.py's packing; a
    matrix repeated across layers (make_checkpoint --reuse-layers) is quantised once."""
    import shutil

    from quantize_checkpoint import is_linear, quant_config, quantize_layer
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    state = {}
    for f in sorted(src.glob("*.safetensors")):
        state.update(load_file(str(f)))
    cache: list[tuple[torch.Tensor, dict]] = []
    gen = torch.Generator().manual_seed(0)
    out = {}
    for name in sorted(state):
        t = state.pop(name)
        if not is_linear(name):
            out[name] = t
            continue
        hit = next((tensors for w, tensors in cache if w.shape == t.shape and torch.equal(w, t)), None)
        if hit is None:
            tensors, _ = quantize_layer(t.float(), "gptq", group, gen)
            hit = {k: v.contiguous() for k, v in tensors.items()}
            cache.append((t, hit))
        m = name[: -len(".weight")]
        out.update({f"{m}.{k}": v.clone() for k, v in hit.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = quant_config("gptq", group)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in src.iterdir():
        if f.name.startswith("tokenizer"):
            shutil.copy(f, dst / f.name)


def weight_step_bytes(cfg: dict, fmt: str) -> int:
    """Bytes one decode step reads: the projections in ``fmt`` (with scales) and the 16-bit LM head."""
    H, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    D = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * D
    mats = [(qkv, H), (H, cfg["num_attention_heads"] * D), (2 * inter, H), (H, inter)]
    per = {
        "bf16": lambda n, k: 2 * n * k,
        "fp8": lambda n, k: n * k + 4 * n,
        "int4": lambda n, k: n * k // 2 + 2 * 2 * n * (k // 128),
    }[fmt]
    return L * sum(per(n, k) for n, k in mats) + 2 * H * cfg["vocab_size"]


def check_row(doc: dict, n: int, max_tokens: int) -> tuple[dict, list[str]]:
    """What ``swiftlm bench serve``'s per-request records (its --json) say about an n-stream row, and the reasons
    to refuse it: a failed request, fewer tokens than asked (usage) or received as text chunks, and streams that
    did not decode together (the steady-ITL window, last first token to first last token, shorter than half of
    a stream's decode time: inside a window that short only back-to-back chunks count, which is how the first
    H100 run reported 0.04 ms for 128 streams)."""
    reqs = doc["lengths"][0]["requests"] if "lengths" in doc else doc["requests"]
    bad: list[str] = []
    failed = [r for r in reqs if not r["ok"]]
    if failed:
        bad.append(f"{len(failed)} of {len(reqs)} requests failed ({failed[0].get('error')})")
    ok = [r for r in reqs if r["ok"] and r["chunk_ms"]]
    short = [r for r in ok if r["output_tokens"] < max_tokens]
    if short:
        bad.append(f"{len(short)} streams ended early (min {min(r['output_tokens'] for r in short)} of {max_tokens})")
    thin = [r for r in ok if r["content_chunks"] < 0.9 * r["output_tokens"]]
    if thin:
        bad.append(f"{len(thin)} streams carried text for fewer than 90% of their tokens (empty-text tokens?)")
    info = {"requests": len(reqs), "tokens": sum(r["output_tokens"] for r in ok),
            "chunks": sum(r["content_chunks"] for r in ok)}  # fmt: skip
    if n > 1 and ok:
        first = [r["send_s"] * 1e3 + r["chunk_ms"][0] for r in ok]
        last = [r["send_s"] * 1e3 + r["chunk_ms"][-1] for r in ok]
        window = min(last) - max(first)
        decode = statistics.median(b - a for a, b in zip(first, last))
        info.update(window_ms=round(window, 1), decode_ms_p50=round(decode, 1),
                    start_spread_ms=round(max(first) - min(first), 1))  # fmt: skip
        # tokens received per second over the whole run, from the first first token to the last last token
        span = (max(last) - min(first)) / 1e3
        info["received_tok_s"] = round(sum(r["content_chunks"] - 1 for r in ok) / span, 1) if span > 0 else None
        if window < 0.5 * decode:
            bad.append(
                f"the streams overlapped {window:.0f} ms of a {decode:.0f} ms decode (first tokens spread over "
                f"{info['start_spread_ms']:.0f} ms): no steady window"
            )
    return info, bad


async def _probe(base: str, n: int, prompt_tokens: int, max_tokens: int) -> list[dict]:
    import httpx

    async def one(i: int, client) -> dict:
        body = {"prompt": [1 + (17 * i + 7 * j) % 4000 for j in range(prompt_tokens)], "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        rec = {"finish": None, "errors": [], "text_chunks": 0, "empty_chunks": 0, "usage_tokens": None, "t": []}
        t0 = time.perf_counter()
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                rec["errors"].append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return rec
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                obj = json.loads(line[5:])
                if obj.get("error") or obj.get("object") == "error":
                    rec["errors"].append(str(obj.get("error") or obj)[:200])
                for c in obj.get("choices") or []:
                    if c.get("text"):
                        rec["text_chunks"] += 1
                        rec["t"].append(time.perf_counter() - t0)
                    elif c.get("finish_reason") is None:
                        rec["empty_chunks"] += 1
                    if c.get("finish_reason") is not None:
                        rec["finish"] = c["finish_reason"]
                if obj.get("usage"):
                    rec["usage_tokens"] = obj["usage"].get("completion_tokens")
        return rec

    async with httpx.AsyncClient(base_url=base, timeout=300, limits=httpx.Limits(max_connections=n)) as client:
        return await asyncio.gather(*(one(i, client) for i in range(n)))


def stream_probe(srv, n: int, prompt_tokens: int, max_tokens: int) -> dict:
    """n streams at once, read directly: each stream's finish reason, error events, text and empty chunks and
    usage tokens (the fields ``bench serve`` folds into ok / not ok), summed."""
    recs = asyncio.run(_probe(srv.base, n, prompt_tokens, max_tokens))
    reasons: dict = {}
    for r in recs:
        reasons[str(r["finish"])] = reasons.get(str(r["finish"]), 0) + 1
    errors = [e for r in recs for e in r["errors"]]
    out = {
        "streams": n, "finish_reasons": reasons, "error_events": len(errors), "first_error": errors[0] if errors else None,
        "usage_tokens": sum(r["usage_tokens"] or 0 for r in recs), "text_chunks": sum(r["text_chunks"] for r in recs),
        "empty_chunks": sum(r["empty_chunks"] for r in recs),
    }  # fmt: skip
    ts = [r["t"] for r in recs if len(r["t"]) > 1]
    if ts:
        span = max(t[-1] for t in ts) - min(t[0] for t in ts)
        out["received_tok_s"] = round(sum(len(t) - 1 for t in ts) / span, 1) if span > 0 else None
    out["ok"] = not errors and reasons == {"length": n} and out["usage_tokens"] == n * max_tokens
    return out


def serve_runs(a: argparse.Namespace, formats: dict, cfg: dict, work: Path) -> dict:
    streams = [int(s) for s in a.streams.split(",")]
    res = {}
    for fmt, (model, flags) in formats.items():
        ns = SimpleNamespace(
            model=str(model), backend="torch", streams=max(streams), prompt_tokens=[a.prompt_tokens],
            serve_arg=flags, output_tokens=a.output_tokens, streams_output_tokens=a.stream_tokens, device="cuda",
            step_log=False, load_timeout=240, num_requests=a.requests, warmup=1, warmup_prompt_tokens=16,
            timeout=300, tokenizer=None,
        )  # fmt: skip
        t0 = time.time()
        srv = Server(ns, flags, work / f"{fmt}.log")
        load_s = time.time() - t0
        rows = {"load_s": round(load_s, 1)}
        try:
            for n in streams:
                out = work / f"{fmt}_{n}.json"
                r = bench(ns, srv, {}, out, streams=n)[0]
                info, bad = check_row(json.loads(out.read_text()), n, a.output_tokens if n == 1 else a.stream_tokens)
                if n > 1:  # the same load read directly: finish reasons and error events of every stream
                    info["probe"] = stream_probe(srv, n, a.prompt_tokens, a.stream_tokens)
                    if not info["probe"]["ok"]:
                        bad.append(
                            f"probe: {json.dumps({k: info['probe'][k] for k in ('finish_reasons', 'error_events', 'first_error', 'usage_tokens', 'text_chunks', 'empty_chunks')})}"
                        )
                itl = r["steady_itl_ms_p50"] if n > 1 and r.get("steady_itl_ms_p50") else r["itl_ms_p50"]
                row = {"itl_ms_p50": itl, "tok_s": round(n * 1000.0 / itl, 1), "ok": r["requests_ok"], **info}
                if bad:  # refused: kept in the JSON for the reasons, never as a number in the table
                    row.update(tok_s=None, refused=bad, itl_ms_p50_unchecked=itl, itl_ms_p50=None)
                rows[str(n)] = row
                shown = f"{row['tok_s']} tok/s" if not bad else "REFUSED: " + "; ".join(bad)
                print(f"  {fmt} x{n}: ITL {itl:.2f} ms, {shown} (received {info.get('received_tok_s')} tok/s)",
                      flush=True)  # fmt: skip
            try:  # reported, never fatal: the timings above are kept
                rows["greedy"] = greedy(srv, a.greedy_prompts)
            except Exception as exc:
                rows["greedy"], rows["greedy_error"] = [], f"{type(exc).__name__}: {exc}"
        finally:
            srv.stop()
        bytes_step = weight_step_bytes(cfg, fmt)
        rows["weight_bytes_per_step"] = bytes_step
        rows["bound_tok_s_bs1"] = round(BW / bytes_step, 1)
        res[fmt] = rows
    return res


def greedy(srv, n: int) -> list[list[int]]:
    import httpx

    outs = []
    for i in range(n):
        prompt = [1 + (13 * i + 7 * j) % 4000 for j in range(24)]
        body = {"prompt": prompt, "max_tokens": 32, "temperature": 0, "ignore_eos": True, "logprobs": 1}
        r = httpx.post(srv.base + "/v1/completions", json=body, timeout=120).json()
        lp = (r["choices"][0].get("logprobs") or {}).get("tokens") or []
        outs.append(list(lp) or [r["choices"][0]["text"]])
    return outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the 16-bit 8B-shaped checkpoint")
    ap.add_argument("--int4", help="int4 (GPTQ) checkpoint; written from --model when absent")
    ap.add_argument("--formats", default="bf16,fp8,int4")
    ap.add_argument("--streams", default="1,64,128")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--output-tokens", type=int, default=128, help="one stream")
    ap.add_argument("--stream-tokens", type=int, default=96, help="each of several streams")
    ap.add_argument("--requests", type=int, default=3, help="one-stream requests")
    ap.add_argument("--greedy-prompts", type=int, default=4)
    ap.add_argument("--work", default="/tmp/qbench")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,sweep,model,serve")
    ap.add_argument("--rows", default="1,16,64,128", help="row counts of the kernel part")
    ap.add_argument("--json", default=str(ROOT / "docs/results/quant_formats_h100.json"))
    a = ap.parse_args()
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    skip = set(filter(None, a.skip.split(",")))
    doc: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "datasheet_Bps": BW}

    def save() -> None:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(doc, indent=1))

    ok = True
    if "kernels" not in skip:
        from swiftlm.backends.torch.quant_linear import paths_table

        rows_list = tuple(int(m) for m in a.rows.split(","))
        doc["kernels"], doc["candidates"] = kernel_checks(rows_list, sweep="sweep" not in skip)
        bad = [r for r in doc["kernels"] if not r["bound"]]
        ok &= not bad
        print("PATHS (backends/torch/quant_linear.py):\n" + paths_table())
        print(
            f"{'matrix':8} {'M':>4} {'format':10} {'path':9} {'rel_err':>9} {'us':>8} {'bf16 us':>8} {'x':>5} {'of BW':>6}"
        )
        for r in doc["kernels"]:
            print(f"{r['matrix']:8} {r['M']:>4} {r['format']:10} {r['path']:9} {r['rel_err']:9.2e} {r['us']:8.1f} "
                  f"{r['bf16_us']:8.1f} {r['speedup']:5.2f} {r['frac_bw']:6.2f}{'' if r['bound'] else '  OUT OF BOUND'}")  # fmt: skip
        if doc["candidates"]:
            doc["best"] = best_table(doc["candidates"])
            print("\nfastest path per (format, rows), us per decode step's four matrices (bf16 in brackets):")
            for key, b in doc["best"].items():
                print(f"  {key:14} best {b['best']:9} {json.dumps(b['us_step'])} [{b['bf16_us_step']}]  "
                      f"kernel tiles {json.dumps(b['kernel_tiles'])}")  # fmt: skip
        save()
    if "model" not in skip:
        doc["model_check"] = model_check(work)
        ok &= doc["model_check"]["ok"]
        print("model check (--quantize fp8 vs FP8-rounded bf16):", json.dumps(doc["model_check"]))
        save()
    if "serve" not in skip:
        cfg = json.loads((Path(a.model) / "config.json").read_text())
        want = a.formats.split(",")
        formats = {"bf16": (a.model, []), "fp8": (a.model, ["--quantize", "fp8"])}
        if "int4" in want:
            i4 = Path(a.int4 or work / "int4")
            if not (i4 / "config.json").exists():
                t0 = time.time()
                make_int4(Path(a.model), i4)
                print(f"int4 checkpoint written in {time.time() - t0:.0f} s", flush=True)
            formats["int4"] = (i4, [])
        formats = {k: v for k, v in formats.items() if k in want}
        doc["serve"] = serve_runs(a, formats, cfg, work)
        base = doc["serve"].get("bf16")
        print(f"\n{'format':6} {'streams':>7} {'tok/s':>8} {'x bf16':>7} {'of bound':>9}")
        for fmt, rows in doc["serve"].items():
            for n in a.streams.split(","):
                r = rows[n]
                if r["tok_s"] is None:  # refused (check_row): no number
                    print(f"{fmt:6} {n:>7} {'refused':>8}  {'; '.join(r['refused'])}")
                    ok = False
                    continue
                b = base[n]["tok_s"] if base else None
                r["ratio_bf16"] = round(r["tok_s"] / b, 3) if b else None
                if n == "1":
                    r["frac_bound"] = round(r["tok_s"] / rows["bound_tok_s_bs1"], 3)
                print(f"{fmt:6} {n:>7} {r['tok_s']:8.1f} {r['ratio_bf16'] or 0:7.2f} {r.get('frac_bound', ''):>9}")
            if base and fmt != "bf16":
                same = [x == y for p, q in zip(rows["greedy"], base["greedy"]) for x, y in zip(p, q)]
                rows["greedy_agreement_vs_bf16"] = round(statistics.mean(same), 3) if same else None
                print(f"{fmt}: greedy token agreement with bf16 over {len(rows['greedy'])} prompts: "
                      f"{rows['greedy_agreement_vs_bf16']}")  # fmt: skip
        save()
    print("correctness:", "ok" if ok else "FAILED", "->", a.json)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
