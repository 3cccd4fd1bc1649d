#!/usr/bin/env python3
"""Registers and spills of the ``kv_bits`` decode kernel's split pass for a GPU architecture, without a GPU.

    python scripts/kernel_regs.py [--arch 90] [--bits 8,4] [--group 64] [--block-n 64] [--num-warps 4] [--json F]

Triton compiles ``cuda_ext/affine_kv_kernels._affine_attn_kernel`` to PTX for ``sm_<arch>`` (the launch's
constants: head_dim 128, 4 query heads per KV head, fp16 dot operands, as a bf16 model's graphed decode step
runs it), and ``cuobjdump -res-usage`` (shipped in Triton's wheel) reports what one thread uses.  Registers bound how many
programs an SM holds at once (65,536 per SM; at 255 per thread, two 4-warp programs), and a split pass that has
few programs resident waits on memory latency instead of streaming: on an H200 at 128K the kv8 pass ran at
~1.9 TB/s against the 16-bit kernel's ~3.75.  A variant's register count is a first check before a GPU run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


# the split pass's non-constexpr arguments as a bf16 model's graphed decode step passes them (by name, so that a
# renamed or added argument fails here instead of compiling another kernel)
_TYPES = {
    "q_ptr": "*bf16", "kc_ptr": "*u8", "ks_ptr": "*fp16", "kb_ptr": "*fp16", "vc_ptr": "*u8", "vs_ptr": "*fp16",
    "vb_ptr": "*fp16", "m_out": "*fp32", "l_out": "*fp32", "acc_out": "*fp32", "N": "i32", "n_ptr": "*i64",
    "qk_scale": "fp32", "kc_head": "i32", "kc_row": "i32", "ks_head": "i32", "ks_row": "i32", "vc_head": "i32",
    "vc_row": "i32", "vs_head": "i32", "vs_row": "i32",
}  # fmt: skip


def _signature(kernel, bits: int, group: int, block_n: int, D: int, rep: int) -> tuple[dict, dict]:
    consts = dict(
        D=D, GS=group, BITS=bits, BLOCK_N=block_n, REP=rep, RP=max(16, 1 << (rep - 1).bit_length()), N_PTR=True,
        F16=True, GDC=False,
    )  # fmt: skip
    sig = {n: "constexpr" if n in consts else _TYPES[n] for n in kernel.arg_names}
    return sig, consts


def kernel_regs(bits: int, group: int, block_n: int, num_warps: int, arch: int, D: int = 128, rep: int = 4) -> dict:
    """{"registers", "spill_stores", "spill_loads", "programs_per_sm"} of one compiled variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from swiftlm.cuda_ext.affine_kv_kernels import _affine_attn_kernel

    sig, consts = _signature(_affine_attn_kernel, bits, group, block_n, D, rep)
    keys = list(sig)
    src = ASTSource(fn=_affine_attn_kernel, signature=sig, constexprs={(keys.index(k),): v for k, v in consts.items()})
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.TemporaryDirectory() as d:
        f = os.path.join(d, "k.cubin")
        Path(f).write_bytes(compiled.asm["cubin"])
        r = subprocess.run([str(cuobjdump), "-res-usage", f], capture_output=True, text=True)
    use = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", r.stdout)
    if r.returncode or use is None:
        raise RuntimeError((r.stdout + r.stderr)[-2000:])
    regs, stack, shared, local = (int(x) for x in use.groups())
    return {
        "bits": bits,
        "group": group,
        "block_n": block_n,
        "num_warps": num_warps,
        "registers": regs,
        "local_bytes": local,  # per thread: spilled registers and stack arrays
        "stack_bytes": stack,
        "shared_bytes": shared,
        "programs_per_sm": 65536 // (regs * 32 * num_warps),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100 / H200)")
    ap.add_argument("--bits", default="8,4")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--block-n", type=int, default=64)
    ap.add_argument("--num-warps", type=int, default=4)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    rows = [kernel_regs(int(b), a.group, a.block_n, a.num_warps, a.arch) for b in a.bits.split(",")]
    print(f"triton {__import__('triton').__version__}, sm_{a.arch}")
    print("bits | group | rows per tile | warps | registers | local bytes | programs per SM (registers)")
    for r in rows:
        print(
            f"{r['bits']} | {r['group']} | {r['block_n']} | {r['num_warps']} | {r['registers']} | "
            f"{r['local_bytes']} | {r['programs_per_sm']}"
        )
    if a.json:
        Path(a.json).write_text(json.dumps({"arch": a.arch, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
