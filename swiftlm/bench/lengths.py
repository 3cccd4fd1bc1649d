"""``swiftlm bench serve`` at several prompt lengths: ``--prompt-tokens 8000,32000,131072`` runs the benchmark once
per length (its own warmup, its own requests) and reports, per length, time to first token and the median and p99
inter-token latency in one table; ``--results NAME`` writes every length to ``docs/results/NAME.json``
(``--results-dir``), a stable name that benchmark pages read.

The document: ``{"config": {...}, "lengths": [{"prompt_tokens": N, "summary": {...}, "results": {...},
"requests": [...]}, ...]}``.  ``results`` and ``requests`` are those of a one-length ``--json`` file;
``summary`` is the table's row: ``prompt_tokens`` (sent), ``server_prompt_tokens`` (the median of what the server
reported in ``usage.prompt_tokens``, None when it reports none), ``requests_ok``, ``requests_failed``,
``ttft_ms_mean``, ``ttft_ms_p50``, ``ttft_ms_p99``, ``itl_ms_p50``, ``itl_ms_p99``, ``itl_ms_mean``,
``stream_tok_s`` (mean per request) and ``output_tok_s`` (aggregate).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from .metrics import RequestRecord


def parse_lengths(spec: str | int) -> list[int]:
    """``--prompt-tokens``: one length or a comma-separated list of them (``8000,32000,131072``)."""
    if isinstance(spec, int):
        return [spec]
    try:
        out = [int(x) for x in str(spec).replace(" ", "").split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a token count or a comma-separated list of them: {spec!r}") from None
    if not out:
        raise argparse.ArgumentTypeError("give at least one prompt length")
    return out


def single_length(value: int | list[int]) -> int:
    """The one prompt length of ``--prompt-tokens`` (a run of one length)."""
    if isinstance(value, int):
        return value
    if len(value) != 1:
        raise ValueError(f"one prompt length expected, got {value}")
    return value[0]


def summary_row(n: int, results: dict[str, Any], records: list[RequestRecord]) -> dict[str, Any]:
    """One length's row of the table (see the module)."""
    seen = [r.prompt_tokens for r in records if r.ok and r.prompt_tokens is not None]
    ttft, itl = results["ttft_ms"], results["itl_ms"]
    return {
        "prompt_tokens": n,
        "server_prompt_tokens": int(statistics.median(seen)) if seen else None,
        "requests_ok": results["requests_ok"],
        "requests_failed": results["requests_failed"],
        "ttft_ms_mean": ttft["mean"],
        "ttft_ms_p50": ttft["p50"],
        "ttft_ms_p99": ttft["p99"],
        "itl_ms_p50": itl["p50"],
        "itl_ms_p99": itl["p99"],
        "itl_ms_mean": itl["mean"],
        "stream_tok_s": results["mean_stream_tok_s"],
        "output_tok_s": results["output_throughput"],
    }


def document(config: dict[str, Any], runs: list[tuple[int, dict[str, Any], list[RequestRecord]]]) -> dict[str, Any]:
    """The JSON document of a run over ``runs`` = [(length, results, records), ...]."""
    return {
        "config": config,
        "lengths": [
            {
                "prompt_tokens": n,
                "summary": summary_row(n, res, recs),
                "results": res,
                "requests": [r.to_json() for r in recs],
            }
            for n, res, recs in runs
        ],
    }


def write_json(path: str | Path, doc: dict[str, Any]) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1))
    return out


def results_path(directory: str, name: str) -> Path:
    """``--results NAME`` -> DIRECTORY/NAME.json (a name, not a path: the file name is the stable part)."""
    if not name or Path(name).name != name or name in (".", ".."):
        raise ValueError(f"--results takes a file name without directories, got {name!r}")
    return Path(directory) / (name if name.endswith(".json") else name + ".json")


def _ms(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:,.{digits}f}"


def print_lengths(config: dict[str, Any], rows: list[dict[str, Any]], console: Any = None) -> None:
    """The per-length table: TTFT (mean, p50) and ITL (p50, p99) in ms, decode rate per stream."""
    from rich.console import Console
    from rich.table import Table

    con = console or Console()
    mode = f"rate {config['request_rate']}/s" if config.get("request_rate") else f"concurrency {config['concurrency']}"
    t = Table(title=f"swiftlm bench serve: {config['model']} at {config['base_url']} ({mode}), by prompt length")
    for name in (
        "prompt tokens",
        "server saw",
        "ok / failed",
        "TTFT mean ms",
        "TTFT p50 ms",
        "ITL p50 ms",
        "ITL p99 ms",
        "stream tok/s",
    ):
        t.add_column(name, justify="right")
    for r in rows:
        t.add_row(
            f"{r['prompt_tokens']:,}",
            "-" if r["server_prompt_tokens"] is None else f"{r['server_prompt_tokens']:,}",
            f"{r['requests_ok']} / {r['requests_failed']}",
            _ms(r["ttft_ms_mean"]),
            _ms(r["ttft_ms_p50"]),
            _ms(r["itl_ms_p50"], 2),
            _ms(r["itl_ms_p99"], 2),
            _ms(r["stream_tok_s"], 2),
        )
    con.print(t)
