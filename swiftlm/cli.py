"""``swiftlm [serve] --model ...`` plus generate / chat / info / convert / bench / download / models / rm.

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

SUBCOMMANDS = ("serve", "generate", "chat", "info", "convert", "bench", "download", "models", "rm", "finetune")


class _Parser(argparse.ArgumentParser):
    """A command-line mistake is one line on stderr and exit code 2 (not argparse's usage block)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    """Append each setting's built-in default to its help text (the environment variable may override it)."""
    for act in parser._actions:
        field = Settings.model_fields.get(act.dest)
        if field is None or not act.help or "(default:" in act.help:
            continue
        d = field.default
        if d is None or d is False:
            continue
        shown = "on" if d is True else d
        act.help = act.help.replace(" [env ", f" (default: {shown}) [env ", 1)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="swiftlm",
        description="Local LLM inference with an OpenAI-compatible API. "
        "With no subcommand, serves the model (same as `swiftlm serve`); the serve options follow "
        "the command list.",
    )
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")

    s = sub.add_parser(
        "serve",
        help="start the OpenAI-compatible server (default)",
        description="Start the OpenAI-compatible server (also what `swiftlm` with no command does).",
    )
    add_settings_arguments(s)
    p._serve_parser = s  # type: ignore[attr-defined]

    g = sub.add_parser("generate", help="generate from a prompt and print the text")
    add_settings_arguments(g, groups=("model", "engine", "experts", "sampling", "planned", "distributed"))
    g.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message (chat template only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--verbose", action="store_true", help="print timing to stderr")
    tt = g.add_argument_group("test-time compute (swiftlm.test_time; N chains in one batch)")
    tt.add_argument("--self-consistency", type=int, metavar="N", help="N sampled chains, majority vote on the answer")
    tt.add_argument("--best-of-n", type=int, metavar="N", help="N sampled chains, the best by --score")
    tt.add_argument("--refinement-rounds", type=int, metavar="N", help="answer, then N critique -> revise rounds")
    tt.add_argument(
        "--answer",
        default="last_number",
        choices=("last_number", "final_line", "regex", "json"),
        help="how self-consistency reads a chain's answer (default last_number)",
    )
    tt.add_argument("--answer-pattern", default=None, help="the regular expression of --answer regex")
    tt.add_argument(
        "--score",
        default="mean_logprob",
        choices=("mean_logprob", "logprob", "verifier"),
        help="how best-of-N ranks chains (default mean_logprob)",
    )

    c = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    add_settings_arguments(c, groups=("model", "engine", "experts", "sampling", "planned", "distributed"))
    c.add_argument("--system", default=None, help="system message")

    i = sub.add_parser("info", help="backends found, device and memory; with --model, the model's facts and plan")
    add_settings_arguments(i, groups=("model",))
    for flag in (
        "--turbo-kv",
        "--turbo-kv-window",
        "--turbo-kv-threshold",
        "--turbo-kv-keep-layers",
        "--stream-experts",
        "--expert-top-k",
    ):
        _add_one(i, flag)
    i.add_argument("--json", action="store_true", help="print JSON")

    v = sub.add_parser(
        "convert", help="convert a GGUF file to an HF-format directory (mlx-lm and transformers load it)"
    )
    v.add_argument("gguf", help="input .gguf file, or 'smollm2-135m-instruct' for the bundled model")
    v.add_argument("out", help="output directory")
    v.add_argument(
        "--dtype",
        choices=("float16", "bfloat16", "float32"),
        default="float16",
        help="dtype of the dequantized weights (and of the scales with --keep-quantized)",
    )
    v.add_argument(
        "--keep-quantized",
        action="store_true",
        help="keep the weights 4/8-bit in MLX's quantized format instead of dequantizing (needs mlx)",
    )
    v.add_argument("--force", action="store_true", help="overwrite a non-empty output directory")

    ft = sub.add_parser(
        "finetune",
        help="train a LoRA adapter on a JSONL chat dataset (PEFT format on torch, mlx-lm "
        "format on mlx; serve it with --adapter NAME=PATH)",
    )
    ft.add_argument("--model", required=True, help="base model (local HF directory, HF cache id or .gguf)")
    ft.add_argument(
        "--data",
        required=True,
        help='JSONL: {"messages": [...]} (last message: the assistant\'s '
        'target), {"prompt", "completion"} or {"text"} per line',
    )
    ft.add_argument("--out", required=True, help="output directory of the adapter")
    ft.add_argument(
        "--backend",
        choices=("torch", "mlx"),
        default="torch",
        help="torch: swiftlm's autograd trainer, PEFT output; mlx: mlx-lm's trainer, mlx-lm output",
    )
    ft.add_argument("--rank", type=int, default=8)
    ft.add_argument("--alpha", type=float, default=16.0)
    ft.add_argument("--steps", type=int, default=100)
    ft.add_argument("--lr", type=float, default=1e-3)
    ft.add_argument("--batch-size", type=int, default=8, help="examples per step (packed into one forward)")
    ft.add_argument("--targets", default="q_proj,v_proj", help="comma-separated projections to adapt")
    ft.add_argument("--seed", type=int, default=0)
    ft.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    ft.add_argument("--fuse", action="store_true", help="also write OUT/fused: the base with the adapter merged in")

    b = sub.add_parser(
        "bench",
        help="the speed and memory matrix of a model (vanilla / TurboQuant presets / "
        "expert streaming x context lengths); `bench serve` loads any OpenAI-compatible server",
        description="Measure a model across configurations (vanilla, --turbo-kv presets, "
        "--stream-experts, both) and context lengths: prefill and decode tok/s, TTFT, peak process and "
        "device memory, KV bytes, and throughput at batch sizes. Writes JSON, a Markdown table and "
        "PNG plots. `swiftlm bench serve --help` is the HTTP load generator.",
    )
    from .bench.matrix import add_arguments as add_bench_matrix_arguments

    add_bench_matrix_arguments(b)
    bsub = b.add_subparsers(dest="bench_command", metavar="{serve}")
    from .bench.serve import add_arguments as add_bench_serve_arguments

    add_bench_serve_arguments(
        bsub.add_parser(
            "serve",
            help="stream requests at a concurrency or a Poisson rate to an OpenAI-compatible server; "
            "TTFT, inter-token latency, throughput",
            description="Load any OpenAI-compatible server with streamed requests (a fixed concurrency or Poisson "
            "arrivals) and report TTFT, inter-token latency, end-to-end latency and throughput.",
        )
    )

    d = sub.add_parser(
        "download",
        help="download a model from the Hugging Face hub into the local cache, with a progress bar",
        description="Download a model repo (or the files matching --include) "
        "into the Hugging Face cache (HF_HOME / HF_HUB_CACHE), resuming partial files. HF_TOKEN is "
        "sent when set; HF_HUB_OFFLINE=1 forbids the network; HF_ENDPOINT names another hub.",
    )
    d.add_argument("repo_id", help="hub id, owner/name (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    d.add_argument("--revision", default=None, help="branch, tag or commit (default: main)")
    d.add_argument(
        "--include",
        action="append",
        default=[],
        metavar="GLOB",
        help="download only files matching this pattern (repeatable), e.g. '*.safetensors'",
    )
    d.add_argument(
        "--exclude", action="append", default=[], metavar="GLOB", help="skip files matching this pattern (repeatable)"
    )
    d.add_argument(
        "--local-dir",
        default=None,
        metavar="DIR",
        help="put the files in DIR instead of the cache (then serve them with --model DIR)",
    )

    m = sub.add_parser(
        "models",
        help="list the models in the local Hugging Face cache: size, architecture, which installed backends run each",
    )
    m.add_argument("--json", action="store_true", help="print JSON")

    r = sub.add_parser("rm", help="delete a model from the local Hugging Face cache")
    r.add_argument("repo_id", help="hub id as `swiftlm models` lists it")
    r.add_argument("--revision", default=None, help="delete only this revision (commit prefix, branch or tag)")

    for sp in sub.choices.values():
        _with_defaults(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    if argv and argv[0] in ("-h", "--help"):
        # The commands, then serve's flags and defaults: `swiftlm` alone is `swiftlm serve`.
        print(parser.format_help())
        print("serve options (`swiftlm` with no command serves; `swiftlm COMMAND --help` shows a command's own):")
        serve_help = parser._serve_parser.format_help()  # type: ignore[attr-defined]
        print(serve_help.split("\n\n", 2)[-1] if serve_help.count("\n\n") >= 2 else serve_help)
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        argv.insert(0, "serve")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=os.environ.get("SWIFTLM_LOG_LEVEL", "WARNING").upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:
        return {
            "serve": cmd_serve,
            "generate": cmd_generate,
            "chat": cmd_chat,
            "info": cmd_info,
            "convert": cmd_convert,
            "bench": cmd_bench,
            "download": cmd_download,
            "models": cmd_models,
            "rm": cmd_rm,
            "finetune": cmd_finetune,
        }[args.command](args)
    except SwiftLMError as exc:
        print(f"swiftlm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def _setting_error(exc: Exception) -> str:
    """pydantic's multi-line report (with a URL) as one sentence naming the flag and the variable."""
    from pydantic import ValidationError

    from .config import flag_of

    if not isinstance(exc, ValidationError):
        return f"invalid setting: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
    parts = []
    for err in exc.errors():
        name = str(err["loc"][0]) if err.get("loc") else ""
        msg = str(err.get("msg", "is invalid")).removeprefix("Value error, ")
        msg = msg[:1].lower() + msg[1:]
        where = f"{flag_of(name)} (SWIFTLM_{name.upper()})" if name in Settings.model_fields else name or "a setting"
        parts.append(f"{where} {msg}, got {err.get('input')!r}")
    return "invalid setting: " + "; ".join(parts)


def _settings(args: argparse.Namespace) -> Settings:
    try:
        return settings_from_args(args)
    except SwiftLMError:
        raise
    except Exception as exc:  # pydantic validation of a flag or an env var
        raise SwiftLMError(_setting_error(exc)) from None


def _sampling(settings: Settings, args: argparse.Namespace, **extra: Any):
    from .sampling import SamplingParams

    return SamplingParams(
        max_tokens=settings.max_tokens,
        temperature=settings.temp,
        top_p=settings.top_p,
        top_k=settings.top_k,
        min_p=settings.min_p,
        repetition_penalty=settings.repeat_penalty,
        repetition_context_size=settings.repeat_last_n,
        seed=settings.seed,
        **extra,
    )


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
            {"role": "user", "content": prompt}
        ]
    params = _sampling(settings, args, stop=args.stop)
    if args.self_consistency or args.best_of_n or args.refinement_rounds is not None:
        return _generate_test_time(llm, request, params, args)
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
        print(
            f"[load {load_s:.2f}s, backend {llm.backend_choice}; ttft {first - t1:.3f}s; "
            f"{n} tokens, decode {dec:.2f} tok/s]",
            file=sys.stderr,
        )
    llm.close()
    return 0


def _generate_test_time(llm: Any, request: Any, params: Any, args: argparse.Namespace) -> int:
    from . import test_time

    if (
        sum(x is not None and x is not False for x in (args.self_consistency, args.best_of_n, args.refinement_rounds))
        > 1
    ):
        print("swiftlm generate: choose one of --self-consistency, --best-of-n, --refinement-rounds", file=sys.stderr)
        return 2
    if args.self_consistency:
        spec = {
            "strategy": "self_consistency",
            "n": args.self_consistency,
            "answer": args.answer,
            "pattern": args.answer_pattern,
        }
    elif args.best_of_n:
        spec = {"strategy": "best_of_n", "n": args.best_of_n, "score": args.score}
    else:
        spec = {"strategy": "refinement", "rounds": args.refinement_rounds}
    messages = request if isinstance(request, list) else [{"role": "user", "content": request}]
    try:
        r = test_time.run(llm.engine, messages, params, spec, {"enable_thinking": llm.settings.thinking})
    except SwiftLMError as exc:
        print(f"swiftlm generate: {exc}", file=sys.stderr)
        llm.close()
        return 2
    print(r.text)
    if r.votes:
        print("votes: " + ", ".join(f"{a} x{n}" for a, n in r.votes), file=sys.stderr)
    if spec["strategy"] == "best_of_n":
        print("scores: " + ", ".join(f"#{c.index} {c.score:.3f}" for c in r.candidates), file=sys.stderr)
    print(
        f"[{spec['strategy']}: {len(r.candidates)} chain(s), {len(r.rounds)} round(s), {r.completion_tokens} tokens]",
        file=sys.stderr,
    )
    llm.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from rich.console import Console

    from .llm import LLM

    settings = _settings(args)
    console = Console()
    with console.status(f"loading {settings.model or 'the bundled model'}..."):
        llm = LLM(**settings.model_dump())
    console.print(
        f"[bold]swiftlm chat[/] — {llm.spec.name} on {llm.backend_choice}. "
        "Empty line or Ctrl-D quits; /reset clears the conversation."
    )
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    params = _sampling(settings, args)
    while True:
        try:
            line = console.input("[bold green]> [/]")
        except (EOFError, KeyboardInterrupt):
            break
        if not line.strip():
            break
        if line.strip() == "/reset":
            history = history[:1] if args.system else []
            console.print("[dim]conversation cleared[/]")
            continue
        history.append({"role": "user", "content": line})
        reply = ""
        stream = llm.stream(history, params)
        try:
            for d in stream:
                reply += d.text
                console.print(d.text, end="", markup=False, highlight=False)
        except KeyboardInterrupt:  # Ctrl-C stops this answer (the request is cancelled), not the chat
            stream.close()
            console.print("\n[dim](stopped; Ctrl-D or an empty line quits)[/]", end="")
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
    from .memory import plan_for, system_memory

    settings = _settings(args)
    backends = discover_backends()
    out: dict[str, Any] = {
        "backends": {
            n: {
                "available": e.availability.ok,
                "device": e.availability.device,
                "reason": e.availability.reason,
                "entry_point": e.target,
            }
            for n, e in backends.items()
        },
        "system_memory_bytes": system_memory(),
    }
    try:
        _, why = choose_backend(settings.backend, backends)
        out["chosen_backend"] = why
    except SwiftLMError as exc:
        out["chosen_backend"] = f"none: {exc}"
    if settings.model is not None or "model" in vars(args):
        from .registry import resolve

        spec = resolve(settings.model, allow_download=False if settings.offline else None)
        out["model"] = spec.facts()
        out["memory_plan"] = plan_for(spec, settings, backends)
        try:  # how each available backend would run it: e.g. torch "native" or "transformers fallback"
            paths = {
                n: e.backend.model_path(spec)
                for n, e in backends.items()
                if e.availability.ok and hasattr(e.backend, "model_path")
            }
        except Exception as exc:  # pragma: no cover - info must still print what it has
            paths = {"error": f"{type(exc).__name__}: {exc}"}
        if paths:
            out["model"]["runs_as"] = paths
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
        from .memory import plan_for
        from .registry import resolve

        spec = resolve(settings.model, allow_download=False if settings.offline else None)
        print(json.dumps({"model": spec.facts(), "memory_plan": plan_for(spec, settings)}, indent=2))
        return 0
    if settings.distributed:  # under mlx.launch: ranks > 0 run rank 0's steps and never serve HTTP
        from .distributed.external import follow_unless_rank0

        code = follow_unless_rank0(settings)
        if code is not None:
            return code
    if settings.tensor_parallel > 1 or (settings.pipeline_parallel or 1) > 1:  # --nnodes: only rank 0 serves HTTP
        from .distributed.launch import follow_unless_rank0 as follow_rank0

        code = follow_rank0(settings)
        if code is not None:
            return code
    _check_before_serving(settings)
    from .server.app import serve

    return serve(settings)


def _check_before_serving(settings: Settings) -> None:
    """Mistakes that would otherwise surface after uvicorn has started: one sentence, exit code 2."""
    import errno
    import socket

    from .media.processor import check_settings
    from .registry import resolve

    if getattr(settings, "models_file", None) is None and (settings.model is None or isinstance(settings.model, str)):
        spec = resolve(settings.model, allow_download=False if settings.offline else None)
        check_settings(spec, settings)  # e.g. --vision on a text model
    if settings.port == 0:
        return
    try:
        infos = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise SwiftLMError(
            f"--host {settings.host!r} is not an address this machine can bind ({exc.strerror})"
        ) from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise SwiftLMError(
                    f"port {settings.port} on {settings.host} is already in use; stop what is "
                    "listening there or pick another with --port"
                ) from None
            if exc.errno == errno.EACCES:
                raise SwiftLMError(
                    f"not allowed to listen on port {settings.port} (ports below 1024 need "
                    "privileges); pick another with --port"
                ) from None
            raise SwiftLMError(f"cannot listen on {settings.host}:{settings.port}: {exc.strerror}") from None


def cmd_convert(args: argparse.Namespace) -> int:
    from .convert import convert_gguf

    out = convert_gguf(args.gguf, args.out, dtype=args.dtype, keep_quantized=args.keep_quantized, force=args.force)
    print(f"wrote {out}")
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from .finetune import finetune_mlx, finetune_torch

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss {loss:.4f}", flush=True)

    kw = dict(
        rank=args.rank,
        alpha=args.alpha,
        steps=args.steps,
        lr=args.lr,
        batch_size=args.batch_size,
        targets=tuple(t.strip() for t in args.targets.split(",") if t.strip()),
        fuse=args.fuse,
        seed=args.seed,
        progress=progress,
    )
    if args.backend == "mlx":  # mlx-lm's trainer; writes an mlx-lm adapter (adapters.safetensors)
        from .backend import discover_backends

        entry = discover_backends(["mlx"]).get("mlx")
        if entry is None or not entry.availability.ok:
            why = entry.availability.reason if entry else "the mlx backend is not installed"
            print(f"swiftlm: error: finetune --backend mlx: {why}", file=sys.stderr)
            return 2
        if args.device:
            print("swiftlm: error: --device is for --backend torch (MLX uses its default device)", file=sys.stderr)
            return 2
        res = finetune_mlx(args.model, args.data, args.out, **kw)
    else:
        res = finetune_torch(args.model, args.data, args.out, device=args.device, **kw)
    print(
        json.dumps(
            {
                "adapter": res.adapter_dir,
                "fused": res.fused_dir,
                "steps": len(res.losses),
                "first_loss": round(res.losses[0], 4),
                "last_loss": round(res.losses[-1], 4),
                "target_tokens": res.tokens,
                "seconds": res.seconds,
            }
        )
    )
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    if args.bench_command == "serve":
        from .bench.serve import run

        return run(args)
    from .bench.matrix import run as run_matrix

    return run_matrix(args)


def cmd_download(args: argparse.Namespace) -> int:
    from .hub import download
    from .registry import _BUNDLED, _BUNDLED_ALIASES

    if args.repo_id.lower() in _BUNDLED or args.repo_id.lower() in _BUNDLED_ALIASES:
        print(f"{args.repo_id} is the bundled model (installed with swiftlm); nothing to download")
        return 0
    path = download(
        args.repo_id, revision=args.revision, include=args.include, exclude=args.exclude, local_dir=args.local_dir
    )
    n = sum(1 for f in path.rglob("*") if f.is_file() and ".cache" not in f.parts)
    use = f"--model {path}" if args.local_dir else f"--model {args.repo_id}"
    print(f"downloaded {args.repo_id} ({n} files) to {path}; serve it with: swiftlm {use}")
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from .hub import backend_architectures, cached_models, runnable_by
    from .registry import _hf_cache_dir, resolve

    rows = []
    try:
        spec = resolve(None)
        rows.append(
            {
                "id": spec.name,
                "source": "bundled",
                "size_bytes": spec.size_bytes,
                "files": 1,
                "architecture": spec.arch,
                "backends": runnable_by(spec, backend_architectures()),
                "revisions": [],
                "path": str(spec.path),
                "note": "",
            }
        )
    except SwiftLMError as exc:
        rows.append(
            {
                "id": "smollm2-135m-instruct",
                "source": "bundled",
                "size_bytes": 0,
                "files": 0,
                "architecture": "?",
                "backends": [],
                "revisions": [],
                "path": "",
                "note": str(exc),
            }
        )
    for m in cached_models():
        rows.append(
            {
                "id": m.repo_id,
                "source": "hf-cache",
                "size_bytes": m.size_bytes,
                "files": m.nb_files,
                "architecture": m.arch,
                "backends": m.backends,
                "revisions": m.revisions,
                "refs": m.refs,
                "path": str(m.path or ""),
                "note": m.note,
            }
        )
    if args.json:
        print(json.dumps({"cache_dir": str(_hf_cache_dir()), "models": rows}, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"models (Hugging Face cache: {_hf_cache_dir()})")
    for col in ("model", "size", "files", "architecture", "runs on", "revision"):
        t.add_column(col)
    for r in rows:
        rev = (
            "bundled"
            if r["source"] == "bundled"
            else ", ".join((r.get("refs") or []) + [h[:12] for h in r["revisions"][:1]])
        )
        runs = ", ".join(r["backends"]) or ("-" if not r["note"] else r["note"][:60])
        t.add_row(r["id"], _human(r["size_bytes"]), str(r["files"]), r["architecture"], runs, rev)
    Console().print(t)
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    from .hub import remove
    from .registry import _BUNDLED, _BUNDLED_ALIASES

    if args.repo_id.lower() in _BUNDLED or args.repo_id.lower() in _BUNDLED_ALIASES:
        raise SwiftLMError(
            f"{args.repo_id} is the bundled model, part of the installation; it is not in the "
            "cache (scripts/uninstall.sh removes swiftlm)"
        )
    freed = remove(args.repo_id, revision=args.revision)
    what = f"{args.repo_id} revision {args.revision}" if args.revision else args.repo_id
    print(f"removed {what} from the Hugging Face cache ({_human(freed)} freed)")
    return 0


def _add_one(parser: argparse.ArgumentParser, flag: str) -> None:
    """One engine setting on a subcommand that otherwise takes only the model group (info's KV plan)."""
    tmp = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(tmp, groups=("engine", "experts"))
    for act in tmp._actions:
        if flag in act.option_strings:
            parser._add_action(act)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
