"""The torch backend's numba kernels (compressed-KV decode on CPU) run on numba's OpenMP layer where it loads (its
loops then run on torch's own OpenMP threads), and starting that layer, which sets the process's OpenMP thread
count to every core, leaves torch and the kernels on OMP_NUM_THREADS threads (``cpu_kernels.start_pool``).
In a subprocess with OMP_NUM_THREADS=1: a prompt chunk and decode rows over a TurboQuant and a kv_bits cache leave
torch and numba at one thread, and the decode rows' outputs are bit-equal to those of the workqueue layer (the
user's choice is kept: same tasks, same split, same merge)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import needs_torch

pytest.importorskip("numba")

SCRIPT = textwrap.dedent("""
    import json, os, torch, numba
    from types import SimpleNamespace
    from swiftlm.backends.torch import cpu_kernels
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import affine, parse_turbo

    assert cpu_kernels.enabled()
    a = SimpleNamespace(layers=1, kv_heads=3, heads=9, head_dim=64)
    outs = []
    for fmt in (parse_turbo("k4v3", window=16), affine(8, 64)):
        c = CompressedCache(a, fmt, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(0)
        pos = 0
        with torch.inference_mode():
            for T in (600, 1, 1, 1):
                q, k, v = (torch.randn(h, T, 64, generator=g) for h in (9, 3, 3))
                out = c.update_attend(0, pos, q, k, v)
                pos += T
                if T == 1:
                    outs.append(out.flatten().tolist())
    print(json.dumps({"layer": numba.threading_layer(), "threads": torch.get_num_threads(),
                      "numba": numba.get_num_threads(), "outs": outs}))
""")


def _run(**env: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k != "NUMBA_THREADING_LAYER"}
    e.update(OMP_NUM_THREADS="1", **env)
    r = subprocess.run([sys.executable, "-c", SCRIPT], env=e, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_torch
def test_numba_kernels_leave_torch_threads_alone():
    ours = _run()
    assert ours["layer"] in ("omp", "workqueue") and ours["threads"] == 1 and ours["numba"] == 1
    wq = _run(NUMBA_THREADING_LAYER="workqueue")
    assert (wq["layer"], wq["threads"], wq["numba"]) == ("workqueue", 1, 1)
    assert ours["outs"] == wq["outs"]  # decode rows: the same bits on either pool
