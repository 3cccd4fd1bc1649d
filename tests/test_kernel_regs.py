"""scripts/kernel_regs.py: the kv_bits split pass compiled for sm_90 without a GPU, its registers read off the
cubin (Triton's own cuobjdump)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_kernel_regs_reports_the_compiled_split_pass(tmp_path):
    pytest.importorskip("triton")
    out = tmp_path / "regs.json"
    r = subprocess.run(
        [sys.executable, "scripts/kernel_regs.py", "--bits", "8,4", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["bits"] for row in rows] == [8, 4]
    for row in rows:
        # a thread holds at most 255 registers on sm_90; the programs an SM holds follow from them
        assert 0 < row["registers"] <= 255, row
        assert row["programs_per_sm"] == 65536 // (row["registers"] * 32 * row["num_warps"]) >= 1, row
        assert row["local_bytes"] >= 0 and row["shared_bytes"] > 0, row
    assert "registers" in r.stdout and "sm_90" in r.stdout
