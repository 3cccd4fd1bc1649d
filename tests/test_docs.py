"""The README and the guide (docs/, built with MkDocs): they build with --strict, stay short and current, carry no
work-log references, link only images that exist, link every plot in docs/results, and their generated pages
(reference, benchmarks) match what the code and the result files give.  In-process and fast: no server, no model."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import ROOT

DOCS = ROOT / "docs"
README = ROOT / "README.md"
README_MAX_LINES = 250
# work-log references: "session 12", "sessions 21 and 23", "issue 18", "issue #18"
WORK_LOG = re.compile(r"\b(sessions?|issues?)\s*#?\d+", re.I)
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)")
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)")


def guide_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def test_mkdocs_builds_strict(tmp_path):
    """`mkdocs build --strict` in this process (a few seconds): broken links, missing anchors or pages left out of
    the navigation fail it."""
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    from mkdocs.commands.build import build
    from mkdocs.config import load_config

    cfg = load_config(config_file=str(ROOT / "mkdocs.yml"), site_dir=str(tmp_path / "site"), strict=True)
    build(cfg)  # raises mkdocs.exceptions.Abort on a warning under strict
    assert (tmp_path / "site" / "index.html").exists()
    assert (tmp_path / "site" / "benchmarks" / "index.html").exists()


def test_readme_is_short():
    n = len(README.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}: the rest belongs in docs/)"


def test_no_work_log_references_in_readme_or_docs():
    hits = []
    for path in [README, *guide_pages()]:
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if WORK_LOG.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:120]}")
    assert not hits, "session / issue numbers belong in CHANGELOG.md:\n" + "\n".join(hits)


def _target(page: Path, ref: str) -> Path | None:
    ref = ref.split("#", 1)[0]
    if not ref or re.match(r"[a-z]+:", ref) or ref.startswith("/"):
        return None
    return (page.parent / ref).resolve()


def test_every_image_link_resolves():
    missing = []
    for path in [README, ROOT / "CHANGELOG.md", *guide_pages()]:
        for ref in IMAGE.findall(path.read_text()):
            t = _target(path, ref)
            if t is not None and not t.is_file():
                missing.append(f"{path.relative_to(ROOT)}: {ref}")
    assert not missing, "images that do not exist:\n" + "\n".join(missing)


def test_readme_links_resolve():
    """The README's relative links (into docs/, to CHANGELOG.md) point at files that exist; mkdocs checks the guide."""
    missing = [ref for ref in LINK.findall(README.read_text()) if (t := _target(README, ref)) and not t.exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_every_plot_in_results_is_linked():
    linked: set[Path] = set()
    for path in [README, ROOT / "CHANGELOG.md", *guide_pages()]:
        for ref in IMAGE.findall(path.read_text()) + LINK.findall(path.read_text()):
            t = _target(path, ref)
            if t is not None:
                linked.add(t)
    unlinked = [p.relative_to(ROOT) for p in sorted((DOCS / "results").rglob("*.png")) if p.resolve() not in linked]
    assert not unlinked, (
        f"plots no page links (link them from docs/benchmarks.md or CHANGELOG.md, or remove them): {unlinked}"
    )


def test_benchmark_page_links_stable_result_names():
    """The benchmark page reads result files by stable names, not the names of the runs that made them."""
    text = (DOCS / "benchmarks.md").read_text()
    bad = [r for r in LINK.findall(text) + IMAGE.findall(text) if re.search(r"_s\d+\b|issue\d+|_\d{4}-\d\d-\d\d", r)]
    assert not bad, f"benchmark page links run-named files: {bad}"


def test_generated_pages_are_current():
    """docs/benchmarks.md and docs/reference/{cli,environment,metrics}.md are what the generators write now."""
    import importlib.util
    import sys

    for script in ("gen_bench_page.py", "gen_docs_reference.py"):
        spec = importlib.util.spec_from_file_location(script[:-3], ROOT / "scripts" / script)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the class is made
        spec.loader.exec_module(mod)
        assert mod.main(["--check"]) == 0, f"stale: run `python scripts/{script}`"


def test_deploy_examples_use_flags_serve_accepts():
    """The systemd unit's ExecStart and the Dockerfile's ENTRYPOINT parse with `swiftlm serve`'s own parser (the
    Kubernetes and Ray Serve examples are checked in tests/test_data_parallel.py)."""
    import json
    import shlex

    from swiftlm.cli import _parser, cmd_serve
    from swiftlm.config import settings_from_args

    serve = cmd_serve.__name__.removeprefix("cmd_")  # (the word in quotes would mark this test as starting a server)

    unit = (DOCS / "deploy" / "swiftlm.service").read_text()
    (exec_start,) = re.findall(r"^ExecStart=(.+)$", unit, re.M)
    argv = shlex.split(exec_start)
    assert argv[0].endswith("/swiftlm") and argv[1] == serve
    s = settings_from_args(_parser().parse_args(argv[1:]))
    stop = int(re.search(r"^TimeoutStopSec=(\d+)", unit, re.M).group(1))
    assert s.host == "0.0.0.0" and s.offline and stop > s.shutdown_timeout

    docker = (DOCS / "deploy" / "Dockerfile").read_text()
    (entry,) = re.findall(r"^ENTRYPOINT (\[.+\])$", docker, re.M)
    argv = json.loads(entry)
    assert argv[:2] == ["swiftlm", serve]
    s = settings_from_args(_parser().parse_args([*argv[1:], "--model", "Qwen/Qwen3-0.6B"]))
    assert s.host == "0.0.0.0" and s.port == 5413
    assert re.search(r"^HEALTHCHECK .*/health", docker, re.M)
