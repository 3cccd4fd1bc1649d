"""``swiftlm [serve] --model ...`` plus generate / chat / info / convert / bench.

Every flag comes from ``config.Settings`` (one definition, env var and flag).  User errors
print one sentence and exit with code 2; never a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from typing import Any

from .config import Settings, add_settings_arguments, settings_from_args
from .errors import SwiftLMError

SUBCOMMANDS = ("serve", "generate", "chat", "info", "convert", "bench")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="swiftlm", description="Local LLM inference with an OpenAI-compatible API. "
                                "With no subcommand, serves the model (same as `swiftlm serve`).")
    sub = p.add_subparsers(dest="command")

    s = sub.add_parser("serve", help="start the OpenAI-compatible server (default)")
    add_settings_arguments(s)

    g = sub.add_parser("generate", help="generate from a prompt and print the text")
    add_settings_arguments(g, groups=("model", "engine", "experts", "sampling", "planned"))
    g.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message (chat template only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--verbose", action="store_true", help="print timing to stderr")

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_settings_arguments(c, groups=("model", "engine", "experts", "sampling", "planned"))
    c.add_argument("--system", default=None, help="system message")

    i = sub.add_parser("info", help="backends found, device and memory; with --model, the model's facts and plan")
    add_settings_arguments(i, groups=("model",))
    for flag in ("--turbo-kv", "--turbo-kv-window", "--turbo-kv-threshold", "--turbo-kv-keep-layers",
                 "--stream-experts", "--expert-top-k"):
        _add_one(i, flag)
    i.add_argument("--json", action="store_true", help="print JSON")

    v = sub.add_parser("convert", help="convert a GGUF file to an HF-format directory (mlx-lm and transformers load it)")
    v.add_argument("gguf", help="input .gguf file, or 'smollm2-135m-instruct' for the bundled model")
    v.add_argument("out", help="output directory")
    v.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default="float16",
                   help="dtype of the dequantized weights (and of the scales with --keep-quantized)")
    v.add_argument("--keep-quantized", action="store_true",
                   help="keep the weights 4/8-bit in MLX's quantized format instead of dequantizing (needs mlx)")
    v.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")

    b = sub.add_parser("bench", help="benchmarks: `bench serve` loads any OpenAI-compatible server")
    bsub = b.add_subparsers(dest="bench_command")
    from .bench.serve import add_arguments as add_bench_serve_arguments

    add_bench_serve_arguments(bsub.add_parser(
        "serve", help="stream requests at a concurrency or a Poisson rate to an OpenAI-compatible server; "
        "TTFT, inter-token latency, throughput",
        description="Load any OpenAI-compatible server with streamed requests (a fixed concurrency or Poisson "
        "arrivals) and report TTFT, inter-token latency, end-to-end latency and throughput."))
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUBCOMMANDS + ("-h", "--help"):
        argv.insert(0, "serve")
    args = _parser().parse_args(argv)
    logging.basicConfig(level=os.environ.get("SWIFTLM_LOG_LEVEL", "WARNING").upper(),
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return {"serve": cmd_serve, "generate": cmd_generate, "chat": cmd_chat, "info": cmd_info,
                "convert": cmd_convert, "bench": cmd_bench}[args.command](args)
    except SwiftLMError as exc:
        print(f"swiftlm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from_args(args)
    except Exception as exc:  # pydantic validation of an env var
        raise SwiftLMError(f"invalid setting: {exc}") from exc


def _sampling(settings: Settings, args: argparse.Namespace, **extra: Any):
    from .sampling import SamplingParams

    return SamplingParams(max_tokens=settings.max_tokens, temperature=settings.temp, top_p=settings.top_p,
                          top_k=settings.top_k, min_p=settings.min_p, repetition_penalty=settings.repeat_penalty,
                          repetition_context_size=settings.repeat_last_n, seed=settings.seed, **extra)


def cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM

    settings = _settings(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    t0 = time.perf_counter()
    llm = LLM(**settings.model_dump())
    load_s = time.perf_counter() - t0
    if args.raw or llm.tokenizer.chat_template is None:  # type: ignore[attr-defined]
        request: Any = prompt
    else:
        request = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}]
    params = _sampling(settings, args, stop=args.stop)
    t1 = time.perf_counter()
    first = None
    n = 0
    for d in llm.stream(request, params):
        if first is None:
            first = time.perf_counter()
        n += len(d.token_ids)
        sys.stdout.write(d.text)
        sys.stdout.flush()
    sys.stdout.write("\n")
    end = time.perf_counter()
    if args.verbose and first is not None:
        dec = (n - 1) / (end - first) if n > 1 and end > first else 0.0
        print(f"[load {load_s:.2f}s, backend {llm.backend_choice}; ttft {first - t1:.3f}s; "
              f"{n} tokens, decode {dec:.2f} tok/s]", file=sys.stderr)
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .llm import LLM

    settings = _settings(args)
    console = Console()
    with console.status(f"loading {settings.model or 'the bundled model'}..."):
        llm = LLM(**settings.model_dump())
    console.print(f"[bold]swiftlm chat[/] — {llm.spec.name} on {llm.backend_choice}. "
                  "Empty line or Ctrl-D quits; /reset clears the conversation.")
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    params = _sampling(settings, args)
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except EOFError:
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            continue
        history.append({"role": "user", "content": line})
        reply = ""
        for d in llm.stream(history, params):
            reply += d.text
            console.print(d.text, end="", markup=False, highlight=False)
        console.print()
        history.append({"role": "assistant", "content": reply})
    llm.close()
    return 0


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


def cmd_info(args: argparse.Namespace) -> int:
    from .backend import choose_backend, discover_backends
    from .memory import memory_plan, system_memory

    settings = _settings(args)
    backends = discover_backends()
    out: dict[str, Any] = {"backends": {n: {"available": e.availability.ok, "device": e.availability.device,
                                            "reason": e.availability.reason, "entry_point": e.target}
                                        for n, e in backends.items()},
                           "system_memory_bytes": system_memory()}
    try:
        _, why = choose_backend(settings.backend, backends)
        out["chosen_backend"] = why
    except SwiftLMError as exc:
        out["chosen_backend"] = f"none: {exc}"
    if settings.model is not None or "model" in vars(args):
        from .registry import resolve

        spec = resolve(settings.model, allow_download=False if settings.offline else None)
        out["model"] = spec.facts()
        out["memory_plan"] = memory_plan(spec, settings.ctx_size, kv_format=_kv_format(settings),
                                         stream_experts=settings.stream_experts, expert_top_k=settings.expert_top_k)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    con = Console()
    t = Table(title="backends")
    for col in ("name", "available", "device / reason", "entry point"):
        t.add_column(col)
    for n, b in out["backends"].items():
        t.add_row(n, "yes" if b["available"] else "no", b["device"] or b["reason"], b["entry_point"])
    con.print(t)
    con.print(f"chosen backend: {out['chosen_backend']}")
    con.print(f"system memory: {_human(out['system_memory_bytes'])}")
    if "model" in out:
        m = Table(title="model")
        m.add_column("fact")
        m.add_column("value")
        for k, v in out["model"].items():
            m.add_row(k, _human(v) if k == "size_bytes" else f"{v:,}" if k == "parameters" else str(v))
        for k, v in out["memory_plan"].items():
            sized = "bytes" in k and isinstance(v, int) and not isinstance(v, bool)
            m.add_row(f"plan: {k}", _human(v) if sized else str(v))
        con.print(m)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    settings = _settings(args)
    settings.check_supported()
    if settings.info:
        from .memory import memory_plan
        from .registry import resolve

        spec = resolve(settings.model, allow_download=False if settings.offline else None)
        print(json.dumps({"model": spec.facts(),
                          "memory_plan": memory_plan(spec, settings.ctx_size, kv_format=_kv_format(settings),
                                                     stream_experts=settings.stream_experts,
                                                     expert_top_k=settings.expert_top_k)},
                         indent=2))
        return 0
    from .server.app import serve

    return serve(settings)


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_gguf

    out = convert_gguf(args.gguf, args.out, dtype=args.dtype, keep_quantized=args.keep_quantized, force=args.force)
    print(f"wrote {out}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from .bench.serve import run

        return run(args)
    print("swiftlm bench: give a benchmark: serve (see `swiftlm bench serve --help`)", file=sys.stderr)
    return 2


def _kv_format(settings: Any) -> Any:
    from .turboquant.presets import settings_format

    return settings_format(settings)


def _add_one(parser: argparse.ArgumentParser, flag: str) -> None:
    """One engine setting on a subcommand that otherwise takes only the model group (info's KV plan)."""
    tmp = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(tmp, groups=("engine", "experts"))
    for act in tmp._actions:
        if flag in act.option_strings:
            parser._add_action(act)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
