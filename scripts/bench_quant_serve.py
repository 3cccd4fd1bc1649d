#!/usr/bin/env python3
"""Quantized weights on one GPU: correctness first, then decode speed through ``swiftlm serve`` for 16-bit weights,
``--quantize fp8`` and an int4 (GPTQ, group 128) checkpoint, as ratios to 16-bit and fractions of the memory bound.

1. Kernels (8B-shaped matrices): ``QuantLinear(x)`` against ``x @ dequantised(W).T`` in fp32 at 1, 16 and 128 rows
   for FP8 per-row (``--quantize fp8``), FP8 128x128 blocks and int4; each also timed against the bf16 matmul the
   model would run (a diagnostic: acceptance is end to end).
2. Model: a small random checkpoint with ``--quantize fp8`` against the same weights FP8-rounded and served in
   bf16 (the dequantised reference): last-position logits of a 10-token (Triton GEMV rows) and a 40-token prompt
   (``_scaled_mm`` rows), relative error; then greedy agreement of the 8B servers (fp8 and int4 vs bf16) over a few
   prompts, reported (random weights have near-flat logits: a low agreement there says little).
3. Speed: per format one server (``--parallel`` the largest stream count), ``swiftlm bench serve`` at each stream
   count (short prompts, ``--ignore-eos``); decode tok/s per stream = 1000 / ITL p50 (steady ITL with several
   streams), aggregate = streams x that.  Memory bound at one stream = bandwidth / the weight bytes a step reads
   (the projections in their format plus the 16-bit LM head).

    python scripts/bench_quant_serve.py --model /tmp/m8b --int4 /tmp/m8b-gptq --json docs/results/quant_formats_h100.json
"""

from __future__ import annotations

import argparse
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


def kernel_checks() -> list[dict]:
    from swiftlm.backends.torch.linear_rows import rows_linear
    from swiftlm.backends.torch.quant_linear import QuantLinear, pack_rows, quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (N, K) in SHAPES.items():
        w = torch.randn(N, K, device="cuda", generator=g).bfloat16() * 0.02
        fp8 = quantize_fp8(w).with_dtype(torch.bfloat16)
        sblk = torch.rand(N // 128, K // 128, device="cuda", generator=g) * 1e-3
        blk = QuantLinear("fp8", fp8.weight, sblk, block=(128, 128), dtype=torch.bfloat16)
        codes = torch.randint(0, 16, (N, K), device="cuda", generator=g)
        s4 = (torch.rand(N, K // 128, device="cuda", generator=g) * 0.01).half()
        z4 = torch.full((N, K // 128), 8.0, device="cuda").half()
        int4 = QuantLinear("int4", pack_rows(codes), s4, z4, group=128, dtype=torch.bfloat16)
        for M in (1, 16, 128):
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            t16 = _time(lambda: rows_linear(x, w))
            for kind, q in (("fp8-row", fp8), ("fp8-block", blk), ("int4-g128", int4)):
                ref = x.float() @ q.dequantized(torch.float32).T
                err = _rel(q(x), ref)
                us = _time(lambda: q(x))
                bound = 0.2 if kind == "fp8-row" and M > 16 else 1e-2  # _scaled_mm rounds x to e4m3 as well
                rows.append({
                    "matrix": name, "N": N, "K": K, "M": M, "format": kind, "rel_err": err, "bound": err <= bound,
                    "us": round(us, 2), "bf16_us": round(t16, 2), "speedup": round(t16 / us, 2),
                    "frac_bw": round(q.nbytes / (us * 1e-6) / BW, 3),
                })  # fmt: skip
    return rows


def model_check(root: Path) -> dict:
    """Small model: --quantize fp8 (QuantLinear on CUDA) against the FP8-rounded weights in bf16."""
    import subprocess

    from safetensors.torch import load_file, save_file

    from swiftlm import LLM

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
    for tag, path, q in (("fp8", src, "fp8"), ("ref", ref, None)):
        llm = LLM(str(path), backend="torch", device="cuda", quantize=q)
        m = llm.engine.model
        for n in (10, 40):
            prompt = [1 + (7 * i) % 4000 for i in range(n)]
            m.free([-1])
            logits[(tag, n)] = m.logits(-1, prompt, 0).float().cpu()
            m.free([-1])
        out[f"{tag}_weight_bytes"] = m.info.weight_bytes
        llm.close()
        del llm, m
        torch.cuda.empty_cache()
    for n in (10, 40):
        a, b = logits[("fp8", n)], logits[("ref", n)]
        out[f"rel_err_{n}"] = _rel(a, b)
        out[f"argmax_equal_{n}"] = bool(a.argmax() == b.argmax())
    # bounds: bf16 outputs and activations (~1e-2); 40 rows also round activations to e4m3 (_scaled_mm): 1e-1
    out["ok"] = out["rel_err_10"] <= 2e-2 and out["rel_err_40"] <= 1e-1
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
                r = bench(ns, srv, {}, work / f"{fmt}_{n}.json", streams=n)[0]
                itl = r["steady_itl_ms_p50"] if n > 1 and r.get("steady_itl_ms_p50") else r["itl_ms_p50"]
                rows[str(n)] = {"itl_ms_p50": itl, "tok_s": round(n * 1000.0 / itl, 1), "ok": r["requests_ok"]}
                print(f"  {fmt} x{n}: ITL {itl:.2f} ms, {rows[str(n)]['tok_s']} tok/s", flush=True)
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
    ap.add_argument("--skip", default="", help="comma list of parts to skip: kernels,model,serve")
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
        doc["kernels"] = kernel_checks()
        bad = [r for r in doc["kernels"] if not r["bound"]]
        ok &= not bad
        print(f"{'matrix':8} {'M':>4} {'format':10} {'rel_err':>9} {'us':>8} {'bf16 us':>8} {'x':>5} {'of BW':>6}")
        for r in doc["kernels"]:
            print(f"{r['matrix']:8} {r['M']:>4} {r['format']:10} {r['rel_err']:9.2e} {r['us']:8.1f} {r['bf16_us']:8.1f} "
                  f"{r['speedup']:5.2f} {r['frac_bw']:6.2f}{'' if r['bound'] else '  OUT OF BOUND'}")  # fmt: skip
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
                r["ratio_bf16"] = round(r["tok_s"] / base[n]["tok_s"], 3) if base else None
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
