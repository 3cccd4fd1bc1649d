"""Output of ``swiftlm bench``: run metadata, progress, JSON, Markdown tables, PNG plots, and ``--compare``."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import platform
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

MiB = 1 << 20


def run_meta(spec: Any, args: Any, **extra: Any) -> dict[str, Any]:
    from .. import __version__
    from ..memory import cpu_name, system_memory

    commit = ""
    with contextlib.suppress(Exception):
        repo = Path(__file__).resolve().parents[2]
        if (repo / ".git").exists():
            commit = subprocess.run(
                ["git", "-C", str(repo), "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5
            ).stdout.strip()
    return {
        "tool": "swiftlm bench",
        "swiftlm": __version__,
        "commit": commit,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": spec.name,
        "architecture": spec.arch,
        "moe": spec.is_moe,
        "model_context": spec.context_length,
        "backend_requested": args.backend,
        "quick": bool(args.quick),
        "platform": platform.platform(),
        "cpu": cpu_name(),
        "system_memory_bytes": system_memory(),
        "python": sys.version.split()[0],
        **extra,
    }


@contextlib.contextmanager
def progress(total: int) -> Iterator[Callable[[str, dict], None]]:
    """A rich progress bar (plain lines when stderr is not a terminal); yields advance(config, row)."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = Console(stderr=True)
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as prog:
        task = prog.add_task("swiftlm bench", total=total)

        def advance(config: str, row: dict) -> None:
            kind = row["kind"]
            if kind == "loaded":
                msg = f"{config}: loaded in {row['load_s']:.1f} s on {row['device']}"
            elif kind == "context":
                dec = row["decode_tps"]
                msg = f"{config}: context {row['context']}: prefill {row['prefill_tps']:.0f} tok/s, decode " + (
                    f"{dec:.1f} tok/s" if dec else "-"
                )
            elif kind == "batch":
                msg = f"{config}: batch {row['batch']}: {row['throughput_tps']:.1f} tok/s"
            else:
                msg = f"{config}: {kind}: {row.get('reason', '')}"
            prog.console.log(msg)
            prog.update(task, description=f"swiftlm bench: {config}", advance=1)
            if kind in ("skipped", "error"):  # the configuration's remaining steps will not come
                prog.update(task, total=max(prog.tasks[0].total - 1, prog.tasks[0].completed))

        yield advance


# --------------------------------------------------------------------------------------------- tables
def _rows(doc: dict, kind: str) -> list[tuple[str, dict]]:
    return [(r["config"], x) for r in doc["results"] for x in r["rows"] if x["kind"] == kind]


def _baseline(doc: dict, kind: str, key: str, field: str) -> dict[Any, float]:
    return {x[key]: x[field] for c, x in _rows(doc, kind) if c == "vanilla" and x.get(field)}


def _f(v: Any, fmt: str = "{:.1f}") -> str:
    return "-" if v is None else fmt.format(v)


def _ratio(v: Any, base: Any) -> str:
    return "-" if not v or not base else f"{v / base:.2f}x"


def _same(x: dict, vanilla: dict) -> str:
    ref = vanilla.get(x["context"])
    return "-" if ref is None or not x.get("output_digest") else ("same" if x["output_digest"] == ref else "differ")


def markdown(doc: dict) -> str:
    m = doc["meta"]
    lines = [f"# swiftlm bench: {m['model']}", ""]
    loaded = {c: x for c, x in _rows(doc, "loaded")}
    dev = dict(next(iter(loaded.values()), {}))
    ran_on = {x.get("device") for _, x in _rows(doc, "context")} - {None, "cpu"}
    if dev.get("device", "cpu") == "cpu" and ran_on:  # the requests' own memory rows say where they ran
        dev["device"] = sorted(ran_on)[0]
    lines.append(
        f"{m['date']} · swiftlm {m['swiftlm']} {m.get('commit', '')} · backend {dev.get('backend', '?')} "
        f"on {dev.get('device_name') or dev.get('device', '?')}"
        + (f" (host {m['cpu']})" if dev.get("device", "cpu") != "cpu" else "")
        + " · "
        f"{m['decode']} decoded tokens per request, greedy · {m.get('seconds', '?')} s in all"
    )
    lines += [
        "",
        "| config | context | TTFT s | prefill tok/s | decode tok/s | decode vs vanilla | peak RSS MiB "
        "| device peak MiB | KV MiB | KV / 16-bit | tokens as vanilla |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base = _baseline(doc, "context", "context", "decode_tps")
    same = {x["context"]: x.get("output_digest") for c, x in _rows(doc, "context") if c == "vanilla"}
    for c, x in _rows(doc, "context"):
        kv_ratio = f"{x['kv_bytes'] / x['kv_fp16_bytes']:.2f}" if x["kv_fp16_bytes"] else "-"
        dpeak = x.get("device_peak_bytes")
        lines.append(
            f"| {c} | {x['context']} | {x['ttft_s']:.3f} | {x['prefill_tps']:.0f} | {_f(x['decode_tps'])} | "
            f"{_ratio(x['decode_tps'], base.get(x['context']))} | {x['peak_rss_bytes'] / MiB:.0f} | "
            f"{_f(dpeak / MiB if dpeak else None, '{:.0f}')} | {x['kv_bytes'] / MiB:.2f} | {kv_ratio} | "
            f"{_same(x, same)} |"
        )
    batch = _rows(doc, "batch")
    if batch:
        bbase = _baseline(doc, "batch", "batch", "throughput_tps")
        lines += [
            "",
            f"Throughput: concurrent requests of {m['batch_context']} prompt tokens, output tokens / wall "
            "time (prefill included).",
            "",
            "| config | batch | output tok/s | vs vanilla |",
            "|---|---|---|---|",
        ]
        for c, x in batch:
            lines.append(
                f"| {c} | {x['batch']} | {x['throughput_tps']:.1f} | "
                f"{_ratio(x['throughput_tps'], bbase.get(x['batch']))} |"
            )
    other = [(r["config"], x) for r in doc["results"] for x in r["rows"] if x["kind"] in ("skipped", "error")]
    if other:
        lines += [""] + [f"- {c}: {x['kind']}: {x['reason']}" for c, x in other]
    if loaded:
        lines += [
            "",
            "Load: "
            + "; ".join(
                f"{c} {x['load_s']:.1f} s, weights {x['weights_bytes'] / MiB:.0f} MiB" for c, x in loaded.items()
            ),
        ]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------------------------- plots
def _series(doc: dict, kind: str, key: str, field: str) -> dict[str, tuple[list, list]]:
    out: dict[str, tuple[list, list]] = {}
    for c, x in _rows(doc, kind):
        v = x.get(field)
        if v is None:
            continue
        xs, ys = out.setdefault(c, ([], []))
        xs.append(x[key])
        ys.append(v)
    return out


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(
    ax: Any, docs: list[tuple[str, dict]], kind: str, key: str, field: str, scale: float, title: str, ylabel: str
) -> None:
    styles = ["-", "--", ":", "-."]
    for i, (label, doc) in enumerate(docs):
        for c, (xs, ys) in _series(doc, kind, key, field).items():
            ax.plot(
                xs, [y / scale for y in ys], styles[i % 4], marker="o", label=f"{c}" + (f" ({label})" if label else "")
            )
    ax.set_xscale("log", base=2)
    ax.set_title(title)
    ax.set_xlabel(key if key != "context" else "context (prompt tokens)")
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7)


def draw_plots(docs: list[tuple[str, dict]], stem: Path) -> list[Path]:
    plt = _pyplot()
    if plt is None:
        print("swiftlm bench: matplotlib is not installed, no plots (pip install matplotlib)", file=sys.stderr)
        return []
    name = docs[0][1]["meta"]["model"] if len(docs) == 1 else " vs ".join(lbl for lbl, _ in docs)
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    _draw(axes[0], docs, "context", "context", "prefill_tps", 1, "prefill", "tok/s")
    _draw(axes[1], docs, "context", "context", "decode_tps", 1, "decode (one request)", "tok/s")
    _draw(axes[2], docs, "batch", "batch", "throughput_tps", 1, "throughput (concurrent requests)", "output tok/s")
    fig.suptitle(f"swiftlm bench: speed ({name})")
    fig.tight_layout()
    speed = stem.with_name(stem.name + "_speed.png")
    fig.savefig(speed, dpi=110)
    plt.close(fig)
    device = any("device_peak_bytes" in x for _, d in docs for _, x in _rows(d, "context"))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    _draw(
        axes[0],
        docs,
        "context",
        "context",
        "device_peak_bytes" if device else "peak_rss_bytes",
        MiB,
        "peak device memory" if device else "peak process memory (RSS)",
        "MiB",
    )
    _draw(axes[1], docs, "context", "context", "kv_bytes", MiB, "KV cache held", "MiB")
    fig.suptitle(f"swiftlm bench: memory ({name})")
    fig.tight_layout()
    mem = stem.with_name(stem.name + "_memory.png")
    fig.savefig(mem, dpi=110)
    plt.close(fig)
    return [speed, mem]


# --------------------------------------------------------------------------------------------- files
def default_stem(doc: dict) -> str:
    m = doc["meta"]
    backend = next((x.get("backend", "") for _, x in _rows(doc, "loaded")), m["backend_requested"])
    model = re.sub(r"[^A-Za-z0-9._-]+", "-", Path(str(m["model"])).name).strip("-") or "model"
    return f"bench-{model}-{backend}-{m['date'][:10]}" + ("-quick" if m.get("quick") else "")


def write(doc: dict, out: Path, name: str | None, plots: bool = True) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    stem = out / (name or default_stem(doc))
    js, md = stem.with_suffix(".json"), stem.with_suffix(".md")
    js.write_text(json.dumps(doc, indent=2) + "\n")
    md.write_text(markdown(doc))
    paths = [js, md]
    if plots:
        paths += draw_plots([("", doc)], stem)
    return paths


def compare(a_path: str, b_path: str, out: Path, plots: bool = True) -> int:
    docs = []
    for p in (a_path, b_path):
        try:
            doc = json.loads(Path(p).read_text())
            doc["meta"], doc["results"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"swiftlm bench: {p} is not a swiftlm bench JSON file ({type(e).__name__}: {e})", file=sys.stderr)
            return 2
        docs.append((Path(p).stem, doc))
    (la, a), (lb, b) = docs
    lines = [
        f"# swiftlm bench --compare: {la} (A) vs {lb} (B)",
        "",
        f"A: {a['meta']['model']}, {a['meta']['date']}, {a['meta'].get('commit', '')}; "
        f"B: {b['meta']['model']}, {b['meta']['date']}, {b['meta'].get('commit', '')}",
        "",
        "| config | context | prefill A | prefill B | B/A | decode A | decode B | B/A | peak RSS MiB A | B |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    bi = {(c, x["context"]): x for c, x in _rows(b, "context")}
    for c, x in _rows(a, "context"):
        y = bi.get((c, x["context"]))
        if y is None:
            continue
        lines.append(
            f"| {c} | {x['context']} | {x['prefill_tps']:.0f} | {y['prefill_tps']:.0f} | "
            f"{_ratio(y['prefill_tps'], x['prefill_tps'])} | {_f(x['decode_tps'])} | {_f(y['decode_tps'])} | "
            f"{_ratio(y['decode_tps'], x['decode_tps'])} | {x['peak_rss_bytes'] / MiB:.0f} | "
            f"{y['peak_rss_bytes'] / MiB:.0f} |"
        )
    bb = {(c, x["batch"]): x for c, x in _rows(b, "batch")}
    pairs = [(c, x, bb[(c, x["batch"])]) for c, x in _rows(a, "batch") if (c, x["batch"]) in bb]
    if pairs:
        lines += ["", "| config | batch | tok/s A | tok/s B | B/A |", "|---|---|---|---|---|"]
        lines += [
            f"| {c} | {x['batch']} | {x['throughput_tps']:.1f} | {y['throughput_tps']:.1f} | "
            f"{_ratio(y['throughput_tps'], x['throughput_tps'])} |"
            for c, x, y in pairs
        ]
    text = "\n".join(lines) + "\n"
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"compare-{la}-vs-{lb}"
    stem.with_suffix(".md").write_text(text)
    print(text)
    written = [stem.with_suffix(".md")]
    if plots:
        written += draw_plots([("A", a), ("B", b)], stem)
    for p in written:
        print(f"wrote {p}")
    return 0
