"""The models on this machine and in a running server: ``download`` (``pull``), ``models`` (``ls``), ``rm``
and ``ps`` (what a running server has loaded, asked over HTTP)."""

from __future__ import annotations

import argparse
import json
import time
import urllib.error
import urllib.request
from typing import Any

from .cli_common import RuntimeFailure, human, settings_of
from .errors import SwiftLMError


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
        t.add_row(r["id"], human(r["size_bytes"]), str(r["files"]), r["architecture"], runs, rev)
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
    print(f"removed {what} from the Hugging Face cache ({human(freed)} freed)")
    return 0


# --------------------------------------------------------------------------- ps
def server_url(host: str, port: int) -> str:
    """Where a client reaches a server bound to host:port (a wildcard address is reached on loopback)."""
    host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def _get(url: str, api_key: str | None, timeout: float) -> tuple[int, Any]:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as exc:  # a server answered: 401 without the key, 503 while loading
        try:
            return exc.code, json.loads(exc.read() or b"null")
        except ValueError:
            return exc.code, None


def running(base: str, api_key: str | None = None, timeout: float = 5.0) -> dict[str, Any]:
    """A running server's /health and /v1/models; a RuntimeFailure (exit code 1) when none answers."""
    try:
        _, health = _get(base + "/health", None, timeout)
        status, models = _get(base + "/v1/models", api_key, timeout)
    except (urllib.error.URLError, OSError, ValueError) as exc:
        why = getattr(exc, "reason", None) or exc
        raise RuntimeFailure(
            f"no swiftlm server answers at {base} ({why}); start one with `swiftlm serve`, or point "
            "--host/--port (or --url) at it"
        ) from None
    if not isinstance(health, dict) or "status" not in health:
        raise RuntimeFailure(f"{base} answered, but not as a swiftlm server (its /health has no status)")
    listed = models.get("data") if status == 200 and isinstance(models, dict) else None
    if listed is None:  # /v1/models needs a key we do not have: the server's default model from /health
        listed = [{"id": health.get("model"), "status": {"value": "loaded" if health["status"] == "ok" else "?"}}]
    return {"url": base, "health": health, "models": listed, "models_status": status}


def cmd_ps(args: argparse.Namespace) -> int:
    settings = settings_of(args)
    base = (args.url or server_url(settings.host, settings.port)).rstrip("/")
    info = running(base, settings.api_key)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    h = info["health"]
    t = Table(title=f"{base}: {h.get('status')}, backend {h.get('backend') or '-'}")
    for col in ("model", "state", "in flight", "pinned", "loaded for"):
        t.add_column(col)
    now = time.time()
    for m in info["models"]:
        st = m.get("status") or {}
        created = m.get("created") or 0
        since = f"{now - created:.0f} s" if created and st.get("value") == "loaded" else "-"
        name = m.get("id") or "-"
        if m.get("parent"):
            name += f" (adapter on {m['parent']})"
        t.add_row(name, str(st.get("value", "-")), str(st.get("in_flight", "-")), str(st.get("pinned", "-")), since)
    con = Console()
    con.print(t)
    if info["models_status"] == 401:
        con.print("[dim]/v1/models needs an API key (--api-key or SWIFTLM_API_KEY): showing /health's model[/]")
    mem = h.get("memory") or {}
    if mem:
        con.print(f"memory: {human(mem.get('active', 0))} active, {human(mem.get('peak', 0))} peak")
    return 0
