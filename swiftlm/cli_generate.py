"""``swiftlm generate`` (one prompt, the text on stdout) and ``swiftlm chat`` / ``swiftlm run`` (a
multi-turn chat in the terminal)."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from typing import Any

from .cli_common import sampling_of, settings_of
from .cli_progress import loading_line
from .config import Settings
from .errors import SwiftLMError


def _load(settings: Settings) -> Any:
    from .llm import LLM

    name = settings.model or "smollm2-135m-instruct"
    with loading_line(f"loading {name}", f"loaded {name}", quiet=settings.quiet):
        return LLM(**settings.model_dump())


def cmd_generate(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    t0 = time.perf_counter()
    llm = _load(settings)
    load_s = time.perf_counter() - t0
    if args.raw or llm.tokenizer.chat_template is None:  # type: ignore[attr-defined]
        request: Any = prompt
    else:
        request = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
    params = sampling_of(settings, stop=args.stop)
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

    # Ctrl-C stops an answer also where the chat was started with SIGINT ignored (a background job of a script, a
    # parent process that ignores it): Python then installs no handler of its own
    signal.signal(signal.SIGINT, signal.default_int_handler)
    settings = settings_of(args)
    console = Console()
    llm = _load(settings)
    console.print(
        f"[bold]swiftlm chat[/] — {llm.spec.name} on {llm.backend_choice}. "
        "Empty line or Ctrl-D quits; /reset clears the conversation."
    )
    history: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    params = sampling_of(settings)
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
