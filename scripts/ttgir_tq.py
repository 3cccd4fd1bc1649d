#!/usr/bin/env python3
"""Compile the TurboQuant split kernel (``cuda_ext/turboquant_kernels._tq_attn_kernel``) for an H100 (sm_90) on a
machine without a GPU, and count what its loop does with shared memory: the layout conversions of the looked-up
tiles into tensor-core operands (``ttg.local_alloc`` / ``local_load``), the async copies of the codes, and the
shared-memory, ldmatrix, wgmma and shuffle instructions of the PTX (static counts, loop body and prologue).

    python scripts/ttgir_tq.py --preset k4v3 --trans 1 [--block-n 64] [--stages 3] [--dump /tmp/tq]

The split pass is bound by the L1/shared-memory path (Nsight Compute on scripts/ncu_tq_split.py shows it);
this shows where those trips come from without spending GPU time.
"""

from __future__ import annotations

import argparse
import re

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from swiftlm.cuda_ext import tq_codes
from swiftlm.cuda_ext import turboquant_kernels as tk
from swiftlm.turboquant.codebook import lloyd_max
from swiftlm.turboquant.presets import parse_turbo


def _asm(bits: int) -> str:
    c = torch.tensor(lloyd_max(128, bits).centroids)
    return tq_codes.prmt_asm4s(c) if bits == 4 else tq_codes.prmt_asm16(c, bits - 2)


def compile_split(
    preset: str,
    trans: int = 1,
    block_n: int = 64,
    warps: int = 4,
    stages: int = 3,
    n_ptr: int = 0,
    gdc: int = 0,
    maxnreg: int | None = None,
    page: int = 0,
):
    """The split kernel for ``preset`` (no QJL) compiled for sm_90: Triton's CompiledKernel (asm: ttgir, ptx,
    cubin -- ptxas runs here, so the inline PTX of the lookups is assembled too)."""
    fmt = parse_turbo(preset)
    if fmt.key_qjl:
        raise ValueError("QJL keys take the other loop; give a preset without QJL")
    kb, vb = fmt.key_bits, fmt.value_bits
    (kw0, kw1), (vw0, vw1) = tq_codes._PLANES[kb], tq_codes._PLANES[vb]
    fn = tk._tq_attn_kernel
    consts = dict(
        D=128,
        BLOCK_N=block_n,
        REP=4,
        RP=16,
        KW0=kw0,
        KW1=kw1,
        VW0=vw0,
        VW1=vw1,
        QJL=False,
        N_PTR=bool(n_ptr),
        F16=True,
        KNAT=True,
        VNAT=True,
        KASM=_asm(kb),
        KPRMT=1,
        VASM=_asm(vb),
        VPRMT=1,
        KSWAR=1,
        VSWAR=1,
        TRANS=trans,
        GDC=gdc,
        BATCH=0,
        DIAG=0,
        PAGE=page,
    )
    ptrs = {
        "kp0": "*u8",
        "kp1": "*u8",
        "vp0": "*u8",
        "vp1": "*u8",
        "ks_ptr": "*u8",
        "kn_ptr": "*fp16",
        "vn_ptr": "*fp16",
        "kr_ptr": "*fp16",
        "pt_ptr": "*i32",
        "n_ptr": "*i64",
    }
    sig = {}
    for n in fn.arg_names:
        if n in consts:
            sig[n] = "constexpr"
        elif n.endswith("_ptr") or n in ptrs or n.endswith("_out"):
            sig[n] = ptrs.get(n, "*fp32")
        else:
            sig[n] = "fp32" if n == "qjl_scale" else "i32"
    opts = {"num_warps": warps, "num_stages": stages}
    if maxnreg:
        opts["maxnreg"] = maxnreg
    return triton.compile(ASTSource(fn, sig, constexprs=consts), target=GPUTarget("cuda", 90, 32), options=opts)


def registers(k) -> str:
    """ptxas's register and spill report for the compiled kernel (no GPU needed)."""
    import os
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90)
    except TypeError:  # older Triton: no arch argument
        ptxas = get_ptxas()
    ptxas = ptxas.path if hasattr(ptxas, "path") else ptxas[0]
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.ptx")
        open(f, "w").write(k.asm["ptx"])
        r = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f, "-o", os.path.join(d, "k.o")], capture_output=True, text=True
        )
    return " ".join(
        line.split("info    : ")[-1] for line in r.stderr.splitlines() if "registers" in line or "spill" in line
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="k4v3", help="a TurboQuant preset without QJL (k4v3, k3v2, ...)")
    ap.add_argument("--trans", type=int, default=1, help="code tiles as the dots' first operands (1) or second (0)")
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--n-ptr", type=int, default=0, help="row count read on the device (the graphed step's variant)")
    ap.add_argument("--gdc", type=int, default=0, help="programmatic dependent launch waits (as launched on Hopper)")
    ap.add_argument("--maxnreg", type=int, default=0)
    ap.add_argument("--dump", default="", help="write <dump>.ttgir and <dump>.ptx")
    a = ap.parse_args()
    k = compile_split(a.preset, a.trans, a.block_n, a.warps, a.stages, a.n_ptr, a.gdc, a.maxnreg or None)
    ttgir, ptx = k.asm["ttgir"], k.asm["ptx"]
    if a.dump:
        open(a.dump + ".ttgir", "w").write(ttgir)
        open(a.dump + ".ptx", "w").write(ptx)
    print(
        f"{a.preset} trans={a.trans} block_n={a.block_n} warps={a.warps} stages={a.stages}: "
        f"shared memory {k.metadata.shared} bytes per program; ptxas: {registers(k)}"
    )
    for pat in ["ttg.local_alloc", "ttg.local_load", "ttg.convert_layout", "ttg.async_copy_global_to_local"]:
        print(f"  TTGIR {pat:<34} {ttgir.count(pat)}")
    for pat in [
        "st.shared",
        "ld.shared",
        "ldmatrix",
        "stmatrix",
        "cp.async",
        "wgmma.mma_async",
        "mma.sync",
        "shfl",
        "prmt",
        "lop3",
    ]:
        print(f"  PTX   {pat:<34} {len(re.findall(re.escape(pat), ptx))}")


if __name__ == "__main__":
    main()
