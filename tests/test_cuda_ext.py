"""Triton kernels against their plain-torch references: on CPU tensors under
TRITON_INTERPRET=1 (CI), and on the GPU where one exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, needs_torch

pytestmark = needs_torch
triton_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine")

CODE = """
import torch, json
from swiftlm.cuda_ext.selfcheck import check_all
out = {{}}
for dt in {dtypes}:
    for seed in range(3):  # fresh random inputs each time
        for k, v in check_all("{device}", getattr(torch, dt), seed=seed, H={H}, KVH={KVH}, D={D}, N={N}, I={I}).items():
            out[f"{{k}}/{{dt}}"] = max(out.get(f"{{k}}/{{dt}}", 0.0), v)
print(json.dumps(out))
"""


def _run(device: str, dtypes: list[str], interpret: bool, **shape) -> dict:
    import json

    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    args = dict(H=8, KVH=2, D=64, N=320, I=1500) | shape
    r = subprocess.run([sys.executable, "-c", CODE.format(device=device, dtypes=dtypes, **args)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@triton_missing
@pytest.mark.parametrize("shape", [dict(), dict(H=9, KVH=3, D=64, N=576, I=1536), dict(H=4, KVH=4, D=128, N=100, I=7)])
def test_kernels_match_reference_interpreted(shape):
    errs = _run("cpu", ["float32", "float16"], interpret=True, **shape)
    for name, err in errs.items():
        # fp32: same arithmetic in another order; fp16: one rounding of the output
        assert err <= (1e-5 if name.endswith("float32") else 2e-3), (name, err)


@triton_missing
@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_kernels_match_reference_on_gpu():
    errs = _run("cuda", ["float32", "bfloat16"], interpret=False)
    for name, err in errs.items():
        assert err <= (1e-5 if name.endswith("float32") else 1e-2), (name, err)
