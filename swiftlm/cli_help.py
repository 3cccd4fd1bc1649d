"""The CLI's help and mistakes: settings grouped by topic, a one-screen ``--help`` of the common flags
(``--help-all`` for everything), and a one-line error with a "did you mean" for a mistyped command, flag
or choice (exit code 2)."""

from __future__ import annotations

import argparse
import difflib
import re
import shutil
import sys
from typing import Any

from .config import Settings

# The help topics, in order: key, title, the flags shown by the short --help (settings' names).
TOPICS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("model", "model", ("model", "served_model_name", "backend", "adapter", "models_file")),
    ("server", "server", ("host", "port", "access_log", "log_level")),
    ("sampling", "sampling defaults", ("temp", "top_p", "max_tokens", "seed")),
    ("engine", "engine", ("parallel", "prefill_size", "max_queue", "speculative")),
    ("memory", "memory", ("gpu_layers", "kv_cache_memory", "mem_limit")),
    ("context", "long context", ("ctx_size", "turbo_kv")),
    ("moe", "mixture of experts", ("stream_experts", "expert_top_k")),
    ("media", "media (images, audio)", ("vision", "audio")),
    ("security", "security", ("api_key", "rate_limit", "ssl_certfile")),
    ("distributed", "distributed", ("tensor_parallel", "pipeline_parallel", "data_parallel")),
)

# A setting's topic is its config group's, except where the group spans several topics.
GROUP_TOPIC = {
    "model": "model",
    "models": "model",
    "server": "server",
    "output": "server",
    "sampling": "sampling",
    "engine": "engine",
    "planned": "engine",
    "experts": "moe",
    "media": "media",
    "distributed": "distributed",
}
FIELD_TOPIC = {
    "served_model_name": "model",
    "ctx_size": "context",
    "turbo_kv": "context",
    "turbo_kv_window": "context",
    "turbo_kv_threshold": "context",
    "turbo_kv_keep_layers": "context",
    "turbo_kv_prompt_memory": "context",
    "kv_block_size": "memory",
    "kv_cache_memory": "memory",
    "kv_cache_dtype": "memory",
    "prompt_cache_bytes": "memory",
    "kv_budget_bytes": "memory",
    "mem_limit": "memory",
    "gpu_layers": "memory",
    "offload_dtype": "memory",
    "data_parallel": "distributed",
    "api_key": "security",
    "api_keys_file": "security",
    "rate_limit": "security",
    "rate_burst": "security",
    "ssl_certfile": "security",
    "ssl_keyfile": "security",
    "metrics_need_key": "security",
    "cors": "security",
    "max_body_bytes": "security",
    "max_json_depth": "security",
    "max_json_items": "security",
}


def topic_of(name: str) -> str:
    if name in FIELD_TOPIC:
        return FIELD_TOPIC[name]
    extra = Settings.model_fields[name].json_schema_extra or {}
    return GROUP_TOPIC.get(str(extra.get("group")), "server")


# --------------------------------------------------------------------------- mistakes
def did_you_mean(word: str, choices: Any) -> str:
    """' (did you mean --temp?)' for the closest choices, or ''."""
    close = difflib.get_close_matches(word, sorted(set(choices)), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(close)}?)" if close else ""


class Parser(argparse.ArgumentParser):
    """A command-line mistake is one line on stderr, with the closest flag or choice, and exit code 2
    (not argparse's usage block)."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        m = re.match(r"argument (\S+): invalid choice: '([^']*)'", message)
        if m:
            action = next((a for a in self._actions if m.group(1) in ([*a.option_strings, a.dest, a.metavar])), None)
            if action is not None and action.choices:
                message += did_you_mean(m.group(2), [str(c) for c in action.choices])
        self.fail(message)

    def unrecognized(self, extras: list[str]) -> Any:
        hints = [did_you_mean(x.split("=", 1)[0], self._option_string_actions) for x in extras if x.startswith("-")]
        self.fail(f"unrecognized arguments: {' '.join(extras)}{''.join(hints)}")

    def fail(self, message: str) -> Any:
        print(f"{self.prog}: error: {message} (see `{self.prog} --help`)", file=sys.stderr)
        sys.exit(2)


# --------------------------------------------------------------------------- help
class _HelpAll(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kw: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kw)

    def __call__(self, parser: argparse.ArgumentParser, *a: Any, **kw: Any) -> None:
        parser.print_help()
        parser.exit()


class _ShortHelp(_HelpAll):
    def __call__(self, parser: argparse.ArgumentParser, *a: Any, **kw: Any) -> None:
        print(short_help(parser))
        parser.exit()


def group_by_topic(parser: argparse.ArgumentParser) -> None:
    """Move the settings' flags into one argument group per topic (what --help-all prints); -h/--help is the
    short help (the parser is made with add_help=False), --help-all argparse's whole one."""
    groups = {key: parser.add_argument_group(title) for key, title, _ in TOPICS}
    for act in list(parser._optionals._group_actions):
        if act.dest in Settings.model_fields:
            parser._optionals._group_actions.remove(act)
            groups[topic_of(act.dest)]._group_actions.append(act)
    parser.add_argument("-h", "--help", action=_ShortHelp, help="the common options, by topic")
    parser.add_argument("--help-all", action=_HelpAll, help="every option, by topic, with its environment variable")


def _first_sentence(text: str) -> tuple[str, str]:
    text = re.sub(r"\s*\[env SWIFTLM_[A-Z0-9_]+\]$", "", text or "")
    default = ""
    m = re.search(r"\s*(\(default: [^)]*\))\s*$", text)
    if m:
        default, text = " " + m.group(1), text[: m.start()]
    m = re.search(r"(?<![.\w][a-z])\.(\s|$)", text)  # the first full stop that ends a sentence ("e.g." does not)
    first = text[: m.start() + 1] if m else text
    return first.strip(), default


# Short placeholders for the one-screen help (--help-all keeps the settings' names).
_META = {
    "served_model_name": "NAME",
    "models_file": "FILE",
    "adapter": "NAME=PATH",
    "log_level": "LEVEL",
    "speculative": "MODE",
    "kv_cache_memory": "BYTES",
    "mem_limit": "BYTES",
    "turbo_kv": "PRESET",
    "api_key": "KEY",
    "ssl_certfile": "FILE",
}


def _opts(act: argparse.Action) -> str:
    shorts = [o for o in act.option_strings if not o.startswith("--")]
    longs = [o for o in act.option_strings if o.startswith("--")][:1]  # the primary long form; --help-all lists all
    names = ", ".join(shorts + longs)
    if act.nargs == 0:
        return names
    meta = _META.get(act.dest) or act.metavar or act.dest.upper()
    if len(meta) > 7 and act.type in (int, float):
        meta = "N" if act.type is int else "X"
    return f"{names} [{meta}]" if act.nargs == "?" else f"{names} {meta}"


def _line(opts: str, help_text: str, width: int, col: int) -> str:
    first, default = _first_sentence(help_text)
    room = max(20, width - col - 1 - len(default))
    if len(first) > room:  # cut at the last clause boundary that fits, else mid-word
        cut = max((first.rfind(sep, 0, room - 1) for sep in (", ", "; ", " (", ": ")), default=-1)
        first = first[: cut if cut > room // 2 else room - 1].rstrip(" ,;:") + "…"
    pad = f"  {opts}".ljust(col) if len(opts) + 2 < col else f"  {opts}\n{' ' * col}"
    return f"{pad} {first}{default}".rstrip()


def short_help(parser: argparse.ArgumentParser, width: int | None = None) -> str:
    """Usage, the command's own options, then each topic's common flags, one line each."""
    width = width or min(max(shutil.get_terminal_size((100, 24)).columns, 80), 120)
    col = 32
    acts = {a.dest: a for a in parser._actions if a.option_strings}
    lines = [parser.format_usage().strip(), ""]
    if parser.description:
        lines += [parser.description, ""]
    own = [
        a
        for a in parser._actions
        if a.dest not in Settings.model_fields
        and a.help != argparse.SUPPRESS
        and not isinstance(a, (_HelpAll, argparse._SubParsersAction))
    ]
    if own:
        lines.append(f"{parser.prog.split()[-1]}:")
        lines += [_line(_opts(a) if a.option_strings else (a.metavar or a.dest), a.help or "", width, col) for a in own]
    for key, title, common in TOPICS:
        present = [n for n, a in acts.items() if n in Settings.model_fields and topic_of(n) == key]
        if not present:
            continue
        picked = [n for n in common if n in acts] or present[:2]  # a command without the topic's usual flags
        more = len(present) - len(picked)
        lines.append(f"{title}" + (f" (and {more} more)" if more else "") + ":")
        lines += [_line(_opts(acts[n]), acts[n].help or "", width, col) for n in picked]
    lines += [
        "",
        f"`{parser.prog} --help-all` lists every option, with its default.",
        "Each option is also an environment variable: --port 8080 is SWIFTLM_PORT=8080.",
    ]
    return "\n".join(lines)
