#!/usr/bin/env python3
"""Write docs/benchmarks.md (the guide's benchmark page) from the result files in docs/results/.

    python scripts/gen_bench_page.py             # write the page from the stable result files
    python scripts/gen_bench_page.py --refresh   # first (re)make the stable files from the raw runs named in STABLE
    python scripts/gen_bench_page.py --plots     # also redraw the plots (needs matplotlib)
    python scripts/gen_bench_page.py --check     # exit 1 if the page differs from what the files give

Each measure on the page reads one result file with a stable name (docs/results/<hardware>_<measure>.json). Where
the current figures were written by a run under another name (a dated file, a directory of raw client outputs),
STABLE below says which runs make the stable file, and `--refresh` writes it (runs kept as they are, with their
sources listed in the file). A new measurement replaces the stable file; how a figure moved over time is told in
CHANGELOG.md, not on the page.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RES = ROOT / "docs" / "results"
PAGE = ROOT / "docs" / "benchmarks.md"

H100 = "one NVIDIA H100 80GB HBM3 (torch 2.11, CUDA 13)"
H100X2 = "two NVIDIA H100 80GB HBM3 joined by NVLink (torch 2.11, NCCL 2.28)"
H200 = "one NVIDIA H200 (141 GB HBM3e, torch 2.11)"
H200X2 = "two NVIDIA H200 of one host joined by NVLink (torch 2.11, NCCL_NVLS_ENABLE=0)"
CPU = "a shared 2-core x86_64 VM, no GPU (torch 2.13 CPU, MLX 0.32 CPU)"


# ---------------------------------------------------------------------------------------------------- stable files
def _load(rel: str):
    return json.loads((RES / rel).read_text())


def _serve_runs(rel: str, mode: str, streams: set[int]) -> list[dict]:
    keep = ("concurrency", "rep", "output_tok_per_s", "ttft_ms_p50", "itl_ms_p50", "itl_ms_p99")
    return [
        {k: r[k] for k in keep if k in r}
        for r in _load(rel)["runs"]
        if r["mode"] == mode and r["concurrency"] in streams
    ]


def _client_run(rel: str, **tags) -> dict:
    """One `swiftlm bench serve --json` output, reduced to its figures."""
    j = _load(rel)
    r = j["results"]
    return {
        **tags,
        "concurrency": j["config"]["concurrency"],
        "output_tok_per_s": r["output_throughput"],
        "ttft_ms_p50": r["ttft_ms"]["p50"],
        "itl_ms_p50": r["itl_ms"]["p50"],
        "requests_ok": r["requests_ok"],
        "requests_failed": r["requests_failed"],
        "source": rel,
    }


def _stable_serve(shape: str, parts: list[tuple[str, int]]) -> dict:
    runs, sources = [], []
    for rel, n in parts:
        runs += _serve_runs(rel, "fused", {n})
        sources.append(rel)
    return {
        "what": f"output tok/s through HTTP, random-weight {shape.upper()} Llama shape in bf16",
        "date": "2026-11-27",
        "device": H100,
        "server": "swiftlm serve --parallel 128 --ctx-size 1024 --prompt-cache-bytes 0 (paged KV pool, engine process)",
        "client": "swiftlm bench serve: ~40-token chat prompts, 128 new tokens, EOS banned, T=0.6, 2N requests",
        "sources": sources,
        "runs": runs,
    }


def _stable_tp() -> dict:
    d23, d17 = "issue26_h100x2_s23/lease1_tp/", "tp_peer_h100x2_s17/32b/"
    runs = [_client_run(d23 + f"bench_tp1_8b_n1{s}.json", shape="8B", tp=1) for s in ("", "_r2", "_r1_r2")]
    runs += [_client_run(d23 + f"bench_tp2late_8b_n1{s}.json", shape="8B", tp=2) for s in ("", "_r2", "_r1_r2")]
    for n in (1, 64):
        runs.append(_client_run(d17 + f"bench_tp1_32b_n{n}.json", shape="32B", tp=1))
        runs.append(_client_run(d17 + f"bench_tp2peer_32b_n{n}.json", shape="32B", tp=2))
    return {
        "what": "--tensor-parallel 2 against one GPU, output tok/s through HTTP (random-weight Llama shapes, bf16)",
        "date": "2026-11-27 (8B), 2026-11-26 (32B)",
        "device": H100X2,
        "server": "swiftlm serve --tensor-parallel {1,2} --engine-process off; 8B --parallel 128 --ctx-size 1024, "
        "32B --parallel 64 --ctx-size 256",
        "runs": runs,
    }


def _stable_dp() -> dict:
    d = "issue26_h100x2_s23/lease2_dp/"
    runs = [_client_run(d + f"bench_dp1_n{n}.json", replicas=1) for n in (64, 128, 256)]
    runs += [_client_run(d + "bench_dp1b_n64.json", replicas=1)]
    runs += [_client_run(d + f"bench_dp2_n{n}.json", replicas=2) for n in (128, 256)]
    runs += [_client_run(d + "bench_dp2b_n128.json", replicas=2)]
    return {
        "what": "--data-parallel 2 against one replica, output tok/s through HTTP (random-weight Llama-3-8B shape)",
        "date": "2026-11-27",
        "device": H100X2,
        "server": "swiftlm serve --data-parallel {1,2} --parallel 128 --ctx-size 2048 --prompt-cache-bytes 0",
        "client": "swiftlm bench serve --endpoint completions: random 256-token prompts, 128 new tokens, EOS banned, "
        "4 client processes",
        "runs": runs,
    }


def _stable_rows(parts: list[str], **meta) -> dict:
    rows = []
    for rel in parts:
        rows += _load(rel)["rows"]
    return {**meta, "sources": parts, "rows": rows}


def _stable_kv_step(parts: list[str]) -> dict:
    """profile_kv_step.py runs: per context, each format's inter-token latency and CUDA kernels per step."""
    runs = [_load(rel) for rel in parts]
    return {
        "what": "CUDA kernels of the engine's decode steps per KV format (one streamed request, 60 steps profiled)",
        "date": "2026-11-29",
        "device": H200,
        "command": "scripts/gpu_kv_step_profile.sh (scripts/profile_kv_step.py)",
        "sources": parts,
        "runs": runs,
    }


TQ_128K_SERVE = [  # (build, file): serve runs at 131,072 tokens, each with 16-bit in the same run
    ("combine after its wait, 8 warps (before)", "tq_s32/kv_formats_serve_ab_old.json"),
    ("16-bit rows before the wait, 8 warps", "tq_s32/kv_formats_serve_ab_new.json"),
    ("16-bit rows before the wait, 8 warps", "tq_s32/kv_formats_serve_ab_k3.json"),
    ("16-bit rows before the wait, 4 warps", "tq_s32/kv_formats_serve_ab_nw4.json"),
    ("16-bit rows before the wait, 4 warps", "kv_formats_serve_h200_131k_early.json"),
    ("+ even split ranges", "tq_s33/kv_formats_serve_131k_balanced.json"),
    ("+ even split ranges", "tq_s33/kv_formats_serve_131k_balanced_repeat.json"),
]
TQ_128K_STEP = [  # (variant, file): in-process step profiles at 131,000 tokens
    ("16-bit", "tq_s32/kv_step_early_131000.json"),
    ("k4v3, combine 8 warps", "tq_s32/kv_step_ab_base.json"),
    ("k4v3, combine 4 warps", "tq_s32/kv_step_ab_nw4.json"),
    ("k4v3, combine 4 warps, 16 coordinates each", "tq_s32/kv_step_ab_ds16.json"),
    ("k4v3, combine 8 warps, 64 coordinates each", "tq_s32/kv_step_ab_ds64.json"),
    ("k4v3, 131,100 tokens: ceil-sized split ranges", "tq_s33/kv_step_ab_ceil_131100.json"),
    ("k4v3, 131,100 tokens: even split ranges", "tq_s33/kv_step_ab_bal_131100.json"),
]


def _stable_tq_128k() -> dict:
    serve = []
    for build, rel in TQ_128K_SERVE:
        j = _load(rel)
        base = j["rows"]["16bit"][0]["itl_ms_p50"]
        for fmt, rs in j["rows"].items():
            if fmt != "16bit":
                serve.append({"build": build, "format": fmt, "itl_ms_p50": rs[0]["itl_ms_p50"], "itl_16bit_ms_p50": base,
                              "ttft_ms": rs[0]["ttft_ms_p50"], "source": rel})  # fmt: skip
    step = []
    for variant, rel in TQ_128K_STEP:
        j = _load(rel)
        fmt = "16bit" if variant == "16-bit" else "k4v3"
        r = j["formats"][fmt]
        step.append({"variant": variant, "itl_ms_p50": r["itl_ms_p50"], "layers": j.get("layers", 32),
                     "kernels": r["kernels"], "source": rel})  # fmt: skip
    return {
        "what": "TurboQuant decode at a 131K context on one H200 (8B shape): the combine pass's order and warps and "
        "the split pass's ranges, through swiftlm serve (16-bit in each run) and in process (each kernel's share of "
        "the step's critical path)",
        "date": "2026-11-29",
        "device": H200,
        "command": "scripts/gpu_tq_ab.sh, scripts/gpu_kv_step_ab.sh, scripts/gpu_kv_formats.sh serve",
        "serve": serve,
        "step": step,
    }


def _stable_mlx_tq() -> dict:
    a = _load("bench_turboquant_cpu_mlx_numba.json")["runs"]["smollm2_numba1_r2"]  # the undisturbed run
    b = _load("bench_turboquant_cpu_mlx_kvbits_numba.json")["runs"]["smollm2_numba1"]
    rows = a["rows"] + [r for r in b["rows"] if r["format"] != "fp16"]
    return {
        "what": "MLX on the CPU: decode tok/s with compressed KV caches against MLX's fp32 cache, SmolLM2-135M shape",
        "date": "2026-11-27",
        "device": CPU,
        "command": "scripts/bench_turboquant.py --backend mlx --shape smollm2 --contexts 4096,16384",
        "sources": ["bench_turboquant_cpu_mlx_numba.json", "bench_turboquant_cpu_mlx_kvbits_numba.json"],
        "rows": rows,
    }


# stable name -> a function making it, or the raw file it is a copy of
STABLE: dict[str, Callable[[], dict] | str] = {
    "h100_serve_1b.json": lambda: _stable_serve(
        "1b",
        [
            ("paged_kv_h100_s22/run11_1b_old_vs_paged_final.json", 1),
            ("paged_kv_h100_s22/run2_1b_old_vs_paged.json", 64),
        ],
    ),
    "h100_serve_8b.json": lambda: _stable_serve(
        "8b",
        [
            ("paged_kv_h100_s22/run4_8b_old_vs_paged.json", 1),
            ("paged_kv_h100_s22/run5_8b_old_vs_paged_scheduler_fix.json", 64),
            ("paged_kv_h100_s22/run5_8b_old_vs_paged_scheduler_fix.json", 128),
        ],
    ),
    "h100_serve_8b_8k_context.json": "paged_kv_h100_s22/run6_fused_8b.json",
    "h100x2_tensor_parallel.json": _stable_tp,
    "h100x2_data_parallel_8b.json": _stable_dp,
    "cpu_serve_vs_transformers.json": "bench_peers_cpu_s15_run3.json",
    "cpu_serve_mlx_vs_mlx_lm.json": "bench_peers_mlx_s20.json",
    "cpu_turboquant_decode_torch.json": "bench_turboquant_torch_smollm2_numba.json",
    "cpu_turboquant_decode_mlx.json": _stable_mlx_tq,
    "h100_turboquant_decode.json": lambda: _stable_rows(
        ["tq_s24/e2e_32768_paged.json", "tq_s24/e2e_131072_paged.json", "tq_s24/e2eb8_paged.json"],
        what="graphed decode step, random-weight Llama-3-8B shape, TurboQuant caches against the bf16 cache",
        date="2026-11-27",
        device=H100,
        command="scripts/bench_turboquant.py --shape 8b (presets with @paged: pages of the shared pool)",
    ),
    "h200_tq_128k_decode.json": _stable_tq_128k,
    "h200_kv_formats_serve_32k.json": "tq_s33/kv_formats_serve_32k_balanced.json",
    "h200_kv_formats_serve_128k.json": "tq_s33/kv_formats_serve_131k_balanced.json",
    "h200_serve_churn_8b.json": "tq_s33/serve_churn_h200_8b.json",
    "cpu_kv_formats_serve_4k.json": "tq_s33/kv_formats_serve_cpu_4k_s33.json",
    "h200_kv_bits_serve_128k.json": "tq_s34/kv_formats_serve_h200_131k_kvbits.json",
    "h200_serve_churn_8b_fresh.json": "tq_s34/serve_churn_h200_8b_fresh_s34.json",
    "h200_kv_decode_step.json": lambda: _stable_kv_step(
        ["tq_s29/kv_step_with16bit_32000.json", "tq_s29/kv_step_with16bit_131000.json"]
    ),
    "h100_speculative.json": "bench_speculative_gpu_h100_2026-11-22.json",
    "h100_media.json": "media_bench_gpu_run2.json",
    "h100_decode_vs_transformers.json": "bench_torch_gpu_h100_2026-11-22.json",
    "cpu_soak_200_streams_30min.json": "soak_torch_200x30m_s13.json",
    "cpu_soak_200_streams_30min.png": "soak_torch_200x30m_s13.png",
}


def refresh() -> None:
    for name, how in STABLE.items():
        if isinstance(how, str):
            shutil.copyfile(RES / how, RES / name)
        else:
            (RES / name).write_text(json.dumps(how(), indent=1) + "\n")
        print(f"wrote docs/results/{name}")


# ---------------------------------------------------------------------------------------------------- formatting
def n0(x: float) -> str:
    return f"{x:,.0f}"


def n1(x: float) -> str:
    return f"{x:,.1f}"


def x2(x: float) -> str:
    return f"{x:.2f}x"


def pct(x: float) -> str:
    return f"{100 * x:.0f}%"


def span(vals: list[float], fmt: str) -> str:
    lo, hi = fmt.format(min(vals)), fmt.format(max(vals))
    return lo if lo == hi else f"{lo}-{hi}"


def table(head: list[str], rows: list[list[str]]) -> str:
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def by(rows: list[dict], key: str) -> dict:
    out: dict = {}
    for r in rows:
        out.setdefault(r[key], []).append(r)
    return out


# ---------------------------------------------------------------------------------------------------- measures
@dataclass
class Measure:
    section: str
    title: str
    files: list[str]
    hardware: str
    body: Callable[[list], str]
    plot: str | None = None  # a PNG in docs/results, drawn by PLOTS[plot] or written by the run itself
    notes: str = ""
    extra_links: list[str] = field(default_factory=list)


def serve_table(j: dict) -> str:
    rows = []
    for n, rs in sorted(by(j["runs"], "concurrency").items()):
        tps = [r["output_tok_per_s"] for r in rs]
        itl = [r["itl_ms_p50"] for r in rs]
        ttft = [r["ttft_ms_p50"] for r in rs]
        rows.append(
            [
                n,
                " / ".join(n0(t) for t in tps),
                f"**{n0(max(tps))}**",
                span(itl, "{:.2f}") + " ms",
                span(ttft, "{:.0f}") + " ms",
            ]
        )
    return table(["streams", "output tok/s, each run", "best", "ITL p50", "TTFT p50"], rows)


def m_serve(docs: list) -> str:
    a, b = docs
    return f"Llama-3.2-1B shape:\n\n{serve_table(a)}\n\nLlama-3-8B shape:\n\n{serve_table(b)}"


def m_serve_8k(docs: list) -> str:
    (j,) = docs
    rows = []
    for mode, rs in by(j["runs"], "mode").items():
        mem = mode.replace("mem", "")
        rows.append(
            [
                f"`--kv-cache-memory {mem}`",
                " / ".join(n0(r["output_tok_per_s"]) for r in rs),
                f"{min(r['itl_ms_p50'] for r in rs):.1f}-{max(r['itl_ms_p50'] for r in rs):.1f} ms",
                f"{min(r['ttft_ms_p50'] for r in rs):.0f}-{max(r['ttft_ms_p50'] for r in rs):.0f} ms",
            ]
        )
    return table(["KV pool", "output tok/s, each run", "ITL p50", "TTFT p50"], rows)


def m_engine_process(docs: list) -> str:
    rows = []
    for j in docs:
        for n, rs in sorted(by(j["runs"], "concurrency").items()):
            m = {r["mode"]: r for r in rs}
            off, on = m["off"], m["on"]
            rows.append(
                [
                    j["shape"].upper(),
                    n,
                    n0(off["output_tok_per_s"]),
                    n0(on["output_tok_per_s"]),
                    f"**{x2(on['output_tok_per_s'] / off['output_tok_per_s'])}**",
                    f"{off['itl_ms_p50']:.1f} -> {on['itl_ms_p50']:.1f} ms",
                ]
            )
    return table(["shape", "streams", "thread (off) tok/s", "child process (on) tok/s", "on / off", "ITL p50"], rows)


def m_tp(docs: list) -> str:
    (j,) = docs
    rows = []
    for (shape, n), rs in sorted(by([{**r, "k": (r["shape"], r["concurrency"])} for r in j["runs"]], "k").items()):
        t = {tp: [r["output_tok_per_s"] for r in rs if r["tp"] == tp] for tp in (1, 2)}
        one, two = sum(t[1]) / len(t[1]), sum(t[2]) / len(t[2])
        rows.append(
            [shape, n, " / ".join(n1(v) for v in t[1]), " / ".join(n1(v) for v in t[2]), f"**{x2(two / one)}**"]
        )
    return table(["shape", "streams", "one GPU tok/s", "TP=2 tok/s", "TP=2 / one GPU (means)"], rows)


def m_dp(docs: list) -> str:
    (j,) = docs
    rows = []
    for (rep, n), rs in sorted(by([{**r, "k": (r["replicas"], r["concurrency"])} for r in j["runs"]], "k").items()):
        rows.append([rep, n, " / ".join(n0(r["output_tok_per_s"]) for r in rs), f"{rs[0]['ttft_ms_p50']:.0f} ms"])
    one = {r["concurrency"]: r["output_tok_per_s"] for r in j["runs"] if r["replicas"] == 1}
    two = {r["concurrency"]: r["output_tok_per_s"] for r in j["runs"] if r["replicas"] == 2}
    ratio = ", ".join(f"**{x2(two[n] / one[n])}** at {n} streams" for n in sorted(two) if n in one)
    return table(["replicas", "streams", "output tok/s, each run", "TTFT p50"], rows) + f"\n\nTwo replicas: {ratio}."


def m_peers(docs: list) -> str:
    a, b = docs
    rows = []
    for peer, j, ours, theirs in (
        ("`transformers serve --continuous-batching`", a, "swiftlm-torch", "transformers-serve"),
        ("`mlx_lm.server`", b, "swiftlm-mlx", "mlx-lm-server"),
    ):
        for n in sorted(j["results"][ours], key=int):
            o, t = j["results"][ours][n], j["results"][theirs][n]
            rows.append(
                [
                    peer,
                    n,
                    n1(o["output_throughput"]),
                    n1(t["output_throughput"]),
                    f"**{x2(o['output_throughput'] / t['output_throughput'])}**",
                ]
            )
    return table(["against", "streams", "SwiftLM tok/s", "peer tok/s", "ratio"], rows)


def m_batching(docs: list) -> str:
    (j,) = docs
    rows = [
        [r["streams"], n1(r["serial_tok_s"]), n1(r["concurrent_tok_s"]), f"**{x2(r['ratio'])}**"] for r in j["rows"]
    ]
    return table(["streams", "one after another, tok/s", "all at once, tok/s", "ratio"], rows)


def m_decode_vs_tf(docs: list) -> str:
    (j,) = docs
    rows = [
        [
            r["shape"],
            n1(r["swiftlm_tok_s"]),
            n1(r["transformers_tok_s"]),
            f"**{r['speedup_vs_transformers']:.1f}x**",
            pct(r["fraction_of_roofline"]),
        ]
        for r in j["rows"]
    ]
    return table(
        ["shape", "SwiftLM tok/s", "transformers `generate` tok/s", "ratio", "of the weight-bandwidth bound"], rows
    )


def m_tq_quality(docs: list) -> str:
    (j,) = docs
    rows = []
    for r in j["rows"]:
        name = r["preset"]
        rows.append(
            [
                f"**{name}**" if name == "k4v3" else name,
                f"{r['ppl']:.3f}",
                "-" if r.get("ppl_delta") in (None, 0) else f"{100 * r['ppl_delta']:+.2f}%",
                f"{100 * r['top1']:.1f}%",
                f"{r['vs_16bit']:.3f}x" if r.get("vs_16bit") else "1x",
            ]
        )
    return table(["format", "perplexity", "vs uncompressed", "top-1 agreement", "KV bytes vs 16-bit"], rows)


def m_tq_memory(docs: list) -> str:
    (j,) = docs
    rows = [
        [
            r["shape"],
            r["format"],
            f"{r['measured_bytes']:,}",
            "yes" if r["measured_bytes"] == r["formula_bytes"] else "no",
            f"**{r['ratio']:.3f}x**",
        ]
        for r in j["rows"]
    ]
    return table(["shape", "format", "bytes held at 8,192 positions", "= layout formula", "vs 16-bit"], rows)


def _speed_rows(rows: list[dict], ctx_key: str = "context") -> list[list[str]]:
    out = []
    for r in rows:
        if r["format"] == "fp16":
            continue
        out.append(
            [
                f"{r[ctx_key]:,}",
                r["format"],
                n1(r["tok_s"]),
                f"**{x2(r['speed_vs_plain'])}**",
                f"{r['kv_vs_plain']:.3f}x",
            ]
        )
    return out


def m_tq_cpu(docs: list) -> str:
    t, m = docs
    head = ["context", "format", "tok/s", "vs plain cache", "KV bytes vs plain (fp32)"]
    return (
        f"torch backend:\n\n{table(head, _speed_rows(t['rows']))}\n\n"
        f"MLX backend:\n\n{table(head, _speed_rows(m['rows']))}"
    )


def m_kv_serve(docs: list, every_run: bool = False) -> str:
    """Each KV format through `swiftlm serve`, as ratios to the 16-bit cache of the same run (without
    ``every_run``, the second run's concurrent streams only: its single streams are older code)."""
    rows = []
    for i, j in enumerate(docs):
        for fmt, rs in j["rows"].items():
            if fmt == "16bit":
                continue
            for r, q in zip(rs, j["ratios"][fmt]):
                if i and not every_run and r.get("streams", 1) == 1:
                    continue
                rows.append(
                    [
                        fmt,
                        f"{r['prompt_tokens']:,}",
                        r.get("streams", 1),
                        f"{r['ttft_ms_p50'] / 1e3:.2f} s",
                        f"**{x2(q['ttft'])}**",
                        f"{r['itl_ms_p50']:.2f} ms",
                        f"**{x2(q['itl_p50'])}**",
                    ]
                )
    head = ["format", "prompt", "streams", "time to first token", "vs 16-bit", "inter-token p50", "vs 16-bit"]
    return table(head, rows)


def m_churn(docs: list) -> str:
    """Each variant of a churn run (``scripts/bench_serve_churn.py``) against the first (16-bit) of the same run."""
    rows = []
    for j in docs:
        for r in j["rows"]:
            q = r["ratios"]
            rows.append(
                [
                    r["variant"],
                    f"{r['output_tok_s']:.0f} ({x2(q['output_tok_s'])})",
                    f"{r['ttft_ms_p50']:.0f} ms ({x2(q['ttft_ms_p50'])})",
                    f"{r['itl_ms_p50']:.2f} ms ({x2(q['itl_ms_p50'])})",
                    f"{r['itl_ms_p99']:.1f} ms ({x2(q['itl_ms_p99'])})",
                    f"{r['itl_ms_max']:.0f} ms",
                    f"{r.get('stalls', 0)} ({r.get('stall_ms_lost', 0) / 1e3:.1f} s)",
                ]
            )
    head = ["server", "output tok/s", "time to first token p50", "inter-token p50", "p99", "max", "steps > 75 ms"]
    return table(head, rows)


def m_scale_out(docs: list) -> str:
    """One GPU, --api-workers 2, --data-parallel 2 and --tensor-parallel 2 through HTTP, with the goal of each ratio."""
    (j,) = docs
    runs, itl = j["output_tok_s"], j.get("itl_ms", {})
    names = {
        "A": "one GPU",
        "B": "one GPU, `--api-workers 2`",
        "C": "`--data-parallel 2 --api-workers 2`",
        "D": "`--tensor-parallel 2`",
    }
    rows = []
    for key, tps in runs.items():
        if tps is None:
            continue
        label, n = key.split("_n")
        q = itl.get(key, {})
        rows.append([names[label], n, n1(tps), f"{q.get('p50', 0):.2f} / {q.get('p99', 0):.2f} ms"])
    out = table(["server", "streams", "output tok/s", "inter-token p50 / p99"], rows)
    what = {
        "api_workers_2_vs_1_at_256": "one GPU at 256 streams: `--api-workers 2` / one worker",
        "dp2_workers2_at_256_vs_one_replica_at_128": "`--data-parallel 2 --api-workers 2` at 256 / one GPU at 128",
        "tp2_vs_tp1_at_1": "`--tensor-parallel 2` / one GPU, one stream",
        "tp2_vs_tp1_at_64": "`--tensor-parallel 2` / one GPU, 64 streams",
        "tp2_vs_tp1_at_128": "`--tensor-parallel 2` / one GPU, 128 streams",
    }
    ratios = [[what.get(k, k), f"**{v['ratio']:.2f}x**"] for k, v in j["ratios"].items() if v["ratio"] is not None]
    return out + "\n\n" + table(["ratio", "output tok/s"], ratios)


KV_STEP_ATTENTION = {  # kernel name -> column: the decode attention's kernels per KV format
    "_split_kernel": "split",
    "_tq_attn_kernel": "split",
    "_combine_kernel": "combine",
    "_tq_combine_kernel": "combine",
    "_rotate_rows_kernel": "query rotation",
    "_tq_encode_kernel": "encoder",
}


def kv_step_per_layer(kernels: dict, L: int, field: str) -> tuple[dict, float]:
    """A profile_kv_step.py format's attention kernels per layer (column -> us of ``field``), and the steps per
    token: one split launch per layer and decode step (the profiled window's token count, from streamed deltas,
    need not match the steps whose kernels it caught)."""
    split = next(v for n, v in kernels.items() if KV_STEP_ATTENTION.get(n) == "split")
    per_token = L / split["calls_per_step"]
    layer: dict = {}
    for n, v in kernels.items():
        if n in KV_STEP_ATTENTION:
            col = KV_STEP_ATTENTION[n]
            layer[col] = layer.get(col, 0.0) + v[field] * per_token / L
    return layer, per_token


def m_kv_step(docs: list) -> str:
    """Per context and format: inter-token latency, the attention kernels per layer, the rest per token."""
    (j,) = docs
    rows = []
    for run in j["runs"]:
        for fmt, r in run["formats"].items():
            k = r["kernels"]
            L = run.get("layers", 32)  # the runs before the field: 8B, 32
            layer, per_token = kv_step_per_layer(k, L, "us_per_step")
            total = sum(v["us_per_step"] for v in k.values()) * per_token / 1e3
            attn = sum(layer.values()) * L / 1e3
            rows.append(
                [
                    f"{run['prompt_tokens']:,}",
                    "16-bit" if fmt == "16bit" else fmt,
                    f"{r['itl_ms_p50']:.2f} ms",
                    f"{layer['split']:.1f} us",
                    f"{layer.get('combine', 0):.1f} us",
                    f"{layer.get('query rotation', 0) + layer.get('encoder', 0):.1f} us",
                    f"{attn:.2f} ms",
                    f"{total - attn:.2f} ms",
                ]
            )
    head = [
        "prompt",
        "format",
        "inter-token p50",
        "split pass / layer",
        "combine / layer",
        "query rotation + encoder / layer",
        "attention / token",
        "other kernels / token",
    ]
    return table(head, rows)


def m_tq_128k_serve(docs: list) -> str:
    """Each build's inter-token latency at 131K against 16-bit's in the same run."""
    (j,) = docs
    rows = [
        [
            r["build"],
            r["format"],
            f"{r['itl_16bit_ms_p50']:.2f} ms",
            f"{r['itl_ms_p50']:.2f} ms",
            f"**{x2(r['itl_16bit_ms_p50'] / r['itl_ms_p50'])}**",
        ]  # fmt: skip
        for r in j["serve"]
    ]
    return table(["build", "format", "16-bit inter-token p50", "inter-token p50", "decode speed-up"], rows)


def m_tq_128k_path(docs: list) -> str:
    """Per variant: how much each attention kernel adds to the step's critical path, per layer."""
    (j,) = docs
    rows = []
    for r in j["step"]:
        path, _ = kv_step_per_layer(r["kernels"], r["layers"], "critical_us_per_step")
        rows.append(
            [
                r["variant"],
                f"{r['itl_ms_p50']:.3f} ms",
                f"{path['split']:.1f} us",
                f"{path.get('combine', 0):.1f} us",
                f"{path.get('query rotation', 0):.1f} us",
            ]  # fmt: skip
        )
    return table(
        ["variant", "inter-token p50", "split pass / layer", "combine / layer", "query rotation / layer"], rows
    )


def m_fp8_kernel(docs: list) -> str:
    """The paged decode kernel over e4m3 against 16-bit, before and after the float16 dots."""
    (j,) = docs
    rows = []
    for when in ("before", "after"):
        rs = j[when]["rows"]
        for B in sorted({r["batch"] for r in rs}):
            base = next(r for r in rs if r["batch"] == B and r["kv"] == "16bit")
            fp8 = min((r for r in rs if r["batch"] == B and r["kv"] == "fp8"), key=lambda r: r["ms"])
            rows.append(
                [
                    j[when]["note"],
                    B,
                    f"{base['ms'] * 1e3:.0f} us ({base['of_bound']:.0%})",
                    f"{fp8['ms'] * 1e3:.0f} us ({fp8['of_bound']:.0%})",
                    f"**{x2(base['ms'] / fp8['ms'])}**",
                ]
            )
    head = ["FP8 tiles", "sequences", "16-bit (of HBM bound)", "FP8 best (of HBM bound)", "FP8 speed-up"]
    return table(head, rows)


def m_tq_h100(docs: list) -> str:
    t, a32, a128 = docs
    rows = []
    for r in t["rows"] + a32["rows"] + a128["rows"]:
        if r["mode"] not in ("cuda-graph", "batched graph") or r["format"] == "fp16":
            continue
        if "@paged" not in r["format"] and not r["format"].startswith("kv_bits"):
            continue
        rows.append(
            [
                f"{r['context']:,}",
                r.get("batch") or 1,
                r["format"].replace("@paged", ""),
                n1(r["tok_s"]),
                f"**{x2(r['speed_vs_plain'])}**",
                f"{r['kv_vs_plain']:.3f}x",
            ]
        )
    return table(["context", "sequences", "format", "tok/s", "vs bf16 cache", "KV bytes vs bf16"], rows)


def m_experts_cpu(docs: list) -> str:
    (j,) = docs
    res = {r["name"]: r for r in j["results"]}
    bound = j["seq_read_cold_bytes_per_s"]
    rows = []
    for k, sfx in ((8, ""), (6, " k=6"), (4, " k=4"), (2, " k=2")):
        resident, warm, cold = res[f"resident{sfx}"], res[f"pread warm{sfx}"], res[f"pread cold{sfx}"]
        cold_bound = bound / cold["expected_bytes_per_token"]
        rows.append(
            [
                k,
                n1(resident["tok_per_s"]),
                f"{warm['tok_per_s']:.2f} ({x2(warm['tok_per_s'] / resident['tok_per_s'])})",
                f"{cold['tok_per_s']:.2f} (**{x2(cold['tok_per_s'] / cold_bound)}** of the disk bound)",
                f"{cold['bytes_per_token'] / 1e6:,.0f} MB",
                f"{cold['peak_rss'] / 1e6:,.0f} MB",
            ]
        )
    r8 = res["resident"]
    return (
        table(
            ["experts per token", "resident tok/s", "streamed, warm", "streamed, cold", "read per token", "peak RSS"],
            rows,
        )
        + f"\n\nThe same model loaded resident holds {r8['peak_rss'] / 1e9:.1f} GB; streamed, the process peaks under 1 GB."
    )


def m_experts_gpu(docs: list) -> str:
    (j,) = docs
    rows = []
    for r in j["results"]:
        if r.get("error"):
            rows.append([r["name"], "out of memory while loading", "", ""])
        else:
            cuda = r.get("cuda_peak_bytes")
            rows.append(
                [r["name"], f"{r['tok_per_s']:.2f}", f"{cuda / 1e9:.2f} GB" if cuda else "", r.get("mem_limit") or ""]
            )
    return table(["run", "tok/s", "CUDA peak", "--mem-limit"], rows)


def m_offload(docs: list) -> str:
    (j,) = docs
    rows = [
        [
            r["gpu_layers"],
            r["layers"] - r["gpu_layers"],
            r["offload_dtype"],
            f"{r['gpu_bytes_after_load'] / 2**30:.1f} GiB",
            n1(r["decode_tok_s"]),
        ]
        for r in j
    ]
    return table(["GPU layers", "CPU layers", "CPU dtype", "GPU memory after load", "one-stream tok/s"], rows)


def m_spec(docs: list) -> str:
    rows = []
    for where, j in zip(("this CPU (fp32)", "H100 (bf16)"), docs):
        res = j["results"]
        for prompt in ("copy", "free"):
            ng = res["ngram"][prompt]
            rows.append(
                [
                    where,
                    "copy-heavy" if prompt == "copy" else "free-form",
                    n1(res["plain"][prompt]["tok_s"]),
                    n1(ng["tok_s"]),
                    f"**{x2(ng['speedup'])}**",
                    pct(ng["acceptance"]),
                ]
            )
    return table(["where", "prompt", "plain tok/s", "n-gram tok/s", "speed-up", "drafts accepted"], rows)


def m_json(docs: list) -> str:
    (j,) = docs
    cells: dict = {}
    for r in j["rows"]:
        cells[(r["format"], r["max_tokens"], r["json_close"])] = r["valid_fraction"]
    toks = sorted({r["max_tokens"] for r in j["rows"]})
    fmts = list(dict.fromkeys(r["format"] for r in j["rows"]))
    rows = [[f, *[f"{pct(cells[(f, t, False)])} -> **{pct(cells[(f, t, True)])}**" for t in toks]] for f in fmts]
    return table(["valid JSON (off -> on)", *[f"max_tokens {t}" for t in toks]], rows)


def m_embed(docs: list) -> str:
    (j,) = docs
    rows = [
        [
            r["batch"],
            n1(r["swiftlm_emb_per_s"]),
            n1(r["transformers_emb_per_s"]),
            f"**{x2(r['ratio'])}**",
            f"{r['max_abs_diff']:.0e}",
        ]
        for r in j["rows"]
    ]
    return table(["batch", "SwiftLM embeddings/s", "transformers embeddings/s", "ratio", "largest difference"], rows)


def m_fork(docs: list) -> str:
    (j,) = docs
    rows = []
    for name, m in j["modes"].items():
        rows.append(
            [
                name,
                f"{m['wall_s_median']:.1f} s",
                f"{m['prefill_tokens']:,}",
                f"{m['kv_peak_bytes'] / 2**20:.1f} MiB",
                "yes" if m["identical_to_single"] else "no",
            ]
        )
    return table(
        ["request", "wall time", "prompt tokens prefilled", "KV at peak", "choices = the single request"], rows
    )


def m_test_time(docs: list) -> str:
    (j,) = docs
    rows = [[k, pct(v)] for k, v in j["accuracy"].items()]
    return table(["method", "accuracy"], rows) + (
        f"\n\n8 chains in one batch cost {j['ratios']['chains_vs_greedy_seconds']}x the wall time of one greedy chain "
        f"for {j['ratios']['chains_vs_greedy_tokens']}x the tokens. A 135M model is right less often when sampled "
        "than greedy and cannot judge answers: the strategies pay on larger models."
    )


def m_media(docs: list) -> str:
    rows = []
    for where, j in zip(("this CPU", "H100"), docs):
        for r in j["results"]:
            for kind in ("image", "audio"):
                m = r[kind]
                rows.append(
                    [
                        where,
                        r["backend"],
                        kind,
                        m["prompt_tokens"],
                        f"{m['preprocess_ms']:.0f} ms",
                        f"{m['prefill_media_ms']:.0f} / {m['prefill_text_ms']:.0f} ms",
                        f"{m['decode_media_tok_s']:.0f} / {m['decode_text_tok_s']:.0f}",
                    ]
                )
    return table(
        [
            "where",
            "backend",
            "input",
            "prompt tokens",
            "preprocess",
            "prefill: media / text prompt",
            "decode tok/s after media / text",
        ],
        rows,
    )


def m_soak(docs: list) -> str:
    (j,) = docs
    s = j["summary"]
    rows = [
        ["requests answered / cancelled by their clients / failed", f"{s['ok']} / {s['cancelled']} / {s['failed']}"],
        ["malformed requests answered 4xx / 5xx responses", f"{s['bad_rejected_4xx']} / {s['5xx']}"],
        [
            "RSS at peak after the 5-minute warm-up vs during it",
            f"{s['rss_max_after_warmup_bytes'] / 1e9:.3f} vs {s['rss_warmup_bytes'] / 1e9:.3f} GB (**{100 * s['rss_growth_after_warmup']:+.1f}%**)",
        ],
        ["requests active after the clients left", s["requests_active_after"]],
    ]
    return table(["measure", "result"], rows)


MATRIX_LABELS = {
    "smollm2-135m-instruct": "The bundled SmolLM2-135M on the CPU (fp32)",
    "/tmp/m8b": "A Llama-3-8B shape on the H100 (bf16, random weights)",
    "/tmp/moe9g": "A qwen3_moe with 8.9 GB of experts on the H100 (16 layers x 32 experts, top-8, random weights)",
}


def m_matrix(docs: list) -> str:
    out = []
    for j in docs:
        meta = j["meta"]
        rows_by = {
            r["config"]: [x for x in r["rows"] if x["kind"] == "context"]
            for r in j["results"]
            if not r["config"].startswith("turbo")  # measured before the current TurboQuant kernels: see above
        }
        ctxs = sorted({x["context"] for rs in rows_by.values() for x in rs})
        same = {x["context"]: x.get("output_digest") for x in rows_by.get("vanilla", [])}
        rows = []
        for config, rs in rows_by.items():
            at = {x["context"]: x for x in rs}
            last = at[max(at)] if at else None
            peak = ""
            if last:
                dev = last.get("device_peak_bytes")
                peak = f"{dev / 2**30:.1f} GiB" if dev else f"{last['peak_rss_bytes'] / 2**30:.1f} GiB (RSS)"
            kv = f"{last['kv_bytes'] / last['kv_fp16_bytes']:.2f}" if last and last["kv_fp16_bytes"] else ""
            equal = all(x.get("output_digest") == same.get(c) for c, x in at.items())
            rows.append(
                [
                    config,
                    *[n1(at[c]["decode_tps"]) if c in at and at[c].get("decode_tps") else "-" for c in ctxs],
                    peak,
                    kv,
                    "yes" if equal else "no",
                ]
            )
        label = MATRIX_LABELS.get(meta["model"], f"`{meta['model']}`")
        title = f"{label}, decode tok/s by context"
        head = ["configuration", *[f"{c:,}" for c in ctxs], "peak memory (longest)", "KV / 16-bit", "tokens = vanilla"]
        out.append(f"{title}:\n\n" + table(head, rows))
    return "\n\n".join(out)


MEASURES = [
    Measure(
        "Serving",
        "Throughput through HTTP",
        ["h100_serve_1b.json", "h100_serve_8b.json"],
        H100,
        m_serve,
        plot="h100_serve.png",
        notes="`swiftlm serve --parallel 128 --ctx-size 1024 --prompt-cache-bytes 0` on random-weight bf16 checkpoints of "
        "the Llama-3.2-1B and Llama-3-8B shapes; load from `swiftlm bench serve` (~40-token chat prompts, 128 new tokens, "
        "EOS banned, temperature 0.6, client processes starting together). The one-stream figures are within 67% (1B) "
        "and 89% (8B) of the bound the weights' bytes set at 3.0 TB/s.",
    ),
    Measure(
        "Serving",
        "128 streams at an 8K context in a fixed KV budget (paged KV pool)",
        ["h100_serve_8b_8k_context.json"],
        H100,
        m_serve_8k,
        notes="The 8B shape, 128 streams, `--ctx-size 8192`: 128 whole contexts would need 128 GiB of KV. The paged pool "
        "holds what `--kv-cache-memory` gives it; with 2 GB (70% of what the streams need) the newest sequences are "
        "preempted and recomputed (240 preemptions), and every request is still served.",
    ),
    Measure(
        "Serving",
        "The engine in its own process (`--engine-process`)",
        ["engine_process_gpu_h100_1b.json", "engine_process_gpu_h100_8b.json"],
        H100,
        m_engine_process,
        notes="The same server with the step loop on a thread of the HTTP process (`off`) and in a child process (`on`, "
        "the default for torch on CUDA). On the 2-core CPU the child process costs 0.64-0.81x (two cores leave no room "
        "for a second busy process), so `auto` keeps it off there.",
    ),
    Measure(
        "Serving",
        "Against other servers on a CPU",
        ["cpu_serve_vs_transformers.json", "cpu_serve_mlx_vs_mlx_lm.json"],
        CPU,
        m_peers,
        plot="cpu_serve_vs_peers.png",
        notes="`scripts/bench_peers.sh`: the same fp32 SmolLM2-135M weights for both servers, 40-token prompts, 128 new "
        "tokens, EOS banned, max(8, 4N) requests. transformers serve ends some requests at EOS despite the ban, so its "
        "rate counts the tokens it produced.",
    ),
    Measure(
        "Serving",
        "Concurrent streams against one after another (continuous batching)",
        ["bench_batching_cpu_torch.json"],
        CPU,
        m_batching,
        notes="`scripts/bench_batching.py --backend torch --tokens 32`, bundled SmolLM2 in fp32, prompt cache off.",
    ),
    Measure(
        "Serving",
        "One stream against transformers `generate`",
        ["h100_decode_vs_transformers.json"],
        H100,
        m_decode_vs_tf,
        notes="`scripts/bench_torch_gpu.py`: batch 1, 128-token prompt, 128 new tokens, greedy, transformers on the very "
        "same weight tensors (2026-11-22, an earlier engine: the serving table above is the current one-stream figure).",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Quality (perplexity and top-1 agreement)",
        ["eval_turboquant_quality.json"],
        CPU,
        m_tq_quality,
        plot="turboquant_quality.png",
        notes="`scripts/eval_turboquant_quality.py`: SmolLM2-135M in fp32 (head_dim 64) reads 4,096 tokens of Python "
        "documentation teacher-forced, each format against the uncompressed cache; TurboQuant window 128.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Memory at 8K context",
        ["bench_turboquant_memory.json"],
        CPU,
        m_tq_memory,
        notes="`scripts/bench_turboquant.py --memory`: the bytes every tensor of a cache filled to 8,192 positions holds "
        "(codes, norms, QJL signs, the 16-bit window), against the layout formula of `swiftlm/turboquant/presets.py`.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Time to first token and inter-token latency through `swiftlm serve` (H100)",
        ["h100_kv_formats_serve.json", "h100_kv_formats_serve_8streams.json"],
        H100,
        m_kv_serve,
        notes="`scripts/bench_kv_formats_serve.py` (`scripts/gpu_kv_formats.sh serve`): a random-weight Llama-3-8B shape "
        "served once per KV format, random-token prompts sent as ids, 128 new tokens (768 with 8 streams), the 16-bit "
        "cache in the same run; ratios are the format's time over 16-bit's (below 1: faster). Prompts are held in 16 "
        "bits while they prefill and compressed when they end (`--turbo-kv-prompt-memory`, 4GB). The 8-stream rows "
        "are an earlier build, whose scheduler gave each step's leftover budget (8 tokens) to the next prompt: every "
        "prompt after the first then compressed as it prefilled (the H200 table below has the current figures). "
        "These are the figures a user sees; the decode-step tables below explain them.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "32K and 128K prompts through `swiftlm serve` (H200)",
        [
            "h200_kv_formats_serve_32k.json",
            "h200_kv_formats_serve_128k.json",
            "kv_formats_serve_h200_32k_kvbits.json",
            "h200_kv_bits_serve_128k.json",
        ],
        H200,
        lambda docs: m_kv_serve(docs, every_run=True),
        notes="`scripts/gpu_kv_formats.sh serve` with `CTX=135168`: the same 8B shape and method as the H100 table, "
        "128 new tokens (768 with 8 streams). At 131,072 tokens a `--turbo-kv` server stages the whole prompt in 16 "
        "bits (`--turbo-kv-prompt-memory auto`: one context, 17 GB here) and compresses it when it ends. The decode "
        "steps are overlapped and GPU-bound (step log: 0.3 ms to launch, ~7 ms waiting on the GPU); a compressed step "
        "reads about a quarter of the 16-bit cache's bytes, but the TurboQuant decode kernel runs well below the "
        "memory bound, so at 128K the step is 15-18% faster rather than the ~1.8x "
        "the bytes allow. With 8 streams of 32K the prompts prefill one after another, a full chunk per step, each "
        "staged in 16 bits. The 32K and 128K rows are the current build: one sequence's decode row with 4 split "
        "programs per SM, even split ranges and the combine pass off the critical path (the next tables); several "
        "sequences' rows in one launch with 16 per SM (which took 8 streams from 1.03x of 16-bit's inter-token latency "
        "with 8 per SM to 0.99x, `tq_s31/`). The `kv_bits` rows are requests with `kv_bits` on a 16-bit server, which "
        "stages 4 GiB of prompt in 16 bits: a 131,072-token prompt (17 GB) does not fit, so it is compressed as it "
        "prefills; the 32K rows are an earlier build, the 128K rows the current one. At 128K kv8's decode is 1.06x "
        "16-bit's inter-token latency although it reads about half the bytes: its split pass takes 5.0 ms of the "
        "step (~9.7 GB of codes, scales and biases: ~1.9 TB/s) where 16-bit's takes 4.6 ms (17.2 GB: ~3.75 TB/s), "
        "so it is bound by dequantizing, not by memory (`tq_s34/kv_step_profile_131100_16bit_kv8_kv4.json`). Its "
        "launch knobs (4, 16 or 32 programs per SM instead of 8, 8 warps, 2 or 4 stages, 32- or 128-row tiles; "
        "`SWIFTLM_TQ_PROGRAMS_PER_SM`, `SWIFTLM_AFFINE_TUNE`) were all slower (`tq_s34/affine_kv_step_ab.log`).",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Requests that come and go through `swiftlm serve` (H200)",
        ["serve_churn_h200_8b.json"],
        H200,
        m_churn,
        notes="`scripts/bench_serve_churn.py` (`scripts/gpu_tq_churn.sh serve`): the 8B shape, 8 requests at a time, "
        "48 in all, prompts of 4,000 ± 1,500 random tokens and 256 ± 128 new ones, so the sequences decoding together "
        "change at every arrival and departure; ratios are to the 16-bit server of the same run. `k4v3_first` is the "
        "first TurboQuant server on the machine: its Triton kernels compiled under the load (steps of 6.5 and 10 s), "
        "before the start-up warm-up existed. `k4v3_graph_per_set` captures a CUDA graph for each new set of "
        "compressed caches (`SWIFTLM_TQ_SET_TABLES=0`, the earlier build); `k4v3` replays one graph per batch size. "
        "Inter-token latency p50 is 1.22x at these short contexts, where the codes save little reading. Steps > 75 ms: "
        "steps with decode rows that took longer than a step with a full prompt chunk does (~27 ms at the median), "
        "and the time they took beyond a decode-only step. `k4v3`'s 9 took 85-170 ms each: the first step, 7 in the 2 "
        "s in which batch sizes 3 to 7 of compressed rows beside a prompt chunk first occurred, and one later; "
        "16-bit's one is its first step.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Requests that come and go, with the start-up warm-up (H200)",
        ["h200_serve_churn_8b.json", "h200_serve_churn_8b_fresh.json"],
        H200,
        m_churn,
        notes="The same load and script as the table above, on the build with the two-wave start-up warm-up (a short "
        "prompt decoding beside the chunks of a long one, then one prompt per batch size). Steps are counted from the "
        "moment each server was ready: the warm-up's steps are left out (`bench_serve_churn.py --ready`, read off "
        "the step logs for these runs). `k4v3_first` is the first k4v3 server of this run, on a machine whose Triton "
        "cache held the kernels of earlier k4v3 servers; its one long step (5.5 s, one decode row beside a 512-token "
        "prompt chunk) is a kernel compiled under the load. On a fresh machine with `SWIFTLM_LOG_COMPILES=1` "
        "(`tq_s33/compile_log_fresh_k4v3.txt`, `tq_s33/serve_churn_h200_8b_fresh_compile_log.json`) the warm-up "
        "compiled every TurboQuant kernel, and after it only the encode kernel compiled again, twice (2.5 and 3.6 s, "
        "one 6.1 s step), besides the sampler's two kernels at the first request (0.5 s); the encode kernel's row "
        "count has since stopped being a specialised argument, which this run predates. 16-bit's time to first token "
        "p99 comes from its first long prompt: that prompt's first step took 3.95 s. A TurboQuant server takes "
        "such a step (3.4-3.9 s) in its warm-up, and graphed CUDA servers of every format now run a prompt of "
        "several chunks at start-up, also after this run. The last two rows are a fresh machine (empty Triton cache) "
        "on the build with both changes and `SWIFTLM_LOG_COMPILES=1`: no TurboQuant kernel compiled after the "
        "warm-up, `k4v3_first`'s longest step is 161 ms (6.2 s before) and 16-bit's time to first token p99 2.1 s "
        "(5.9 s). What still compiled after ready was the sampler's two Triton kernels, at the first sampled "
        "request (1.4 s over 16-bit's first two steps: the warm-up's requests were greedy, which takes the argmax). "
        "The warm-up's requests now sample; on another fresh machine the 16-bit server then compiled nothing after "
        "ready, its longest step was 77 ms and its time to first token p99 2.36 s "
        "(`tq_s34/serve_churn_h200_8b_fresh_sampled_warmup.json`).",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "TurboQuant decode at 128K: the combine pass off the critical path, even split ranges (H200)",
        ["h200_tq_128k_decode.json"],
        H200,
        m_tq_128k_serve,
        notes="Through `swiftlm serve` (`scripts/gpu_tq_ab.sh`, `scripts/gpu_kv_formats.sh serve`): the 8B shape, one "
        "stream, a 131,072-token prompt, 128 new tokens, 16-bit served in the same run. The TurboQuant decode row is "
        "two kernels per layer, a split pass over the codes and a combine pass that merges the splits, rotates the sum "
        "back and attends the 16-bit window. Before: the combine waited for the split pass to finish, then did all of "
        "that (`SWIFTLM_TQ_EARLY=0 SWIFTLM_TQ_COMBINE=PRE=0`). Now the split pass lets it launch right after its own "
        "wait, and the combine attends the 16-bit window and loads the rotation before waiting for the partials; "
        "after the wait only the merge is left, which 4 warps do faster than 8. The split pass gives each KV head's "
        "66 splits whole tiles of 64 rows. With ceil-sized ranges (`SWIFTLM_TQ_BALANCE=0`), from 2,047 tiles on every "
        "split but the last ones ran 32 tiles (the last two short or empty), so the SMs holding four full splits "
        "set the pass's end; even ranges give 31 or 32 tiles to every split. During this run the codes grow from "
        "2,046 to 2,048 tiles.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "The attention kernels on a 128K decode step's critical path (H200)",
        ["h200_tq_128k_decode.json"],
        H200,
        m_tq_128k_path,
        notes="`scripts/gpu_kv_step_ab.sh` (`scripts/profile_kv_step.py` in process, one request at 131,000 tokens "
        "unless the row says otherwise, 60 decode steps under the profiler, one process per variant): per layer, how "
        "far each kernel's end moved the latest end of the kernels before it. At 131,000 tokens the codes are 2,045 "
        "tiles, 31 per split with either range layout (3,366 and 3,370 us per step, `tq_s33/`); at 131,100 they "
        "are 2,047-2,048, where the two layouts differ. Kernels launched with programmatic dependent launch start before "
        "the one before them ends, so their own durations (the table below) overstate what they add.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Where a long-context decode step's time goes (H200)",
        ["h200_kv_decode_step.json"],
        H200,
        m_kv_step,
        notes="`scripts/gpu_kv_step_profile.sh` (`scripts/profile_kv_step.py`): the same 8B shape through the Python "
        "API (the server's engine), one request per format on a 16-bit engine, the CUDA kernels of 60 decode steps "
        "summed per kernel (graph replays included), on the build before the combine pass moved off the critical "
        "path (two tables up). Kernel times overlap a little (programmatic dependent launch), "
        "so their sum exceeds the inter-token latency. The TurboQuant split pass is faster than the 16-bit one at both "
        "lengths, but its combine pass (merging 132 splits per head, rotating the sum back, attending the 16-bit "
        "window) and the query's rotation cost ~12 us per layer more than 16-bit's combine; at 32K that outweighs "
        "the split's gain. The matrix-vector products of the weights (~3.9 ms) are the same for every format.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Time to first token and inter-token latency through `swiftlm serve` (CPU)",
        ["cpu_kv_formats_serve_4k.json"],
        CPU,
        m_kv_serve,
        notes="`scripts/bench_kv_formats_serve.py --prompt-tokens 4000 --rounds 3 --one-server`: the bundled "
        "SmolLM2-135M in fp32 on torch, a 4,000-token random-token prompt, 128 new tokens, one 16-bit server with the "
        "format chosen per request, the formats in turn three times (medians of each round's ratio). The 16-bit "
        "inter-token latency was 48-60 ms and its time to first token 14.5-15.8 s in this run (an earlier build on a "
        "quieter machine: 47-54 ms; `kv_formats_serve_cpu_4k.json`: 1.25x / 1.10x / 1.07x / 1.27x time to first "
        "token, 0.99x / 0.98x / 1.11x / 1.12x decode). The same code with one server per format (2 rounds, "
        "`kv_formats_serve_cpu_4k_servers.json`, each format at its own minutes) measured decode at 0.92x (k4v3), "
        "0.87x (k3v2), 1.04x (kv8) and 1.01x (kv4), with 16-bit's own inter-token latency 43.7 ms in one round and "
        "51.4 ms in the other: ratios within ~10% of each other are not told apart on this shared VM.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "FP8 KV cache: the decode-attention kernel (H200)",
        ["h200_fp8_kv_kernel.json"],
        H200,
        m_fp8_kernel,
        notes="`scripts/bench_fp8_kv_kernel.py`: the paged decode-attention kernel alone (Llama-3-8B attention shape, "
        "32K positions per sequence, block size 64) under CUDA-graph replay; the fraction is of the bytes read over "
        "4.8 TB/s. The FP8 cache reads half the bytes; the kernel is bound by converting them, not by reading them. "
        "Through `swiftlm serve` (32K prompt, before the float16 change): one stream 0.94x of 16-bit's decode speed, "
        "eight streams 1.05x, time to first token 1.03x / 1.12x (`h200_kv_formats_serve_fp8_before_f16.json`).",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Decode speed on an H100",
        ["h100_turboquant_decode.json", "bench_affine_gpu_h100_8b_32k.json", "bench_affine_gpu_h100_8b_128k.json"],
        H100,
        m_tq_h100,
        plot="h100_turboquant_decode.png",
        notes="`scripts/bench_turboquant.py --shape 8b`: the graphed decode step of a random-weight Llama-3-8B shape "
        "against the graphed bf16 step in the same run; TurboQuant codes as pages of the shared pool (what "
        "`--turbo-kv` serves). Compressed caches read fewer bytes, so long contexts decode faster.",
    ),
    Measure(
        "Long context: TurboQuant and kv_bits",
        "Decode speed on a CPU",
        ["cpu_turboquant_decode_torch.json", "cpu_turboquant_decode_mlx.json"],
        CPU,
        m_tq_cpu,
        plot="cpu_turboquant_decode.png",
        notes="`scripts/bench_turboquant.py --shape smollm2`: SmolLM2-135M's shape, caches filled with random rows, "
        "decode tokens timed, median of 3 interleaved rounds; the plain cache is fp32 on a CPU. Decode rows read the "
        "codes through numba kernels (`SWIFTLM_NUMBA=0` turns them off).",
    ),
    Measure(
        "Big MoE models: expert streaming and offload",
        "SSD expert streaming on a CPU",
        ["expert_streaming_torch_cpu.json"],
        CPU,
        m_experts_cpu,
        plot="expert_streaming_cpu.png",
        notes="`scripts/bench_expert_streaming.py --backend torch`: a random qwen3_moe with 4.83 GB of bf16 experts (16 "
        "layers x 64 experts, k=8). Warm: the checkpoint in the page cache; cold: pages dropped before every token, "
        "compared with the disk's measured sequential bandwidth. Bytes read per token equal layers x k x bytes per "
        "expert exactly.",
    ),
    Measure(
        "Big MoE models: expert streaming and offload",
        "Expert streaming on an H100 under a GPU memory cap",
        ["expert_streaming_gpu_h100.json"],
        H100,
        m_experts_gpu,
        notes="`scripts/bench_expert_streaming.py` with `--mem-limit 4GB` on a qwen3_moe with 8.86 GB of experts: the "
        "resident model cannot load under the cap; streamed, it runs in 0.65 GB of GPU memory.",
    ),
    Measure(
        "Big MoE models: expert streaming and offload",
        "Partial offload (`--gpu-layers`)",
        ["gpu_offload_h100.json"],
        H100,
        m_offload,
        notes="An 8B-shape bf16 checkpoint, one stream, 32 greedy tokens; the host is a 16-thread Xeon. Every CPU layer "
        "reads ~0.9 GB of host memory per token: offload is for models that do not fit, not for speed.",
    ),
    Measure(
        "Multi-GPU",
        "Tensor parallel",
        ["h100x2_tensor_parallel.json"],
        H100X2,
        m_tp,
        plot="h100x2_parallel.png",
        notes="Random-weight Llama-3-8B and a Qwen2.5-32B-like shape in bf16, one stream and 64 streams through HTTP.",
    ),
    Measure(
        "Multi-GPU",
        "Scale-out on two H200s: tensor parallel, data parallel, API workers",
        ["h200x2_scale_out.json"],
        H200X2,
        m_scale_out,
        notes="`scripts/gpu_api_workers.sh`: a random-weight Llama-3-8B shape in bf16, 40-token prompts, 256 new tokens "
        "(EOS banned), prompt cache off, `--parallel 256`, `swiftlm bench serve` with 4 client processes from 64 "
        "streams; every server runs its engine in its own process. The bound of each ratio is 2x (two GPUs) for "
        "data and tensor parallel; tensor parallel at one stream is bounded by the all-reduces (64 per token).",
    ),
    Measure(
        "Multi-GPU",
        "Data-parallel replicas",
        ["h100x2_data_parallel_8b.json"],
        H100X2,
        m_dp,
        notes="Two replicas at 128 streams are two replicas at 64 each, and one GPU at 64 streams does ~0.8x the work "
        "it does at 128: that, not routing, bounds the ratio at 128 streams (the server reaches 96-97% of 2x one "
        "replica's 64-stream figure). At 256 streams each replica is full.",
    ),
    Measure(
        "Requests",
        "Speculative decoding (prompt lookup)",
        ["bench_speculative_cpu_torch.json", "h100_speculative.json"],
        f"{CPU}; {H100}",
        m_spec,
        notes="`scripts/bench_speculative.py`: greedy, 4 draft tokens, SmolLM2-135M; a prompt whose answer copies it and "
        "a free-form one. Every run gives the plain greedy tokens.",
    ),
    Measure(
        "Requests",
        "Structured output that survives `max_tokens`",
        ["json_validity_cpu.json"],
        CPU,
        m_json,
        notes="`scripts/bench_json_validity.py`: bundled SmolLM2, 50 seeded runs per cell at temperature 0.8, the closing "
        "of an output cut by `max_tokens` (and the repetition guard) off and on.",
    ),
    Measure(
        "Requests",
        "n choices from one prefill",
        ["bench_fork_cpu.json"],
        CPU,
        m_fork,
        notes="`scripts/bench_fork.py`: bundled SmolLM2 in fp32, a 1,003-token prompt, 32 greedy tokens per choice.",
    ),
    Measure(
        "Requests",
        "Embeddings",
        ["bench_embeddings_cpu.json"],
        CPU,
        m_embed,
        notes="`scripts/bench_embeddings.py`: a SmolLM2-135M-shaped embedding checkpoint (random weights), beside "
        "transformers' `AutoModel` on the same checkpoint.",
    ),
    Measure(
        "Requests",
        "Test-time compute on a small model",
        ["test_time_accuracy_cpu.json"],
        CPU,
        m_test_time,
        notes="`scripts/eval_test_time.py`: bundled SmolLM2-135M, 40 arithmetic problems, 8 chains at temperature 0.7.",
    ),
    Measure(
        "Requests",
        "Vision and audio inputs",
        ["media_bench.json", "h100_media.json"],
        f"{CPU}; {H100}",
        m_media,
        notes="`scripts/bench_media.py`: a random-weight Gemma 4 with tiny towers (plumbing costs, not a real VLM's); a "
        "1024x768 JPEG and a 10 s 44.1 kHz stereo WAV against a text prompt of the same length.",
    ),
    Measure(
        "Operations",
        "Memory under load",
        ["cpu_soak_200_streams_30min.json"],
        CPU,
        m_soak,
        plot="cpu_soak_200_streams_30min.png",
        notes="`scripts/soak.py --streams 200 --duration 1800 --warmup 300`: the bundled model, `--parallel 16`; 30% of "
        "the clients cut their streams, 5% of the requests are malformed. The run fails on a failed well-formed "
        "request, any 5xx, or RSS growth over 5% after the warm-up.",
    ),
    Measure(
        "Operations",
        "The speed and memory matrix of a model (`swiftlm bench`)",
        ["bench_quick_cpu_torch.json", "bench_h100_8b.json", "bench_h100_moe.json"],
        f"{CPU} (bundled model); {H100} (8B shape and MoE)",
        m_matrix,
        plot="bench_quick_cpu_torch_speed.png",
        notes="`swiftlm bench`: each configuration in a process of its own, one request per context length, greedy, "
        "prompt cache off. `experts` is `--stream-experts`. The runs' TurboQuant "
        "configurations predate the current TurboQuant kernels and are left out here (the decode tables above are "
        "current); the linked JSON keeps them.",
        extra_links=[
            "bench_quick_cpu_torch_memory.png",
            "bench_h100_8b_speed.png",
            "bench_h100_8b_memory.png",
            "bench_h100_moe_speed.png",
            "bench_h100_moe_memory.png",
            "bench_quick_cpu_torch.md",
            "bench_h100_8b.md",
            "bench_h100_moe.md",
        ],
    ),
]


# ---------------------------------------------------------------------------------------------------- plots
def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_serve(plt, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, name, label in zip(
        axes, ("h100_serve_1b.json", "h100_serve_8b.json"), ("Llama-3.2-1B shape", "Llama-3-8B shape")
    ):
        runs = by(_load(name)["runs"], "concurrency")
        ns = sorted(runs)
        best = [max(r["output_tok_per_s"] for r in runs[n]) for n in ns]
        ax.bar([str(n) for n in ns], best, color="#3f51b5")
        for i, v in enumerate(best):
            ax.text(i, v, n0(v), ha="center", va="bottom", fontsize=8)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tok/s (best run)")
    fig.suptitle("swiftlm serve on one H100, through HTTP", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_peers(plt, out: Path) -> None:
    a, b = _load("cpu_serve_vs_transformers.json"), _load("cpu_serve_mlx_vs_mlx_lm.json")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    for ax, j, ours, theirs, title in (
        (axes[0], a, "swiftlm-torch", "transformers-serve", "torch backend vs transformers serve"),
        (axes[1], b, "swiftlm-mlx", "mlx-lm-server", "MLX backend vs mlx_lm.server"),
    ):
        ns = sorted(j["results"][ours], key=int)
        xs = range(len(ns))
        ax.bar([x - 0.2 for x in xs], [j["results"][ours][n]["output_throughput"] for n in ns], 0.4, label="SwiftLM")
        ax.bar([x + 0.2 for x in xs], [j["results"][theirs][n]["output_throughput"] for n in ns], 0.4, label=theirs)
        ax.set_xticks(list(xs), ns)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel("output tok/s")
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("The same fp32 SmolLM2-135M on a 2-core CPU", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_tq_quality(plt, out: Path) -> None:
    j = _load("eval_turboquant_quality.json")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for r in j["rows"]:
        if not r.get("vs_16bit"):
            continue
        ax.scatter(r["vs_16bit"], 100 * r["ppl_delta"], color="#d32f2f" if r["preset"] == "k4v3" else "#3f51b5")
        ax.annotate(
            r["preset"], (r["vs_16bit"], 100 * r["ppl_delta"]), fontsize=7, xytext=(3, 3), textcoords="offset points"
        )
    ax.set_yscale("symlog", linthresh=1)
    ax.set_xlabel("KV bytes vs a 16-bit cache")
    ax.set_ylabel("perplexity change (%)")
    ax.set_title("KV formats on SmolLM2-135M, 4,096 tokens", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_tq_h100(plt, out: Path) -> None:
    rows = [
        r
        for f in (
            "h100_turboquant_decode.json",
            "bench_affine_gpu_h100_8b_32k.json",
            "bench_affine_gpu_h100_8b_128k.json",
        )
        for r in _load(f)["rows"]
    ]
    cases = [("32K", 32768, None), ("128K", 131072, None), ("32K x 8 seqs", 32768, 8)]
    fmts = ["k4v3@paged", "k3v2@paged", "kv_bits=8", "kv_bits=4"]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for i, fmt in enumerate(fmts):
        vals = []
        for _, ctx, batch in cases:
            hit = [
                r["speed_vs_plain"]
                for r in rows
                if r["format"] == fmt
                and r["context"] == ctx
                and r.get("batch") == batch
                and r["mode"] in ("cuda-graph", "batched graph")
            ]
            vals.append(hit[0] if hit else 0)
        ax.bar([x + (i - 1.5) * 0.2 for x in range(len(cases))], vals, 0.2, label=fmt.replace("@paged", ""))
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(cases)), [c[0] for c in cases])
    ax.set_ylabel("decode speed vs bf16 cache")
    ax.set_title("Graphed 8B decode step on an H100", fontsize=10)
    ax.legend(fontsize=8, ncol=4)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_tq_cpu(plt, out: Path) -> None:
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4), sharey=True)
    for ax, name, title in (
        (axes[0], "cpu_turboquant_decode_torch.json", "torch"),
        (axes[1], "cpu_turboquant_decode_mlx.json", "MLX"),
    ):
        rows = [r for r in _load(name)["rows"] if r["format"] != "fp16"]
        fmts = list(dict.fromkeys(r["format"] for r in rows))
        ctxs = sorted({r["context"] for r in rows})
        for i, c in enumerate(ctxs):
            vals = [
                next((r["speed_vs_plain"] for r in rows if r["format"] == f and r["context"] == c), 0) for f in fmts
            ]
            ax.bar([x + (i - 0.5) * 0.4 for x in range(len(fmts))], vals, 0.4, label=f"{c:,} tokens")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(fmts)), fmts, fontsize=7, rotation=20)
        ax.set_title(f"{title} backend", fontsize=10)
        ax.legend(fontsize=8)
    axes[0].set_ylabel("decode speed vs plain (fp32) cache")
    fig.suptitle("Compressed KV caches on a 2-core CPU, SmolLM2-135M shape", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_experts(plt, out: Path) -> None:
    res = {r["name"]: r for r in _load("expert_streaming_torch_cpu.json")["results"]}
    names = ["resident", "pread warm", "pread cold", "mmap warm", "mmap cold"]
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    axes[0].bar(names, [res[n]["tok_per_s"] for n in names], color="#3f51b5")
    axes[0].set_ylabel("tok/s")
    axes[0].tick_params(axis="x", labelrotation=20, labelsize=8)
    axes[1].bar(names, [res[n]["peak_rss"] / 1e9 for n in names], color="#009688")
    axes[1].set_ylabel("peak resident memory (GB)")
    axes[1].tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.suptitle("A 4.8 GB-of-experts MoE on a 2-core CPU (k = 8)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_parallel(plt, out: Path) -> None:
    tp, dp = _load("h100x2_tensor_parallel.json")["runs"], _load("h100x2_data_parallel_8b.json")["runs"]

    def mean(rs):
        return sum(r["output_tok_per_s"] for r in rs) / len(rs)

    labels, vals = [], []
    for shape, n in (("8B", 1), ("32B", 1), ("32B", 64)):
        one = mean([r for r in tp if r["shape"] == shape and r["concurrency"] == n and r["tp"] == 1])
        two = mean([r for r in tp if r["shape"] == shape and r["concurrency"] == n and r["tp"] == 2])
        labels.append(f"TP=2, {shape}\n{n} stream{'s' if n > 1 else ''}")
        vals.append(two / one)
    for n in (128, 256):
        one = mean([r for r in dp if r["replicas"] == 1 and r["concurrency"] == n])
        two = mean([r for r in dp if r["replicas"] == 2 and r["concurrency"] == n])
        labels.append(f"DP=2, 8B\n{n} streams")
        vals.append(two / one)
    fig, ax = plt.subplots(figsize=(7, 3.4))
    ax.bar(labels, vals, color="#3f51b5")
    for i, v in enumerate(vals):
        ax.text(i, v, f"{v:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_ylabel("two GPUs / one GPU")
    ax.tick_params(axis="x", labelsize=8)
    ax.set_title("Two H100s against one, through HTTP", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def plot_matrix(plt, out: Path) -> None:
    """The matrix runs' own plots (swiftlm bench's report), for the runs whose PNGs were not kept."""
    from swiftlm.bench.report import draw_plots

    for name in ("bench_h100_8b", "bench_h100_moe"):
        draw_plots([(name, _load(f"{name}.json"))], RES / name)


PLOTS: dict[str, Callable] = {
    "h100_serve.png": plot_serve,
    "cpu_serve_vs_peers.png": plot_peers,
    "turboquant_quality.png": plot_tq_quality,
    "h100_turboquant_decode.png": plot_tq_h100,
    "cpu_turboquant_decode.png": plot_tq_cpu,
    "expert_streaming_cpu.png": plot_experts,
    "h100x2_parallel.png": plot_parallel,
    "bench_h100_8b_speed.png": plot_matrix,
}


def draw_all() -> None:
    plt = _plt()
    for name, fn in PLOTS.items():
        fn(plt, RES / name)
        plt.close("all")
        print(f"drew docs/results/{name}")


# ---------------------------------------------------------------------------------------------------- the page
INTRO = """# Benchmarks

<!-- generated by scripts/gen_bench_page.py from docs/results/*.json; re-run it after a new measurement -->

The current figure for each measure, from the result file named under its table. Every number was taken by a script
in `scripts/` (named with each measure), ratios in one run against a baseline run beside it. Three machines:

- **H100**: {h100}.
- **2 x H100**: {h100x2}.
- **CPU**: {cpu}. Its timings are shared with other work and vary between runs; read ratios within a table.

GPU figures use random-weight checkpoints in the shapes of public models (`scripts/make_checkpoint.py`), because the
test machines have no hub access: they measure speed, never quality. Quality figures use the real SmolLM2-135M.
How these numbers got here, and what each change bought, is in CHANGELOG.md in the repository root.
"""


def page() -> str:
    parts = [INTRO.format(h100=H100, h100x2=H100X2, cpu=CPU)]
    section = None
    for m in MEASURES:
        if m.section != section:
            section = m.section
            parts.append(f"## {section}\n")
        docs = [_load(f) for f in m.files]
        lines = [f"### {m.title}", "", f"*{m.hardware}.* {m.notes}".rstrip(), "", m.body(docs), ""]
        if m.plot:
            lines += [f"![{m.title}](results/{m.plot})", ""]
        links = [f"[{f}](results/{f})" for f in m.files] + [f"[{f}](results/{f})" for f in m.extra_links]
        lines += ["Data: " + ", ".join(links) + ".", ""]
        parts.append("\n".join(lines))
    return "\n".join(parts).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--refresh", action="store_true", help="remake the stable result files from the raw runs")
    ap.add_argument("--plots", action="store_true", help="redraw the plots (matplotlib)")
    ap.add_argument("--check", action="store_true", help="compare the page with what the files give; write nothing")
    a = ap.parse_args(argv)
    if a.refresh:
        refresh()
    if a.plots:
        draw_all()
    text = page()
    missing = [m.plot for m in MEASURES if m.plot and not (RES / m.plot).exists()]
    if a.check:
        bad = []
        if not PAGE.exists() or PAGE.read_text() != text:
            bad.append("docs/benchmarks.md is out of date (run `python scripts/gen_bench_page.py`)")
        if missing:
            bad.append("plots missing (run with --plots): " + ", ".join(missing))
        for b in bad:
            print(b, file=sys.stderr)
        return 1 if bad else 0
    PAGE.write_text(text)
    print(f"wrote {PAGE.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
