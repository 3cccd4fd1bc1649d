"""``swiftlm bench``: the speed and memory matrix of one model, one command.

    swiftlm bench --quick                                  # bundled model, this machine, a few minutes on CPU
    swiftlm bench --model DIR --contexts 512,4096,16384 --configs vanilla,turbo,experts,experts+turbo
    swiftlm bench --compare before.json after.json        # two runs side by side

Configurations (``--configs``): ``vanilla`` (16-bit KV, experts resident), ``turbo`` (``--turbo-kv`` with every
TurboQuant preset; ``turbo:k4v3`` names one), ``experts`` (``--stream-experts``) and ``experts+turbo`` (both).
A configuration the model cannot run (``experts`` on a dense model) is reported as skipped, with the reason.

Each configuration runs in its own child process (``python -m swiftlm.bench.matrix --worker``) so that its peak
memory is its own.  Per context length, one request of that many prompt tokens decodes ``--decode-tokens``
tokens (greedy, EOS ignored, prompt cache off): prefill tok/s = prompt tokens / TTFT, decode tok/s = tokens after
the first / time after the first, peak process RSS and peak device memory over that request (both reset before
it), the KV bytes the request held at its largest, and a digest of the generated tokens (a configuration that
must not change the output, ``experts``, shows the same digest as ``vanilla``).  Then ``--batch-sizes`` concurrent requests at
``--batch-context`` give throughput (output tokens / wall time, prefill included), from a second load with
``--parallel`` set to the largest batch and the context to the batched requests' length.  Ratios are against the
``vanilla`` row of the same run.  Results: JSON, a Markdown table and PNG plots (matplotlib) under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DEFAULT_CONTEXTS = (512, 4096, 16384, 40960, 102400)
QUICK = {
    "contexts": (256, 1024, 2048),
    "decode_tokens": 24,
    "batch_sizes": (1, 4),
    "batch_context": 128,
    "configs": "vanilla,turbo",
}
FILLER = (
    "The river bends past the old mill, where the water slows and the light falls in long bands across "
    "the stones. Farmers bring grain in the autumn, and the wheel turns from dawn until the evening bell. "
)


# ----------------------------------------------------------------------------------------------- arguments
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="hub id, directory or .gguf (default: the bundled model)")
    p.add_argument("--backend", default="auto", help="auto, torch or mlx")
    p.add_argument(
        "--configs",
        default=None,
        help="comma-separated: vanilla, turbo (every preset), turbo:PRESET, experts, experts+turbo, "
        "experts+turbo:PRESET (default: vanilla,turbo and, for MoE models, experts,experts+turbo)",
    )
    p.add_argument(
        "--contexts",
        default=None,
        help="prompt lengths in tokens, comma-separated (default 512,4096,16384,40960,102400; capped by "
        "the model's context)",
    )
    p.add_argument("--decode-tokens", type=int, default=None, help="tokens decoded per request (default 128)")
    p.add_argument("--batch-sizes", default=None, help="concurrent requests for throughput (default 1,8,32)")
    p.add_argument("--batch-context", type=int, default=None, help="prompt tokens of the batched requests (512)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="a small matrix (contexts 256,1024,2048; 24 tokens; batches 1,4): minutes on a CPU",
    )
    p.add_argument("--out", default="bench_results", help="directory for the JSON, table and plots")
    p.add_argument("--name", default=None, help="file name stem (default: bench-<model>-<backend>-<date>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--compare",
        nargs=2,
        metavar=("A.json", "B.json"),
        default=None,
        help="draw two earlier runs side by side (table with B/A ratios and plots) instead of running",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra engine setting for every configuration, e.g. --set max_num_seqs=64 (repeatable)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one configuration may take")


def _ints(text: str | None, default: tuple[int, ...], what: str) -> list[int]:
    if text is None:
        return list(default)
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"swiftlm bench: --{what} takes comma-separated integers, got {text!r}") from None
    if not vals or min(vals) < 1:
        raise SystemExit(f"swiftlm bench: --{what} needs positive integers, got {text!r}")
    return vals


def expand_configs(text: str, is_moe: bool) -> list[dict[str, Any]]:
    """``vanilla,turbo,experts+turbo:k3v2`` -> one dict per configuration (name, turbo preset, experts)."""
    from ..turboquant.presets import NAMED_PRESETS, parse_turbo

    out: list[dict[str, Any]] = []
    for item in [x.strip() for x in text.split(",") if x.strip()]:
        experts = item.startswith("experts")
        rest = item[len("experts") :].lstrip("+") if experts else item
        if rest in ("", "vanilla"):
            if not experts and rest == "":
                raise SystemExit(f"swiftlm bench: unknown configuration {item!r}")
            out.append({"name": "experts" if experts else "vanilla", "turbo": None, "experts": experts})
            continue
        if rest != "turbo" and not rest.startswith("turbo:"):
            raise SystemExit(
                f"swiftlm bench: unknown configuration {item!r} (use vanilla, turbo, turbo:PRESET, "
                "experts, experts+turbo)"
            )
        presets = list(NAMED_PRESETS) if rest == "turbo" else [rest.split(":", 1)[1]]
        for preset in presets:
            try:
                parse_turbo(preset)
            except ValueError as e:
                raise SystemExit(f"swiftlm bench: {e}") from None
            name = ("experts+" if experts else "") + f"turbo:{preset}"
            out.append({"name": name, "turbo": preset, "experts": experts})
    if not out:
        raise SystemExit("swiftlm bench: --configs names no configuration")
    return out


def default_configs(is_moe: bool) -> str:
    return "vanilla,turbo,experts,experts+turbo" if is_moe else "vanilla,turbo"


def cap_contexts(contexts: list[int], model_ctx: int, decode: int) -> list[int]:
    """Contexts that fit the model (prompt + decoded tokens); a longer one becomes the largest that fits, once."""
    if not model_ctx:
        return sorted(set(contexts))
    limit = model_ctx - decode - 8
    if limit < 1:
        raise SystemExit(f"swiftlm bench: the model's context ({model_ctx}) is shorter than --decode-tokens {decode}")
    return sorted({min(c, limit) for c in contexts})


# ----------------------------------------------------------------------------------------------- the worker
def _reset_peaks(model: Any) -> None:
    try:  # Linux: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    model.reset_peak_memory()  # (ModelHooks: a no-op where the backend has no peak to reset)


def _prompt(tok_ids: list[int], n: int, offset: int = 0) -> list[int]:
    reps = n // len(tok_ids) + 2
    ids = (tok_ids * reps)[offset % len(tok_ids) :]
    return ids[:n]


def _digest(ids: list[int]) -> str:
    import hashlib

    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()[:12]


def _measure(llm: Any, ids: list[int], decode: int) -> dict[str, Any]:
    from ..memory import process_memory
    from ..sampling import SamplingParams

    model = llm.engine.model
    _reset_peaks(model)
    params = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    t_first = t_last = None
    n = 0
    out_ids: list[int] = []
    kv = {"bytes": 0, "fp16_bytes": 0}
    for delta in llm.stream(ids, params):
        if not delta.token_ids:
            continue
        now = time.perf_counter()
        if t_first is None:
            t_first = now
        t_last = now
        n += len(delta.token_ids)
        out_ids += delta.token_ids
        s = llm.engine.kv_stats()
        if s["bytes"] >= kv["bytes"]:
            kv = {"bytes": s["bytes"], "fp16_bytes": s["fp16_bytes"]}
    if t_first is None:
        raise RuntimeError("the request produced no tokens")
    mem = model.memory()
    row = {
        "context": len(ids),
        "tokens": n,
        "ttft_s": t_first - t0,
        "prefill_tps": len(ids) / (t_first - t0),
        "decode_tps": (n - 1) / (t_last - t_first) if n > 1 and t_last > t_first else None,
        "peak_rss_bytes": process_memory()["peak_rss"],
        "kv_bytes": kv["bytes"],
        "kv_fp16_bytes": kv["fp16_bytes"],
        "device": mem.get("device", "cpu"),
        "output_digest": _digest(out_ids),
    }
    if mem.get("device", "cpu") != "cpu":
        row["device_peak_bytes"] = int(mem.get("peak", 0))
    return row


def _throughput(llm: Any, base: list[int], context: int, batch: int, decode: int) -> dict[str, Any]:
    from ..sampling import SamplingParams

    prompts = [_prompt(base, context, offset=7 * i) for i in range(batch)]
    params = SamplingParams(max_tokens=decode, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.token_ids) for o in outs)
    return {
        "batch": batch,
        "context": context,
        "tokens": tokens,
        "wall_s": wall,
        "throughput_tps": tokens / wall,
        "output_digest": _digest([t for o in outs for t in o.token_ids]),
    }


def _load(spec: dict[str, Any], ctx_size: int, parallel: int) -> Any:
    from ..llm import LLM

    settings: dict[str, Any] = dict(spec.get("settings") or {})
    settings.setdefault("prompt_cache_bytes", 0)
    settings.setdefault("parallel", parallel)
    settings["ctx_size"] = ctx_size
    if spec["turbo"]:
        settings["turbo_kv"] = spec["turbo"]
    if spec["experts"]:
        settings["stream_experts"] = True
    return LLM(spec["model"], backend=spec["backend"], **settings)


def worker(spec: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """Load one configuration and measure it: yields one dict per measurement (the parent reads JSON lines).

    Two loads: the context sweep with one sequence slot as long as the longest context, then the batches with
    as many slots as the largest batch, each as long as a batched request (a CUDA slot pool of many
    full-length slots would not fit the device)."""
    from ..errors import SwiftLMError

    decode = spec["decode_tokens"]
    t0 = time.perf_counter()
    try:
        llm = _load(spec, max(spec["contexts"]) + decode + 16, 1)
    except (SwiftLMError, ValueError) as e:
        yield {"kind": "skipped", "reason": str(e).splitlines()[0]}
        return
    try:
        info = llm.engine.info
        mem = llm.engine.model.memory()
        yield {
            "kind": "loaded",
            "load_s": time.perf_counter() - t0,
            "backend": str(llm.backend_choice).split()[0],
            "backend_choice": str(llm.backend_choice),
            "device": mem.get("device", "cpu"),
            "device_name": mem.get("device_name", ""),
            "weights_bytes": info.weight_bytes,
            "kv_bytes_per_token": info.kv_bytes_per_token,
            "arch": info.arch,
            "params": info.num_params,
            "quantization": info.quantization,
        }
        base = llm.engine.text_prompt(FILLER)[:64] or [1, 2, 3]
        _measure(llm, _prompt(base, 16), 4)  # warm-up: first-step compilation and graph capture
        for ctx in spec["contexts"]:
            yield {"kind": "context", **_measure(llm, _prompt(base, ctx), decode)}
    finally:
        llm.close()
    if not spec["batch_sizes"]:
        return
    t0 = time.perf_counter()
    llm = _load(spec, spec["batch_context"] + decode + 16, max(spec["batch_sizes"]))
    try:
        load_s = time.perf_counter() - t0
        _throughput(llm, base, 16, min(spec["batch_sizes"]), 4)  # warm-up
        for b in spec["batch_sizes"]:
            yield {"kind": "batch", "load_s": load_s, **_throughput(llm, base, spec["batch_context"], b, decode)}
    finally:
        llm.close()


def _worker_main(arg: str) -> int:
    spec = json.loads(arg)
    try:
        for row in worker(spec):
            print(json.dumps(row), flush=True)
    except Exception as e:  # reported to the parent as one line, not a traceback in its table
        print(json.dumps({"kind": "error", "reason": f"{type(e).__name__}: {e}".splitlines()[0]}), flush=True)
        return 1
    return 0


# ----------------------------------------------------------------------------------------------- the parent
def _settings(pairs: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for p in pairs:
        if "=" not in p:
            raise SystemExit(f"swiftlm bench: --set takes KEY=VALUE, got {p!r}")
        k, v = p.split("=", 1)
        try:
            out[k.strip()] = json.loads(v)
        except ValueError:
            out[k.strip()] = v
    return out


def _run_config(
    spec: dict[str, Any], timeout: float, on_row: Any, cmd: list[str] | None = None
) -> list[dict[str, Any]]:
    """Run one configuration in a child process; a watchdog kills it at ``timeout`` seconds even in the middle of
    a measurement (a 100K-token prefill or a slow decode does not get to overrun the whole matrix)."""
    rows: list[dict[str, Any]] = []
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    cmd = cmd or [sys.executable, "-m", "swiftlm.bench.matrix", "--worker", json.dumps(spec)]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    timed_out = threading.Event()

    def _kill() -> None:
        timed_out.set()
        proc.kill()

    watchdog = threading.Timer(timeout, _kill)
    watchdog.daemon = True
    watchdog.start()
    # stderr is drained beside stdout: a chatty child must not block on a full pipe
    err_lines: list[str] = []
    drain = threading.Thread(target=lambda: err_lines.extend(proc.stderr or []), daemon=True)
    drain.start()
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.strip()
            if not line.startswith("{"):
                continue
            row = json.loads(line)
            rows.append(row)
            on_row(row)
    finally:
        watchdog.cancel()
    rc = proc.wait()
    drain.join(timeout=5)
    if timed_out.is_set():
        row = {"kind": "error", "reason": f"took longer than --timeout {timeout:g} s"}
        rows.append(row)
        on_row(row)
    elif rc != 0 and not any(r["kind"] in ("error", "skipped") for r in rows):
        tail = [ln.strip() for ln in err_lines if ln.strip()][-1:] or [f"exit code {rc}"]
        row = {"kind": "error", "reason": f"the worker failed: {tail[0]}"}
        rows.append(row)
        on_row(row)
    return rows


def run(args: argparse.Namespace) -> int:
    from . import report

    if args.compare:
        return report.compare(args.compare[0], args.compare[1], Path(args.out), plots=not args.no_plots)
    from ..registry import resolve

    spec = resolve(args.model)
    q = QUICK if args.quick else {}
    decode = args.decode_tokens or q.get("decode_tokens", 128)
    contexts = cap_contexts(
        _ints(args.contexts, q.get("contexts", DEFAULT_CONTEXTS), "contexts"), spec.context_length, decode
    )
    batches = _ints(args.batch_sizes, q.get("batch_sizes", (1, 8, 32)), "batch-sizes")
    bctx = args.batch_context or q.get("batch_context", 512)
    configs = expand_configs(args.configs or q.get("configs") or default_configs(spec.is_moe), spec.is_moe)
    if args.quick and args.configs is None and spec.is_moe:
        configs += expand_configs("experts", True)
    extra = _settings(args.set)
    meta = report.run_meta(
        spec,
        args,
        contexts=contexts,
        decode=decode,
        batches=batches,
        batch_context=bctx,
        configs=[c["name"] for c in configs],
        settings=extra,
    )
    results: list[dict[str, Any]] = []
    name = args.name
    t_start = time.perf_counter()
    with report.progress(len(configs) * (1 + len(contexts) + len(batches))) as advance:
        for cfg in configs:
            wspec = {
                "model": args.model,
                "backend": args.backend,
                "turbo": cfg["turbo"],
                "experts": cfg["experts"],
                "contexts": contexts,
                "decode_tokens": decode,
                "batch_sizes": batches,
                "batch_context": bctx,
                "settings": extra,
            }
            entry = {"config": cfg["name"], "turbo": cfg["turbo"], "experts": cfg["experts"], "rows": []}
            results.append(entry)

            def on_row(row: dict[str, Any], n: str = cfg["name"], entry: dict[str, Any] = entry) -> None:
                nonlocal name
                entry["rows"].append(row)
                advance(n, row)
                # every measurement is on disk at once: a matrix cut short keeps what it measured
                name = report.write(
                    {"meta": dict(meta, partial=True), "results": results}, Path(args.out), name, plots=False
                )[0].stem

            entry["rows"] = _run_config(wspec, args.timeout, on_row)
    meta["seconds"] = round(time.perf_counter() - t_start, 1)
    meta["partial"] = False
    doc = {"meta": meta, "results": results}
    paths = report.write(doc, Path(args.out), name, plots=not args.no_plots)
    print(report.markdown(doc))
    for p in paths:
        print(f"wrote {p}")
    failed = [r for r in results if any(x["kind"] == "error" for x in r["rows"])]
    return 1 if failed and len(failed) == len(results) else 0


if __name__ == "__main__":  # pragma: no cover - the child process of run()
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_worker_main(sys.argv[2]))
    sys.exit("usage: python -m swiftlm.bench.matrix --worker SPEC_JSON")
