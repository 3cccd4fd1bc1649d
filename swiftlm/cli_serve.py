"""``swiftlm serve`` and ``swiftlm info``: every setting that can be checked is checked before the port is
bound (one sentence, exit code 2), then the server loads the model behind a loading line."""

from __future__ import annotations

import argparse
import errno
import json
import socket
from typing import Any

from .cli_common import human, settings_of
from .config import Settings
from .errors import ConfigError, SwiftLMError


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_of(args)
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
    check_before_serving(settings)
    from .server.app import serve

    return serve(settings, loading=_loading_hook(settings))


def check_settings_before_serving(settings: Settings) -> None:
    """What the load would refuse, found before anything listens: the model (and the draft model) exist,
    the flags fit the model, each other and the backend, the adapters are readable.  The checks that need
    no backend come first (choosing one may import torch)."""
    from .adapters import adapter_files, parse_spec
    from .backend import choose_backend
    from .llm import check_engine_settings
    from .media.processor import check_settings as check_media
    from .registry import resolve

    offline = False if settings.offline else None
    spec = None
    if settings.models_file:
        if settings.served_model_name:
            raise ConfigError(
                "--served-model-name names the one --model; a --models-file names its models itself "
                "(name and aliases of each [[models]] entry)"
            )
    elif settings.model is None or isinstance(settings.model, str):
        spec = resolve(settings.model, allow_download=offline)
        check_media(spec, settings)  # e.g. --vision on a text model
        if settings.stream_experts:  # a dense model or a GGUF file cannot stream experts
            from .memory import streamable_layout

            streamable_layout(spec)
    if settings.draft_model and settings.speculative in (None, "draft"):
        resolve(settings.draft_model, allow_download=offline)
    for a in settings.adapter:  # each directory holds a LoRA adapter this version reads
        adapter_files(*parse_spec(a))
    backend, _ = choose_backend(settings.backend)
    check_engine_settings(settings, backend)
    from .server.workers import check_settings as check_workers

    check_workers(settings, backend)
    if spec is not None and settings.gpu_layers is not None and backend.name == "torch":
        from .backends.torch.offload import offload_split  # what partial offload does not combine with

        cfg = spec.config.get("text_config") or spec.config
        offload_split(settings, int(cfg.get("num_hidden_layers") or 0))


def check_before_serving(settings: Settings) -> None:
    """Mistakes that would otherwise surface after uvicorn has started: one sentence, exit code 2.  The port
    first (the cheapest), then the settings."""
    _check_port(settings)
    check_settings_before_serving(settings)


def _check_port(settings: Settings) -> None:
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


def _loading_hook(settings: Settings) -> Any:
    """The server's start-up loads, each behind a loading line (a terminal only; see cli_progress)."""
    from .cli_progress import loading_line, wanted

    if not wanted(settings.quiet):
        return None

    def hook(entry: Any) -> Any:
        from .registry import resolve

        try:
            size = f" ({human(resolve(entry.model, allow_download=False).size_bytes)})"
        except Exception:  # the load itself reports what is wrong with the model
            size = ""
        return loading_line(f"loading {entry.name}{size}", f"loaded {entry.name}", quiet=settings.quiet)

    return hook


def cmd_info(args: argparse.Namespace) -> int:
    from .backend import choose_backend, discover_backends
    from .memory import plan_for, system_memory

    settings = settings_of(args)
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
    con.print(f"system memory: {human(out['system_memory_bytes'])}")
    if "model" in out:
        m = Table(title="model")
        m.add_column("fact")
        m.add_column("value")
        for k, v in out["model"].items():
            m.add_row(k, human(v) if k == "size_bytes" else f"{v:,}" if k == "parameters" else str(v))
        for k, v in out["memory_plan"].items():
            sized = "bytes" in k and isinstance(v, int) and not isinstance(v, bool)
            m.add_row(f"plan: {k}", human(v) if sized else str(v))
        con.print(m)
    return 0
