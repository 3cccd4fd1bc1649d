"""``swiftlm bench serve``: a load generator for any OpenAI-compatible server.

Every request is streamed (``stream: true``, ``stream_options: {"include_usage": true}``) over one
``httpx.AsyncClient`` (HTTP/1.1, a connection pool as large as the concurrency).  Requests are sent either by
``--concurrency N`` workers (each sends its next request when the previous one finishes) or at ``--request-rate
R`` requests/s with Poisson arrivals (exponential gaps, seeded; ``--concurrency`` then caps the requests in
flight).  ``--workers K`` runs K processes, each with a share of the concurrency (or the rate) and of the
requests; their records are merged before the statistics are taken.  ``--prompt-tokens 8000,32000,131072`` runs
the whole benchmark once per prompt length and reports TTFT and inter-token latency per length (``lengths.py``);
``--prompt-ids`` sends random prompts as token ids so that the server sees exactly that many tokens.  The HTTP
client and the worker processes live in ``client.py``.

How each number is measured (times from ``time.perf_counter``; a request's clock starts just before its
HTTP request is written):

* **TTFT** (time to first token): until the first SSE chunk whose delta carries content (``content``,
  ``reasoning_content``/``reasoning`` or ``tool_calls``; ``text`` on ``/v1/completions``).  Role-only and
  usage-only chunks do not count.  A chunk's time is when its bytes were read; chunks read in one socket read
  share a time.
* **Output tokens**: ``usage.completion_tokens`` of the final chunk when the server sends usage, else the
  number of content chunks.
* **ITL** (inter-token latency): the gaps between consecutive content chunks, spread over the tokens they
  carry.  When the token count N equals the chunk count C, the ITL samples are simply the C-1 gaps.  When they
  differ (a server that sends several tokens per chunk, or splits one token over several chunks), the N tokens
  are spread evenly over the chunks (chunk i ends at cumulative token ``max(1, floor((i+1)*N/C))``, so the
  first chunk carries at least the first token) and a gap followed by a chunk of k tokens gives k samples of
  gap/k (a gap before a chunk of 0 tokens is carried into the next one).  Either way a request's ITL samples
  sum to (last chunk - first chunk) and there are N - (tokens of the first chunk) of them.  Percentiles are
  taken over the samples of all successful requests together.
* **TPOT** (time per output token, per request): the same (last chunk - first chunk) / number of ITL samples;
  a request's **stream tok/s** is its inverse (the decode rate a user sees, prefill excluded), and
  ``mean_stream_tok_s`` is the mean over requests.
* **E2E**: from the request's send to the end of its stream (``[DONE]`` or the connection closing).
* **Duration**: from the first request sent to the last request finished (warmup excluded); **output tok/s**
  = total output tokens of successful requests / duration; **request/s** = successful requests / duration.
* A request **fails** on a connect/read error, a non-200 status, an ``error`` object in the stream, or a
  stream with no content chunk.
* Percentiles: linear interpolation between the two nearest ranks (numpy's default method).

``--json PATH`` writes ``{"config": {...}, "results": {...}, "requests": [...]}``; the fields of ``results``:
``requests_ok, requests_failed, duration_s, request_throughput, output_throughput, total_output_tokens,
total_prompt_tokens, mean_stream_tok_s, ttft_ms, itl_ms, tpot_ms, e2e_ms`` (each ``*_ms`` a dict ``mean, p50,
p90, p99, min, max, n``) and ``errors`` (error text -> count); each request record: ``index, ok, error,
send_s, ttft_ms, e2e_ms, output_tokens, prompt_tokens, usage_reported, content_chunks, max_tokens, chunk_ms``
(content-chunk arrival times from the send, ms), ``tpot_ms, stream_tok_s``.  With several prompt lengths,
``--json`` and ``--results NAME`` write the per-length document of ``lengths.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import random
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..errors import SwiftLMError
from .client import (  # noqa: F401  (some re-exported: tests take them from here)
    ClientConfig,
    Workload,
    discover_model,
    normalize_base_url,
    run_requests,
    run_workers,
)
from .lengths import document, parse_lengths, print_lengths, results_path, single_length, summary_row, write_json
from .metrics import (  # noqa: F401  (some re-exported: tests take them from here)
    PERCENTILES,
    RequestRecord,
    chunk_content,
    chunk_token_counts,
    describe,
    itl_samples,
    merge_parts,
    parse_sse_line,
    percentile,
    poisson_arrivals,
    random_prompt,
    sample_lengths,
    split_share,
    summarize,
    tpot,
)


def load_tokenizer(spec: str | None) -> Any:
    """``--tokenizer``: an HF directory or its tokenizer.json, a .gguf file, a model name swiftlm resolves
    (HF cache, bundled), or None for the bundled SmolLM2's tokenizer (built from its GGUF metadata).  The EOS ids
    of an HF directory are those of its tokenizer_config, config.json and generation_config.json together."""
    from ..registry import resolve
    from ..tokenizer import load_gguf_tokenizer, load_hf_tokenizer

    p = Path(spec).expanduser() if spec else None
    if p is not None and p.is_file() and p.suffix == ".json":
        p = p.parent
    if p is None or not p.is_dir():
        s = resolve(spec, allow_download=False)
        if s.format == "gguf":
            return load_gguf_tokenizer(s.gguf_meta or {})
        p = Path(s.path)
    eos: list[int] = []
    for name in ("config.json", "generation_config.json"):
        f = p / name
        if f.exists():
            e = json.loads(f.read_text()).get("eos_token_id")
            eos += [e] if isinstance(e, int) else list(e or [])
    return load_hf_tokenizer(p, {"eos_token_id": sorted(set(eos))} if eos else None)


def build_workload(args: argparse.Namespace, tokenizer: Any, prompt_tokens: int | None = None) -> list[Workload]:
    """The measured requests plus ``args.warmup`` warmup requests in front (indices -K..-1), seeded.  Random
    prompts are ``prompt_tokens`` long (default: ``args.prompt_tokens``, one length); warmup ones
    ``args.warmup_prompt_tokens`` when set.  ``args.prompt_ids``: each prompt is sent as token ids
    (``/v1/completions``), so that the server sees exactly that many tokens."""
    rng = random.Random(args.seed)
    total = args.num_requests + args.warmup
    outs = sample_lengths(rng, args.output_tokens, args.output_tokens_std, total)
    items: list[Workload] = []
    if args.dataset:
        rows = []
        with open(args.dataset) as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    d = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise SwiftLMError(f"{args.dataset} line {lineno} is not JSON: {exc}") from None
                if not isinstance(d, dict) or not ("prompt" in d or "messages" in d):
                    raise SwiftLMError(f"{args.dataset} line {lineno} needs a 'prompt' or 'messages' field")
                rows.append((lineno, d))
        if not rows:
            raise SwiftLMError(f"{args.dataset} has no prompts")
        for i in range(total):
            lineno, d = rows[i % len(rows)]
            if args.endpoint == "chat":
                payload = (
                    {"messages": d["messages"]}
                    if "messages" in d
                    else {"messages": [{"role": "user", "content": d["prompt"]}]}
                )
            elif "prompt" in d:
                payload = {"prompt": d["prompt"]}
            else:
                raise SwiftLMError(f"{args.dataset} line {lineno} has 'messages'; use --endpoint chat for it")
            items.append(Workload(i - args.warmup, payload, int(d.get("max_tokens") or outs[i])))
        return items
    special = set(getattr(tokenizer, "special_ids", set()) or ())
    allowed = [i for i in range(tokenizer.vocab_size) if i not in special]
    n = single_length(args.prompt_tokens) if prompt_tokens is None else prompt_tokens
    ins = sample_lengths(rng, n, args.prompt_tokens_std, total)
    warm_n = getattr(args, "warmup_prompt_tokens", None)
    if warm_n:
        ins[: args.warmup] = [warm_n] * args.warmup
    for i in range(total):
        if getattr(args, "prompt_ids", False):  # random ids, not text: no re-tokenization can change the count
            payload: dict[str, Any] = {"prompt": [rng.choice(allowed) for _ in range(ins[i])]}
        else:
            text = random_prompt(tokenizer.encode, tokenizer.decode, allowed, ins[i], rng)
            payload = {"messages": [{"role": "user", "content": text}]} if args.endpoint == "chat" else {"prompt": text}
        items.append(Workload(i - args.warmup, payload, outs[i]))
    return items


# =========================================================================== CLI
def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--base-url", required=True, help="server address, e.g. http://127.0.0.1:8080 (a trailing /v1 is accepted)"
    )
    p.add_argument(
        "--model", default=None, help="model name sent in each request (default: the first id of GET /v1/models)"
    )
    p.add_argument(
        "--api-key", default=os.environ.get("OPENAI_API_KEY"), help="bearer token (default: $OPENAI_API_KEY)"
    )
    p.add_argument(
        "--endpoint",
        choices=("chat", "completions"),
        default="chat",
        help="/v1/chat/completions (prompt as one user message) or /v1/completions (raw prompt)",
    )
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight (with --request-rate: the cap)")
    p.add_argument("--request-rate", type=float, default=None, help="requests per second, Poisson arrivals")
    p.add_argument("--num-requests", type=int, default=64, help="measured requests (default 64)")
    p.add_argument("--warmup", type=int, default=0, help="requests sent first and not measured (default 0)")
    p.add_argument(
        "--prompt-tokens",
        type=parse_lengths,
        default="40",  # parsed like the flag's value: [40]
        help="random prompt length in tokens (mean); a comma-separated list (8000,32000,131072) runs the "
        "benchmark once per length and prints TTFT and inter-token latency per length",
    )
    p.add_argument(
        "--prompt-ids",
        action="store_true",
        help="send each random prompt as token ids (needs --endpoint completions): the server sees exactly "
        "--prompt-tokens tokens, where text would be re-tokenized (and a chat template adds its own); a prompt "
        "longer than 8192 tokens needs the server's --max-json-items raised",
    )
    p.add_argument(
        "--warmup-prompt-tokens",
        type=int,
        default=None,
        help="prompt length of the --warmup requests (default: the measured length)",
    )
    p.add_argument("--prompt-tokens-std", type=float, default=0.0, help="standard deviation of the prompt length")
    p.add_argument("--output-tokens", type=int, default=128, help="max_tokens of each request (mean)")
    p.add_argument("--output-tokens-std", type=float, default=0.0, help="standard deviation of max_tokens")
    p.add_argument(
        "--dataset",
        default=None,
        help='JSONL prompts instead of random ones: {"prompt": str} or '
        '{"messages": [...]} per line, optional "max_tokens" (used in order, repeated as needed)',
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer for random prompts and EOS ids: an HF directory or "
        "tokenizer.json, a .gguf, a model name (default: the bundled SmolLM2's); it should match the "
        "served model",
    )
    p.add_argument(
        "--ignore-eos",
        action="store_true",
        help='generate max_tokens tokens: sends "ignore_eos": true '
        "and a logit_bias of -100 on the tokenizer's EOS ids (each switchable below)",
    )
    p.add_argument(
        "--ignore-eos-field",
        action=argparse.BooleanOptionalAction,
        default=None,
        help='send "ignore_eos": true (default: on with --ignore-eos; servers with strict request '
        "schemas may reject it)",
    )
    p.add_argument(
        "--ban-eos-bias",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="send logit_bias -100 on the EOS ids, for servers without ignore_eos (default: on with --ignore-eos)",
    )
    p.add_argument("--temperature", type=float, default=0.6, help="sampling temperature (default 0.6)")
    p.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (default 0)")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request read timeout in seconds")
    p.add_argument("--workers", type=int, default=1, help="client processes sharing the load (default 1)")
    p.add_argument("--json", default=None, metavar="PATH", help="write config, results and per-request records")
    p.add_argument(
        "--results",
        default=None,
        metavar="NAME",
        help="also write the run, per prompt length, to RESULTS_DIR/NAME.json (a stable name for result pages)",
    )
    p.add_argument("--results-dir", default="docs/results", help="directory of --results (default docs/results)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--label", default=None, help="free text stored in the JSON config (e.g. the server's name)")


def _host() -> dict[str, Any]:
    return {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
    }


def _check(args: argparse.Namespace) -> list[int]:
    """Refuse inconsistent options; the prompt lengths to run."""
    if args.concurrency is None and args.request_rate is None:
        raise SwiftLMError("give --concurrency N or --request-rate R")
    for name in ("concurrency", "num_requests", "workers"):
        v = getattr(args, name)
        if v is not None and v < 1:
            raise SwiftLMError(f"--{name.replace('_', '-')} must be at least 1")
    if args.request_rate is not None and args.request_rate <= 0:
        raise SwiftLMError("--request-rate must be positive")
    lengths = parse_lengths(args.prompt_tokens) if not isinstance(args.prompt_tokens, list) else args.prompt_tokens
    if args.warmup < 0 or min(lengths) < 1 or args.output_tokens < 1 or (args.warmup_prompt_tokens or 1) < 1:
        raise SwiftLMError("--warmup must be >= 0 and --prompt-tokens / --output-tokens >= 1")
    if args.concurrency and args.workers > args.concurrency:
        raise SwiftLMError("--workers cannot exceed --concurrency")
    if args.dataset and len(lengths) > 1:
        raise SwiftLMError("several --prompt-tokens lengths need random prompts, not --dataset")
    if args.prompt_ids and (args.dataset or args.endpoint != "completions"):
        raise SwiftLMError("--prompt-ids sends random token ids to /v1/completions: use --endpoint completions")
    if args.results:
        try:
            results_path(args.results_dir, args.results)
        except ValueError as exc:
            raise SwiftLMError(str(exc)) from None
    return lengths


def run(args: argparse.Namespace) -> int:
    lengths = _check(args)
    extra = {}
    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
        except json.JSONDecodeError as exc:
            raise SwiftLMError(f"--extra-body is not JSON: {exc}") from None
        if not isinstance(extra, dict):
            raise SwiftLMError("--extra-body must be a JSON object")
    ban = args.ignore_eos if args.ban_eos_bias is None else args.ban_eos_bias
    send_field = args.ignore_eos if args.ignore_eos_field is None else args.ignore_eos_field

    from rich.console import Console

    err = Console(stderr=True)
    tokenizer = None
    if ban or not args.dataset:
        tokenizer = load_tokenizer(args.tokenizer)
    eos_ids = sorted(int(i) for i in tokenizer.eos_token_ids) if (ban and tokenizer is not None) else []
    if ban and not eos_ids:
        err.print("[yellow]warning:[/] the tokenizer names no EOS token; no logit_bias is sent")
    base = normalize_base_url(args.base_url)
    model = args.model or asyncio.run(discover_model(base, args.api_key))
    cfg = ClientConfig(
        base_url=base,
        model=model,
        endpoint=args.endpoint,
        api_key=args.api_key,
        temperature=args.temperature,
        ignore_eos_field=send_field,
        eos_bias_ids=eos_ids,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        timeout=args.timeout,
        seed=args.seed,
        extra_body=extra,
    )
    runs = []
    for n in lengths:
        if len(lengths) > 1:
            err.print(f"[bold]prompt length {n:,} tokens")
        records = _run_length(args, cfg, build_workload(args, tokenizer, n), err)
        runs.append((n, summarize(records), records))
    config = {
        "base_url": base,
        "model": model,
        "endpoint": args.endpoint,
        "label": args.label,
        "concurrency": args.concurrency,
        "request_rate": args.request_rate,
        "num_requests": args.num_requests,
        "warmup": args.warmup,
        "warmup_prompt_tokens": args.warmup_prompt_tokens,
        "workers": args.workers,
        "prompt_tokens": lengths[0] if len(lengths) == 1 else lengths,
        "prompt_tokens_std": args.prompt_tokens_std,
        "prompt_ids": args.prompt_ids,
        "output_tokens": args.output_tokens,
        "output_tokens_std": args.output_tokens_std,
        "dataset": args.dataset,
        "tokenizer": args.tokenizer or "bundled smollm2-135m-instruct",
        "ignore_eos": args.ignore_eos,
        "ignore_eos_field": send_field,
        "ban_eos_bias": ban,
        "eos_ids": eos_ids,
        "temperature": args.temperature,
        "seed": args.seed,
        "extra_body": extra,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "swiftlm_version": _version(),
        "host": _host(),
    }
    if len(runs) == 1:
        print_report(config, runs[0][1])
    else:
        print_lengths(config, [summary_row(n, res, recs) for n, res, recs in runs])
    if args.json:  # one length: the one-run document; several: the per-length one of --results
        _, res, recs = runs[0]
        one = {"config": config, "results": res, "requests": [r.to_json() for r in recs]}
        write_json(args.json, one if len(runs) == 1 else document(config, runs))
    if args.results:
        out = write_json(results_path(args.results_dir, args.results), document(config, runs))
        err.print(f"wrote {out}")
    return 0 if all(res["requests_ok"] > 0 for _, res, _ in runs) else 1


def _run_length(args: argparse.Namespace, cfg: ClientConfig, work: list[Workload], err: Any) -> list[RequestRecord]:
    """The warmup requests of one prompt length (not measured), then its measured ones."""
    warm, measured = work[: args.warmup], work[args.warmup :]
    if warm:
        wcfg = ClientConfig(
            **{**asdict(cfg), "request_rate": None, "concurrency": min(args.concurrency or 1, len(warm))}
        )
        _, wrecs = asyncio.run(run_requests(wcfg, warm))
        bad = [r for r in wrecs if not r.ok]
        if bad:
            err.print(f"[yellow]warning:[/] {len(bad)} of {len(warm)} warmup requests failed: {bad[0].error}")
    return _run_measured(cfg, measured, args.workers, progress=not args.no_progress, console=err)


def _version() -> str:
    from .. import __version__

    return __version__


def _run_measured(
    cfg: ClientConfig, work: Sequence[Workload], workers: int, progress: bool, console: Any
) -> list[RequestRecord]:
    bar = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("[bold]bench serve"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[failed]} failed"),
            TimeElapsedColumn(),
            console=console,
            transient=False,
        )
    counts = {"failed": 0}
    task = None

    def tick(ok: bool) -> None:
        if not ok:
            counts["failed"] += 1
        if bar is not None:
            bar.update(task, advance=1, failed=counts["failed"])

    if bar is not None:
        bar.start()
        task = bar.add_task("requests", total=len(work), failed=0)
    try:
        if workers > 1:
            return run_workers(cfg, work, workers, on_done=tick)
        _, recs = asyncio.run(run_requests(cfg, work, on_done=lambda r: tick(r.ok)))
        return sorted(recs, key=lambda r: r.index)
    finally:
        if bar is not None:
            bar.stop()


def _fmt(v: Any, digits: int = 1) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:,.{digits}f}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def print_report(config: dict[str, Any], r: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    mode = (
        f"rate {config['request_rate']}/s" + (f", cap {config['concurrency']}" if config["concurrency"] else "")
        if config["request_rate"]
        else f"concurrency {config['concurrency']}"
    )
    t = Table(title=f"swiftlm bench serve: {config['model']} at {config['base_url']} ({mode})")
    t.add_column("metric")
    t.add_column("value", justify="right")
    t.add_row("requests ok / failed", f"{r['requests_ok']} / {r['requests_failed']}")
    t.add_row("duration (s)", _fmt(r["duration_s"], 2))
    t.add_row("requests/s", _fmt(r["request_throughput"], 3))
    t.add_row("output tokens (total)", _fmt(r["total_output_tokens"]))
    t.add_row("output tok/s (aggregate)", _fmt(r["output_throughput"], 2))
    t.add_row("stream tok/s (mean per request)", _fmt(r["mean_stream_tok_s"], 2))
    for key, name in (("ttft_ms", "TTFT"), ("itl_ms", "ITL"), ("tpot_ms", "TPOT"), ("e2e_ms", "E2E")):
        d = r[key]
        t.add_row(
            f"{name} ms mean / p50 / p90 / p99",
            " / ".join(_fmt(d[k], 1 if key != "itl_ms" else 2) for k in ("mean", "p50", "p90", "p99")),
        )
    con.print(t)
    for e, n in r["errors"].items():
        con.print(f"[red]{n} x[/] {e}")


def main(argv: Iterable[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="swiftlm bench serve", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(None if argv is None else list(argv))
    try:
        return run(args)
    except SwiftLMError as exc:
        print(f"swiftlm bench serve: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
