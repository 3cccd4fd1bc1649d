"""The engine's step log (SWIFTLM_STEP_LOG) and scripts/step_timeline.py's summary of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
needs_torch = pytest.mark.skipif(__import__("importlib").util.find_spec("torch") is None, reason="torch not installed")


@needs_torch
def test_step_log_lines_account_for_every_step(tiny_llama, tmp_path, monkeypatch):
    """One line per step: the prompt chunks carry the prompts' tokens, the decode rows add up to the
    tokens generated after each prompt's first (sampled from its last chunk), and the timeline
    script's groups cover the span."""
    from swiftlm import LLM, SamplingParams

    log = tmp_path / "steps-{pid}.jsonl"
    monkeypatch.setenv("SWIFTLM_STEP_LOG", str(log))
    llm = LLM(str(tiny_llama), backend="torch", parallel=4, prompt_cache_bytes=0)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    try:
        outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    finally:
        llm.close()
    files = list(tmp_path.glob("steps-*.jsonl"))
    assert len(files) == 1 and "{pid}" not in files[0].name
    rows = [json.loads(x) for x in files[0].read_text().splitlines()]
    assert sum(r["prefill_tokens"] for r in rows) == sum(len(p) for p in prompts)
    assert sum(r["prefill_seqs"] for r in rows) >= len(prompts)
    generated = sum(len(o.token_ids) for o in outs)
    assert sum(r["decode"] for r in rows) == generated - len(prompts)
    assert all(r["forward"] >= 0 and r["sync"] >= 0 for r in rows)
    assert [r["t"] for r in rows] == sorted(r["t"] for r in rows)

    out = tmp_path / "summary.json"
    r = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "step_timeline.py"), str(files[0]), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    s = json.loads(out.read_text())
    assert s["steps"] == len(rows)
    assert sum(g["steps"] for g in s["groups"].values()) == len(rows) - 1  # intervals between step starts
    assert abs(sum(g["seconds"] for g in s["groups"].values()) - s["span_s"]) < 1e-3
