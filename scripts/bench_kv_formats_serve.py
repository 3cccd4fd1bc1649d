#!/usr/bin/env python3
"""Time to first token and inter-token latency of each KV format through a real server, as ratios to 16-bit KV.

Per format a ``swiftlm serve`` is started (16-bit KV; ``--turbo-kv PRESET``; ``fp8``: ``--kv-cache-dtype fp8``;
``kv_bits`` is a request field, so its requests carry ``{"kv_bits": B}`` to a 16-bit server), ``swiftlm bench serve`` sends it random prompts of each
length as token ids (``--prompt-ids``: the server sees exactly that many tokens) one request at a time, and the
server is stopped.  ``--rounds R`` repeats the formats R times in turn (16-bit, k4v3, ..., 16-bit, k4v3, ...), so
that each format is measured next to its 16-bit baseline under the same background load; ``--one-server`` serves
every format from one 16-bit server, chosen per request (``turbo_kv`` / ``kv_bits``), so that they alternate
request by request.  The table shows TTFT
(p50), ITL (p50, p99) and decode (16-bit ITL p50 / the format's) per length: times are medians over the rounds,
ratios the median of each round's ratio to that round's 16-bit run.  The JSON goes to
``docs/results/kv_formats_serve_<tag>.json``.

    # this CPU, the bundled model
    python scripts/bench_kv_formats_serve.py --prompt-tokens 4000 --rounds 2
    # a GPU, an 8B-shaped random checkpoint
    python scripts/bench_kv_formats_serve.py --model /dev/shm/m8b --device cuda --tag h100 \\
        --prompt-tokens 8000,32000,131072

``--streams N`` also sends N requests of the longest length at once to the same server (``--parallel N``) and
reports the inter-token latency while all N streams decode together (``steady_itl``: the gaps of every stream
between the last stream's first token and the first stream's last one; the streams that started first emit their
tokens during the others' prompt passes, which the plain ITL percentiles mix in): ``--streams-output-tokens`` must
be long enough for the streams to overlap.  ``--step-log`` keeps each server's per-step timeline
(``SWIFTLM_STEP_LOG``) in ``--logs``.

Acceptance (printed, and the exit status with ``--check``): every compressed format (TurboQuant presets and
``kv_bits``) within ``--max-ttft-ratio`` of 16-bit TTFT and at least ``--min-decode-ratio`` of its decode rate
(16-bit ITL p50 / the format's; with ``--streams``, also of the steady ITL of the concurrent streams).  The FP8
KV cache has its own bar (``ACCEPTANCE``: TTFT <= 1.1x, decode >= 1.2x of 16-bit at 32K, issue 50).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FORMATS = {  # name -> (server flags, request fields)
    "16bit": ([], {}),
    "k4v3": (["--turbo-kv", "k4v3"], {}),
    "k3v2": (["--turbo-kv", "k3v2"], {}),
    "k3qjl-v3": (["--turbo-kv", "k3qjl-v3"], {}),
    "kv8": ([], {"kv_bits": 8}),
    "kv4": ([], {"kv_bits": 4}),
    "fp8": (["--kv-cache-dtype", "fp8"], {}),  # a server setting only: its own server, even with --one-server
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``swiftlm serve`` in a subprocess on a loopback port, up once it prints its ready line."""

    def __init__(self, args: argparse.Namespace, flags: list[str], log: Path):
        self.port = free_port()
        cmd = [sys.executable, "-m", "swiftlm.cli", "serve", "--port", str(self.port), "--log-level", "warning"]
        if args.model:
            cmd += ["--model", args.model]
        cmd += ["--backend", args.backend, "--parallel", str(args.streams), "--prompt-cache-bytes", "0", *flags]
        # a prompt of token ids is one JSON list: the server's cap on list items must hold the longest
        cmd += ["--max-json-items", str(max(8192, max(args.prompt_tokens) + 64))]
        if not any(a.startswith("--ctx-size") for a in args.serve_arg):  # room for the longest prompt and its output
            out_max = max(args.output_tokens, args.streams_output_tokens if args.streams > 1 else 0)
            cmd += ["--ctx-size", str(max(args.prompt_tokens) + out_max + 256)]
        if args.device:
            cmd += ["--device", args.device]
        cmd += args.serve_arg
        self.log = log
        self.out = open(log, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if args.step_log:  # one line per engine step ({pid}: the engine's process, a child on CUDA)
            env["SWIFTLM_STEP_LOG"] = str(log.with_suffix("")) + "_steps_{pid}.jsonl"
        # run outside the checkout: there ``python -m swiftlm`` would import the source tree by its path
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.out, text=True, env=env, cwd=log.parent)
        ready = threading.Event()

        def read() -> None:
            for line in self.proc.stdout:
                self.out.write(line)
                if line.startswith("{") and '"ready"' in line:
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        deadline = time.time() + args.load_timeout
        while not ready.wait(0.5):
            if time.time() > deadline:
                break
        if self.proc.poll() is not None or not ready.is_set():
            self.stop()
            raise RuntimeError(f"the server did not come up ({' '.join(cmd)}); see {log}")
        self.base = f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.out.close()


def bench(
    args: argparse.Namespace, srv: Server, fields: dict, out: Path, streams: int = 1, lengths: list[int] | None = None
) -> list[dict]:
    """``swiftlm bench serve`` against ``srv`` (``streams`` requests at once, each length; default: one at a time,
    ``--prompt-tokens``): the per-length summaries (``swiftlm.bench.lengths``), with ``steady_itl`` added."""
    lengths = lengths or args.prompt_tokens
    n_req = args.num_requests if streams == 1 else streams
    out_tokens = args.output_tokens if streams == 1 else args.streams_output_tokens
    cmd = [
        sys.executable,
        "-m",
        "swiftlm.cli",
        "bench",
        "serve",
        "--base-url",
        srv.base,
        "--endpoint",
        "completions",
        "--prompt-ids",
        "--prompt-tokens",
        ",".join(str(n) for n in lengths),
        "--num-requests",
        str(n_req),
        "--concurrency",
        str(streams),
        "--output-tokens",
        str(out_tokens),
        "--ignore-eos",
        "--temperature",
        "0",
        "--warmup",
        str(args.warmup),
        "--warmup-prompt-tokens",
        str(args.warmup_prompt_tokens),
        "--timeout",
        str(args.timeout),
        "--no-progress",
        "--json",
        str(out),
    ]
    if args.tokenizer or args.model:
        cmd += ["--tokenizer", args.tokenizer or args.model]
    if fields:
        cmd += ["--extra-body", json.dumps(fields)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=out.parent)
    if r.returncode != 0 or not out.exists():
        raise RuntimeError(f"bench serve failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-2000:]}")
    return summaries(json.loads(out.read_text()))


def summaries(doc: dict) -> list[dict]:
    """Per-length summary rows of a ``bench serve --json`` document (one length or several), each with
    ``steady_itl_ms_p50`` (``steady_itl``) and the number of its samples."""
    from swiftlm.bench.lengths import summary_row
    from swiftlm.bench.metrics import RequestRecord

    if "lengths" in doc:
        parts = [(x["summary"], x["requests"]) for x in doc["lengths"]]
    else:
        recs = [RequestRecord.from_json(r) for r in doc["requests"]]
        parts = [(summary_row(doc["config"]["prompt_tokens"], doc["results"], recs), doc["requests"])]
    out = []
    for row, reqs in parts:
        gaps = steady_itl(reqs)
        out.append({**row, "steady_itl_ms_p50": statistics.median(gaps) if gaps else None, "steady_itl_n": len(gaps)})
    return out


def steady_itl(requests: list[dict]) -> list[float]:
    """Inter-token gaps (ms) of the successful requests inside the window where every one of them is streaming:
    from the last first token to the first last token (a gap counts when both its ends are inside)."""
    ok = [r for r in requests if r["ok"] and len(r["chunk_ms"]) > 1]
    if not ok:
        return []
    times = [[r["send_s"] * 1e3 + c for c in r["chunk_ms"]] for r in ok]
    lo, hi = max(t[0] for t in times), min(t[-1] for t in times)
    return [b - a for t in times for a, b in zip(t, t[1:]) if a >= lo and b <= hi]


def median_rows(runs: list[list[dict]]) -> list[dict]:
    """Each number's median over the rounds of one format (rows matched by prompt length)."""
    out = []
    for i, row in enumerate(runs[0]):
        m = dict(row)
        for k, v in row.items():
            vals = [r[i][k] for r in runs if r[i][k] is not None]
            if isinstance(v, float) and vals:
                m[k] = statistics.median(vals)
        m["rounds"] = len(runs)
        out.append(m)
    return out


def round_ratios(runs: dict[str, list[list[dict]]]) -> dict[str, list[dict]]:
    """The median over rounds of each round's ``ratios`` (a slow or fast round of the baseline moves that round's
    ratios only)."""
    per = [ratios({name: rs[k] for name, rs in runs.items()}) for k in range(len(runs["16bit"]))]
    out: dict[str, list[dict]] = {}
    for name in runs:
        out[name] = []
        for i, row in enumerate(per[0][name]):
            m = dict(row)
            for key in ("ttft", "itl_p50", "itl_p99", "decode", "steady_decode"):
                vals = [p[name][i][key] for p in per if p[name][i][key] is not None]
                m[key] = statistics.median(vals) if vals else None
            out[name].append(m)
    return out


def ratios(rows: dict[str, list[dict]]) -> dict[str, list[dict]]:
    """Per format and length: TTFT, ITL p50 / p99 as ratios to 16-bit, and decode = 16-bit ITL p50 / the format's."""
    base = rows["16bit"]
    out: dict[str, list[dict]] = {}
    for name, rs in rows.items():
        out[name] = []
        for r, b in zip(rs, base):

            def q(x, y):
                return None if not x or not y else x / y

            out[name].append(
                {
                    "prompt_tokens": r["prompt_tokens"],
                    "ttft": q(r["ttft_ms_p50"], b["ttft_ms_p50"]),
                    "itl_p50": q(r["itl_ms_p50"], b["itl_ms_p50"]),
                    "itl_p99": q(r["itl_ms_p99"], b["itl_ms_p99"]),
                    "decode": q(b["itl_ms_p50"], r["itl_ms_p50"]),
                    "steady_decode": q(b.get("steady_itl_ms_p50"), r.get("steady_itl_ms_p50")),
                }
            )
    return out


def device_tag(args: argparse.Namespace) -> str:
    """--tag, else "cpu", or the GPU's model ("NVIDIA H100 80GB HBM3" -> "h100") where the server runs on one."""
    if args.tag:
        return args.tag
    if (args.device or "cuda").startswith("cuda"):
        try:
            import torch

            if torch.cuda.is_available():
                words = torch.cuda.get_device_name(0).lower().replace("-", " ").split()
                return next((w for w in words if w[:1].isalpha() and w[1:2].isdigit()), "cuda")
        except ImportError:
            pass
    return "cpu"


ACCEPTANCE = {"fp8": (1.1, 1.2)}  # format -> (max TTFT ratio, min decode ratio) where it differs from the flags


def acceptance(name: str, args: argparse.Namespace) -> tuple[float, float]:
    """(max TTFT ratio, min decode ratio) for format ``name``: its own (``ACCEPTANCE``), else the flags'."""
    own = ACCEPTANCE.get(name)
    return own if own is not None else (args.max_ttft_ratio, args.min_decode_ratio)


def print_table(rows: dict[str, list[dict]], rat: dict[str, list[dict]], args: argparse.Namespace) -> bool:
    """The table; True when every compressed format meets the acceptance ratios (rows of one stream: TTFT and
    decode; rows of ``--streams``: the decode of the concurrent streams, ``steady_decode``)."""
    ok = True
    head = f"{'format':<10}{'prompt':>8}{'streams':>8}{'TTFT ms':>11}{'x':>7}{'ITL p50':>10}{'x':>7}{'ITL p99':>10}"
    print(head + f"{'x':>7}{'steady':>9}{'decode x':>10}  check")

    def f(v, d=2):
        return "-" if v is None else f"{v:.{d}f}"

    for name, rs in rows.items():
        max_ttft, min_decode = acceptance(name, args)
        for r, x in zip(rs, rat[name]):
            many = r.get("streams", 1) > 1
            decode = x["steady_decode"] if many else x["decode"]
            verdict = ""
            if name != "16bit" and decode is not None and (many or x["ttft"] is not None):
                good = decode >= min_decode and (many or x["ttft"] <= max_ttft)
                ok &= good
                verdict = "ok" if good else "FAIL"
            print(
                f"{name:<10}{r['prompt_tokens']:>8}{r.get('streams', 1):>8}{f(r['ttft_ms_p50'], 0):>11}"
                f"{f(x['ttft']):>7}{f(r['itl_ms_p50']):>10}{f(x['itl_p50']):>7}{f(r['itl_ms_p99']):>10}"
                f"{f(x['itl_p99']):>7}{f(r.get('steady_itl_ms_p50')):>9}{f(decode):>10}  {verdict}"
            )
    return ok


def request_fields(name: str) -> dict:
    """The request fields that choose format ``name`` on a 16-bit server (``--one-server``)."""
    flags, fields = FORMATS[name]
    return {"turbo_kv": flags[1]} if flags else dict(fields)


def _measure(args: argparse.Namespace, name: str, tmp: Path, rnd: int, shared: Server | None) -> list[dict]:
    """One round of format ``name``: its own server (``--turbo-kv`` for a preset), or requests to the shared one."""
    flags, fields = FORMATS[name]
    if flags[:1] == ["--kv-cache-dtype"]:  # not a request field: a server of its own
        shared = None
    srv = shared or Server(args, flags, tmp / f"serve_{name}_{rnd}.log")
    if shared is not None:
        fields = request_fields(name)
    try:
        rs = [{**r, "streams": 1} for r in bench(args, srv, fields, tmp / f"{name}_{rnd}.json")]
        if args.streams > 1:
            out = tmp / f"{name}_{rnd}_x{args.streams}.json"
            longest = [max(args.prompt_tokens)]
            rs += [{**r, "streams": args.streams} for r in bench(args, srv, fields, out, args.streams, longest)]
        return rs
    finally:
        if shared is None:
            srv.stop()


def main() -> int:
    from swiftlm.bench.lengths import parse_lengths

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="model served (default: the bundled SmolLM2)")
    ap.add_argument("--backend", default="torch", help="serve --backend (default torch)")
    ap.add_argument("--device", default=None, help="serve --device, e.g. cpu or cuda (default: the server's choice)")
    ap.add_argument("--tokenizer", default=None, help="bench serve --tokenizer (default: --model, else bundled)")
    ap.add_argument("--formats", default="16bit,k4v3,k3v2,kv8,kv4,fp8", help=f"of {', '.join(FORMATS)}")
    ap.add_argument("--prompt-tokens", type=parse_lengths, default=[4000], help="prompt length(s), e.g. 8000,32000")
    ap.add_argument("--output-tokens", type=int, default=128, help="tokens streamed per request (default 128)")
    ap.add_argument("--num-requests", type=int, default=1, help="measured requests per length (default 1)")
    ap.add_argument("--warmup", type=int, default=1, help="warmup requests per length (default 1)")
    ap.add_argument("--warmup-prompt-tokens", type=int, default=1024, help="their prompt length (default 1024)")
    ap.add_argument("--rounds", type=int, default=1, help="times the formats run, in turn (median taken)")
    ap.add_argument("--serve-arg", action="append", default=[], help="extra serve flag (repeatable; --serve-arg=--x)")
    ap.add_argument("--timeout", type=float, default=3600.0, help="per-request timeout in seconds")
    ap.add_argument("--load-timeout", type=float, default=600.0, help="seconds a server may take to come up")
    ap.add_argument("--tag", default=None, help="device tag of the JSON name (default: cpu, or the GPU, e.g. h100)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "results"), help="directory of the JSON")
    ap.add_argument("--logs", default=None, help="keep the servers' logs and bench JSON here (default: discarded)")
    ap.add_argument("--max-ttft-ratio", type=float, default=1.3, help="compressed formats (fp8: ACCEPTANCE, 1.1)")
    ap.add_argument("--min-decode-ratio", type=float, default=0.9, help="compressed formats (fp8: ACCEPTANCE, 1.2)")
    ap.add_argument("--check", action="store_true", help="exit 1 when a compressed format misses the ratios")
    ap.add_argument("--streams", type=int, default=1, help="also N concurrent requests of the longest length")
    ap.add_argument("--streams-output-tokens", type=int, default=768, help="their output tokens (default 768)")
    ap.add_argument("--step-log", action="store_true", help="keep each server's SWIFTLM_STEP_LOG in --logs")
    ap.add_argument("--note", default="", help="free text kept in the JSON (e.g. what else ran on the machine)")
    ap.add_argument(
        "--one-server",
        action="store_true",
        help="one 16-bit server for every format, chosen per request (turbo_kv / kv_bits fields): formats alternate "
        "request by request, so a busy machine's load falls on each alike (CPU; on CUDA --turbo-kv's code pages "
        "are the server default's only)",
    )
    args = ap.parse_args()
    for k in ("model", "tokenizer"):  # the servers run in a scratch directory: paths made absolute
        v = getattr(args, k)
        if v and Path(v).expanduser().exists():
            setattr(args, k, str(Path(v).expanduser().resolve()))
    names = [n.strip() for n in args.formats.split(",") if n.strip()]
    bad = [n for n in names if n not in FORMATS]
    if bad or "16bit" not in names:
        ap.error(f"--formats: unknown {bad}" if bad else "--formats must include 16bit (the baseline)")
    names = ["16bit"] + [n for n in names if n != "16bit"]
    tag = device_tag(args)
    runs: dict[str, list[list[dict]]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory() as scratch:
        tmp = args.logs or scratch
        Path(tmp).mkdir(parents=True, exist_ok=True)
        shared = Server(args, [], Path(tmp) / "serve_shared.log") if args.one_server else None
        try:
            for rnd in range(args.rounds):
                for name in names:
                    t0 = time.time()
                    runs[name].append(_measure(args, name, Path(tmp), rnd, shared))
                    r0 = runs[name][-1][0]
                    print(
                        f"[round {rnd + 1}/{args.rounds}] {name}: TTFT {r0['ttft_ms_p50']:.0f} ms, "
                        f"ITL p50 {r0['itl_ms_p50']:.2f} ms ({time.time() - t0:.0f} s)",
                        file=sys.stderr,
                    )
        finally:
            if shared is not None:
                shared.stop()
    rows = {n: median_rows(rs) for n, rs in runs.items()}
    rat = round_ratios(runs)
    ok = print_table(rows, rat, args)
    doc = {
        "config": {
            "model": args.model or "bundled smollm2-135m-instruct",
            "backend": args.backend,
            "device": args.device,
            "tag": tag,
            "formats": {n: {"serve_flags": FORMATS[n][0], "request_fields": FORMATS[n][1]} for n in names},
            "prompt_tokens": args.prompt_tokens,
            "output_tokens": args.output_tokens,
            "num_requests": args.num_requests,
            "warmup": args.warmup,
            "warmup_prompt_tokens": args.warmup_prompt_tokens,
            "rounds": args.rounds,
            "streams": args.streams,
            "streams_output_tokens": args.streams_output_tokens if args.streams > 1 else None,
            "serve_args": args.serve_arg,
            "one_server": args.one_server,
            "note": args.note,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
            "host": {"hostname": platform.node(), "platform": platform.platform(), "cpu_count": os.cpu_count()},
            "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "acceptance": {"max_ttft_ratio": args.max_ttft_ratio, "min_decode_ratio": args.min_decode_ratio},
            "acceptance_per_format": {n: acceptance(n, args) for n in names if n in ACCEPTANCE},
        },
        "rows": rows,
        "ratios": rat,
        "rounds": runs,
        "accepted": ok,
    }
    out = Path(args.out) / f"kv_formats_serve_{tag}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0 if ok or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
