"""``swiftlm [serve] [MODEL]`` plus generate / chat (run) / info / convert / bench / download (pull) /
models (ls) / ps / rm / finetune.

Every setting's flag comes from ``config.Settings`` (one definition, env var and flag).  The model may be
given as the first argument (``swiftlm serve MODEL``, ``swiftlm chat MODEL``) or with ``--model`` / ``-m``.
User errors print one sentence and exit with code 2, failures of the run exit with code 1
(``cli_common``); never a traceback.  The commands live in ``cli_serve``, ``cli_generate`` and
``cli_models``; help and "did you mean" in ``cli_help``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

from . import __version__
from .cli_generate import cmd_chat, cmd_generate
from .cli_help import Parser, did_you_mean, group_by_topic, short_help
from .cli_models import cmd_download, cmd_models, cmd_ps, cmd_rm
from .cli_serve import cmd_info, cmd_serve
from .config import Settings, add_settings_arguments
from .errors import SwiftLMError

# command -> its other names (Ollama's), resolved to the command before dispatch
ALIASES = {"download": ("pull",), "models": ("ls",), "chat": ("run",)}
COMMANDS = ("serve", "generate", "chat", "info", "convert", "bench", "download", "models", "ps", "rm", "finetune")
SUBCOMMANDS = COMMANDS + tuple(a for names in ALIASES.values() for a in names)
_CANONICAL = {a: c for c, names in ALIASES.items() for a in names}
# the settings groups of the commands that run a model in this process (generate, chat)
_RUNS_A_MODEL = ("model", "engine", "experts", "sampling", "planned", "distributed", "output")


def _with_defaults(parser: argparse.ArgumentParser) -> None:
    """Append each setting's built-in default to its help text (the environment variable may override it)."""
    for act in parser._actions:
        field = Settings.model_fields.get(act.dest)
        if field is None or not act.help or "(default:" in act.help:
            continue
        d = field.default
        if d is None or d is False or d == []:
            continue
        shown = "on" if d is True else d
        act.help = act.help.replace(" [env ", f" (default: {shown}) [env ", 1)


def _model_argument(parser: argparse.ArgumentParser) -> None:
    """``swiftlm serve MODEL``: the model as the first argument, the same as --model."""
    parser.add_argument(
        "model_arg",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="the model to run, the same as --model: a hub id, a local directory or a .gguf file",
    )


def _add_settings(parser: argparse.ArgumentParser, *names: str) -> None:
    """A few settings (by name) on a command that takes no whole group of them."""
    tmp = argparse.ArgumentParser(add_help=False)
    add_settings_arguments(tmp)
    for act in tmp._actions:
        if act.dest in names:
            parser._add_action(act)


def _parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="swiftlm",
        usage="swiftlm [-h] [-V] [COMMAND] [MODEL] [options]",
        description="Local LLM inference with an OpenAI-compatible API. "
        "With no command, serves the model (same as `swiftlm serve`); the serve options follow "
        "the command list.",
    )
    p.add_argument("-V", "--version", action="version", version=f"swiftlm {__version__}")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND", prog="swiftlm")

    s = sub.add_parser(
        "serve",
        add_help=False,
        help="start the OpenAI-compatible server (default)",
        description="Start the OpenAI-compatible server (also what `swiftlm` with no command does).",
        usage="swiftlm serve [MODEL] [options]",
    )
    _model_argument(s)
    add_settings_arguments(s)
    group_by_topic(s)
    p._serve_parser = s  # type: ignore[attr-defined]

    g = sub.add_parser(
        "generate",
        add_help=False,
        help="generate from a prompt and print the text",
        usage="swiftlm generate [MODEL] -p PROMPT [options]",
    )
    _model_argument(g)
    g.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    g.add_argument("--raw", action="store_true", help="send the prompt as is, without the chat template")
    g.add_argument("--system", default=None, help="system message (chat template only)")
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--verbose", action="store_true", help="print timing to stderr")
    add_settings_arguments(g, groups=_RUNS_A_MODEL)
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
    group_by_topic(g)

    c = sub.add_parser(
        "chat",
        add_help=False,
        aliases=list(ALIASES["chat"]),
        help="interactive multi-turn chat in the terminal",
        usage="swiftlm chat [MODEL] [options]",
    )
    _model_argument(c)
    c.add_argument("--system", default=None, help="system message")
    add_settings_arguments(c, groups=_RUNS_A_MODEL)
    group_by_topic(c)

    i = sub.add_parser(
        "info",
        help="backends found, device and memory; with a model, the model's facts and plan",
        usage="swiftlm info [MODEL] [options]",
    )
    _model_argument(i)
    add_settings_arguments(i, groups=("model",))
    _add_settings(
        i,
        "turbo_kv",
        "turbo_kv_window",
        "turbo_kv_threshold",
        "turbo_kv_keep_layers",
        "kv_cache_dtype",
        "stream_experts",
        "expert_top_k",
    )
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
    _add_settings(v, "quiet")

    ft = sub.add_parser(
        "finetune",
        help="train a LoRA adapter on a JSONL chat dataset (PEFT format on torch, mlx-lm "
        "format on mlx; serve it with --adapter NAME=PATH)",
    )
    ft.add_argument("-m", "--model", required=True, help="base model (local HF directory, HF cache id or .gguf)")
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
        aliases=list(ALIASES["download"]),
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
        aliases=list(ALIASES["models"]),
        help="list the models in the local Hugging Face cache: size, architecture, which installed backends run each",
    )
    m.add_argument("--json", action="store_true", help="print JSON")

    ps = sub.add_parser(
        "ps",
        help="what a running server has loaded (asks its /health and /v1/models at --host/--port)",
        description="List the models a running swiftlm server serves and their state, from its /health and "
        "/v1/models (default address: http://127.0.0.1:5413, or SWIFTLM_HOST / SWIFTLM_PORT).",
    )
    _add_settings(ps, "host", "port", "api_key")
    for act in ps._actions:  # the same settings, seen from the client's side
        if act.dest in ("host", "port", "api_key"):
            what = {"host": "the server's address", "port": "the server's port", "api_key": "the server's API key"}
            act.help = f"{what[act.dest]} [env SWIFTLM_{act.dest.upper()}]"
    ps.add_argument("--url", default=None, help="the server's base URL instead of --host/--port (e.g. https://...)")
    ps.add_argument("--json", action="store_true", help="print JSON")

    r = sub.add_parser("rm", help="delete a model from the local Hugging Face cache")
    r.add_argument("repo_id", help="hub id as `swiftlm models` lists it")
    r.add_argument("--revision", default=None, help="delete only this revision (commit prefix, branch or tag)")

    for sp in sub.choices.values():
        _with_defaults(sp)
    return p


def _looks_like_model(word: str) -> bool:
    """A first argument that is no command but names a model: `swiftlm MODEL` serves it."""
    from .registry import _BUNDLED, _BUNDLED_ALIASES, _looks_like_repo_id

    w = word.lower()
    return (
        w in _BUNDLED
        or w in _BUNDLED_ALIASES
        or w.endswith(".gguf")
        or _looks_like_repo_id(word)
        or Path(word).exists()
    )


def _subparser(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Parser:
    """The parser of the command given (bench serve's for `bench serve`)."""
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    sp = sub.choices[args.command]
    if args.command == "bench" and getattr(args, "bench_command", None):
        inner = next(a for a in sp._actions if isinstance(a, argparse._SubParsersAction))
        sp = inner.choices[args.bench_command]
    return sp  # type: ignore[return-value]


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a namespace with ``command`` canonical and ``model`` set from MODEL or --model."""
    parser = _parser()
    if argv and not argv[0].startswith("-") and argv[0] not in SUBCOMMANDS:
        if not _looks_like_model(argv[0]):
            parser.fail(  # type: ignore[attr-defined]
                f"unknown command {argv[0]!r}{did_you_mean(argv[0], SUBCOMMANDS)}; the commands are "
                f"{', '.join(COMMANDS)}, and a model (hub id, directory or .gguf file) may come first"
            )
    if not argv or argv[0] not in SUBCOMMANDS:
        argv = ["serve", *argv]
    args, extras = parser.parse_known_args(argv)
    sp = _subparser(parser, args)
    if extras:
        sp.unrecognized(extras)
    args.command = _CANONICAL.get(args.command, args.command)
    model_arg = vars(args).pop("model_arg", None)
    if model_arg is not None:
        if getattr(args, "model", None):
            sp.fail(f"the model is given twice ({model_arg!r} and --model {args.model[0]!r}); give it once")
        args.model = [model_arg]
    return args


def _top_help(full: bool) -> str:
    parser = _parser()
    serve = parser._serve_parser  # type: ignore[attr-defined]
    body = serve.format_help() if full else short_help(serve)
    body = body.split("\n\n", 2)[-1]  # after serve's usage and description: the top-level ones say it
    return (
        f"{parser.format_help()}\nserve options (`swiftlm` with no command serves; "
        f"`swiftlm COMMAND --help` shows a command's own):\n{body}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "--help-all"):
        # The commands, then serve's options: `swiftlm` alone is `swiftlm serve`.
        print(_top_help(full=argv[0] == "--help-all"))
        return 0
    if argv and argv[0] in ("-V", "--version"):
        print(f"swiftlm {__version__}")
        return 0
    args = parse(argv)
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
            "ps": cmd_ps,
            "rm": cmd_rm,
            "finetune": cmd_finetune,
        }[args.command](args)
    except SwiftLMError as exc:
        print(f"swiftlm: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def cmd_convert(args: argparse.Namespace) -> int:
    from .cli_progress import loading_line
    from .convert import convert_gguf

    with loading_line(f"converting {args.gguf}", f"converted {args.gguf}", quiet=getattr(args, "quiet", False)):
        out = convert_gguf(args.gguf, args.out, dtype=args.dtype, keep_quantized=args.keep_quantized, force=args.force)
    print(f"wrote {out}")
    return 0


def cmd_finetune(args: argparse.Namespace) -> int:
    from .finetune import finetune_mlx, finetune_torch

    def progress(step: int, loss: float) -> None:
        if step == 1 or step % 10 == 0 or step == args.steps:
            print(f"step {step}: loss {loss:.4f}", flush=True)

    kw: dict[str, Any] = dict(
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


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
