"""The torch backend's numba kernels (compressed-KV decode on CPU) run on numba's workqueue thread pool, not its
OpenMP one, which shares libgomp with torch: starting that one set the process's OpenMP thread count to numba's,
so every later torch op ran multi-threaded whatever OMP_NUM_THREADS said (``backends/torch/cpu_kernels.py``).
In a subprocess with OMP_NUM_THREADS=1: a prompt chunk and decode rows over a TurboQuant and a kv_bits cache leave
torch at one thread, and the decode rows' outputs are bit-equal to those of the OpenMP layer run with torch
pinned back to one thread (same tasks, same split, same merge)."""

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
                if os.environ.get("PIN_TORCH"):  # torch's own ops at one thread whatever numba's pool did
                    torch.set_num_threads(1)
                q, k, v = (torch.randn(h, T, 64, generator=g) for h in (9, 3, 3))
                out = c.update_attend(0, pos, q, k, v)
                pos += T
                if T == 1:
                    outs.append(out.flatten().tolist())
    print(json.dumps({"layer": numba.threading_layer(), "threads": torch.get_num_threads(), "outs": outs}))
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
    assert ours["layer"] == "workqueue" and ours["threads"] == 1
    try:
        # the user's choice is kept; torch is pinned back to one thread before each step there, since the OpenMP
        # pool sets torch's thread count to numba's (what the workqueue layer avoids) and torch's own ops (the
        # rotations, the 16-bit rows) may then sum in another order: the numba kernels alone are compared
        omp = _run(NUMBA_THREADING_LAYER="omp", PIN_TORCH="1")
    except AssertionError as exc:  # numba built without its OpenMP layer here
        pytest.skip(f"numba's omp layer is not available: {exc}")
    assert omp["layer"] == "omp"
    assert ours["outs"] == omp["outs"]  # decode rows: the same bits on either pool
