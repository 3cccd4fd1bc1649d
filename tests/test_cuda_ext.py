"""Triton kernels against their plain-torch references: on CPU tensors under
TRITON_INTERPRET=1 (CI), and on the GPU where one exists."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT, needs_torch
from tolerances import fp32_matmul_tol

pytestmark = needs_torch
triton_missing = pytest.mark.skipif(
    __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
)

CODE = """
import torch, json
from swiftlm.cuda_ext.selfcheck import check_all
out = {{}}
for dt in {dtypes}:
    for seed in {seeds}:  # fresh random inputs each time
        for k, v in check_all("{device}", getattr(torch, dt), seed=seed, H={H}, KVH={KVH}, D={D}, N={N}, I={I}).items():
            out[f"{{k}}/{{dt}}"] = max(out.get(f"{{k}}/{{dt}}", 0.0), v)
print(json.dumps(out))
"""


def _fp32_kernel_tol(H: int = 8, KVH: int = 2, D: int = 64, N: int = 320, I: int = 1500) -> float:
    """fp32: the same arithmetic in another order.  check_all's errors are relative (to the
    reference's norm); the longest reduction is RMSNorm's sum of N squares, then rsqrt and two
    products (4 chained roundings; rope and SiLU * up are shorter chains of elementwise ops)."""
    return fp32_matmul_tol(max(N, D), 1.0, 4)


def _run(device: str, dtypes: list[str], interpret: bool, seeds=(0, 1, 2), **shape) -> dict:
    import json

    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    args = dict(H=8, KVH=2, D=64, N=320, I=1500) | shape
    r = subprocess.run(
        [sys.executable, "-c", CODE.format(device=device, dtypes=dtypes, seeds=list(seeds), **args)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


SHAPES = [dict(), dict(H=9, KVH=3, D=64, N=576, I=1536), dict(H=4, KVH=4, D=128, N=100, I=7)]


@triton_missing
@pytest.mark.parametrize("shape", SHAPES)
def test_kernels_match_reference_interpreted(shape):
    """Every kernel of ``check_all`` against its reference, fp32 and fp16, at three shapes (GQA ratios 4, 3
    and 1; head_dim 64 and 128; odd N and I: masked tails).  One seed per shape, a different one each (the
    interpreter is slow: three shapes x one seed draw three sets of fresh random inputs for the shape-free
    kernels, as three seeds of one shape did)."""
    errs = _run("cpu", ["float32", "float16"], interpret=True, seeds=(SHAPES.index(shape),), **shape)
    for name, err in errs.items():
        # fp16: the output rounded once more (u = 2^-11 = 4.9e-4; 2e-3 is 4 u)
        assert err <= (_fp32_kernel_tol(**shape) if name.endswith("float32") else 2e-3), (name, err)


@triton_missing
def test_selfcheck_passes_interpreted():
    """``cuda_ext.enabled()``'s startup self-check (every kernel against its reference, fp32) passes under the
    interpreter, so the kernels are switched on.  The suite's other interpreted processes skip it
    (SWIFTLM_TRITON_SELFCHECK=0, tests/conftest.py): they compare the kernels with their references themselves."""
    code = "from swiftlm import cuda_ext; print(cuda_ext.enabled('cpu'))"
    env = dict(os.environ, TRITON_INTERPRET="1", SWIFTLM_TRITON_SELFCHECK="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.strip().splitlines()[-1] == "True", r.stdout + r.stderr[-3000:]


@triton_missing
@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_kernels_match_reference_on_gpu():
    errs = _run("cuda", ["float32", "bfloat16"], interpret=False)
    for name, err in errs.items():
        # bfloat16: the output rounded once more (u = 2^-9 = 2e-3; 1e-2 is 5 u)
        assert err <= (_fp32_kernel_tol() if name.endswith("float32") else 1e-2), (name, err)


TQ_CODE = """
import json, os, numpy as np, torch
from swiftlm.turboquant import TurboQuantMSE
from swiftlm.turboquant.attention import CompressedHead
from swiftlm.cuda_ext.turboquant_kernels import tq_decode_attention, tq_decode_attention_ref
dev = "{device}"
out = {{}}
for D, N, kb, vb in [(64, 100, 4, 3), (128, 77, 3, 2), (64, 33, 2, 4), (128, 64, 1, 3)]:
    rng = np.random.default_rng(D + N)
    kq, vq = TurboQuantMSE(D, kb, seed=1), TurboQuantMSE(D, vb, seed=2)
    heads = [CompressedHead(kq, vq) for _ in range(3)]
    for h in heads:
        h.append(rng.standard_normal((N, D)), rng.standard_normal((N, D)))
    q = rng.standard_normal((3, D))
    t = lambda a, dt=None: torch.tensor(np.stack(a), dtype=dt).to(dev)
    q_rot = t([kq.rotation.forward(x) * D ** -0.5 for x in q], torch.float32)
    kp = [t([h.keys[0].planes[i] for h in heads]) for i in range(len(heads[0].keys[0].planes))]
    vp = [t([h.values[0].planes[i] for h in heads]) for i in range(len(heads[0].values[0].planes))]
    kn, vn = t([h.keys[0].norms for h in heads]), t([h.values[0].norms for h in heads])
    kc = torch.tensor(kq.codebook.centroids, dtype=torch.float32, device=dev)
    vc = torch.tensor(vq.codebook.centroids, dtype=torch.float32, device=dev)
    m, l, acc = tq_decode_attention(q_rot, kp, kn, kc, kb, vp, vn, vc, vb)
    mr, lr, accr = tq_decode_attention_ref(q_rot, kp, kn, kc, kb, vp, vn, vc, vb)
    m16, l16, acc16 = tq_decode_attention(q_rot, kp, kn, kc, kb, vp, vn, vc, vb, f16=True, splits=2)
    out[f"f16/{{D}}/{{N}}/k{{kb}}v{{vb}}"] = [float(((acc16 / l16[:, None]) - (accr / lr[:, None])).abs().max()
                                               / (accr / lr[:, None]).abs().max()), 0.0, 0.0]
    got = np.stack([vq.rotation.inverse((acc[i] / l[i]).double().cpu().numpy()) for i in range(3)])
    ref = np.stack([heads[i].attend(q[i]) for i in range(3)])
    out[f"{{D}}/{{N}}/k{{kb}}v{{vb}}"] = [float((acc - accr).abs().max() / accr.abs().max()),
                                         float((l - lr).abs().max() / lr.abs().max()), float(np.abs(got - ref).max()),
                                         float(np.abs(ref).max())]
# grouped-query heads (3 query heads per KV head) read views of a larger store (row stride > N)
m, l, acc = tq_decode_attention(q_rot.repeat(3, 1)[:6], [p[:2] for p in kp], kn[:2], kc, kb, [p[:2] for p in vp],
                                vn[:2], vc, vb, rep=3)
mr, lr, accr = tq_decode_attention_ref(q_rot.repeat(3, 1)[:6], [p[:2] for p in kp], kn[:2], kc, kb,
                                       [p[:2] for p in vp], vn[:2], vc, vb, rep=3)
out["gqa"] = [float((acc - accr).abs().max() / accr.abs().max()), float((l - lr).abs().max() / lr.abs().max()), 0.0,
              1.0]
# the encode kernel against the torch codec (fp32 both): codes may differ only within rounding of a boundary
from types import SimpleNamespace
from swiftlm.backends.torch.kv_quant import TurboCodec, unpack
from swiftlm.cuda_ext.tq_codes import tq_encode
for D, bits in [(64, 4), (128, 3), (64, 2), (128, 1)]:
    codec = TurboCodec(D, bits, 3, torch.device(dev))
    x = torch.randn(2, 150, D, device=dev)
    planes, norms = tq_encode(x, codec.R, codec.boundaries, bits)
    ref = codec.encode(x)
    diff = (unpack(planes, bits, D) != unpack(ref.planes, bits, D)).float().mean().item()
    out[f"encode/{{D}}/{{bits}}"] = [diff, float((norms.float() - ref.norms.float()).abs().max()), 0.0]
# the cache's single-row attention through the kernels equals its plain-torch path
from swiftlm.backends.torch.compressed_cache import CompressedCache
from swiftlm.turboquant.presets import parse_turbo
a = SimpleNamespace(layers=1, kv_heads=2, heads=6, head_dim=64)
# (the interpreter takes ~5 s per case: there fp32 keys without QJL, fp16 with QJL and fp16 with 2-bit values)
presets = [("k4v3", torch.float32), ("k3qjl-v3", torch.float32), ("k4v3", torch.float16),
           ("k3qjl-v3", torch.float16), ("k3v2", torch.float16)]
for preset, dt in ([presets[i] for i in (0, 3, 4)] if os.environ.get("TRITON_INTERPRET") == "1" else presets):
    caches = [CompressedCache(a, parse_turbo(preset, window=16), dt, torch.device(dev)) for _ in range(2)]
    caches[0].use_triton = True  # the kernels' attention; the torch path's on caches[1]
    for c in caches:  # both encode through the kernel (checked against the torch codec above): the same codes, so the
        c.kc.use_triton = c.vc.use_triton = True  # attention paths are compared on equal caches (a code one rounding
        # from a boundary flips between fp32 matmuls of different summation orders)
    g = torch.Generator(device=dev).manual_seed(0)
    worst = 0.0
    pos = 0
    # 900+ compressed rows on the GPU; under the interpreter 284, then 588: 2, then 3 split-K chunks of 256 rows
    for T in [300, 1, 1, 300 if os.environ.get("TRITON_INTERPRET") == "1" else 600, 1]:
        q, k, v = (torch.randn(n, T, 64, generator=g, device=dev).to(dt) for n in (6, 2, 2))
        o1, o2 = (c.update_attend(0, pos, q, k, v) for c in caches)
        worst = max(worst, float((o1 - o2).abs().max()))
        pos += T
    out[("cache/" if dt == torch.float32 else "cache16/") + preset] = [worst, 0.0, 0.0]
# a static TurboQuant cache decoding through decode_turbo_static (graph replay on a GPU, eager under the
# interpreter) gives the logits of the dynamic cache's plain path, across compressions and a rollback
from swiftlm.backends.torch.model import MLP, Transformer
from swiftlm.backends.torch.model_config import Args
from swiftlm.backends.torch.graphs import GraphDecoder
cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           head_dim=32, intermediate_size=256, vocab_size=512, rms_norm_eps=1e-5, rope_theta=10000.0,
           max_position_embeddings=512, tie_word_embeddings=True)
torch.manual_seed(0)
with torch.device(dev):
    model = Transformer(Args.from_config(cfg))
with torch.no_grad():
    for p_ in model.parameters():
        p_.normal_(0, 0.05)
model.eval(); model.init_rope()
with torch.no_grad():
    for blk in model.layers:
        blk.self_attn.fuse(); blk.mlp.fuse()
import os
interp = os.environ.get("TRITON_INTERPRET") == "1"  # the interpreter is slow: one preset, fewer steps
for preset in (("k3qjl-v3",) if interp else ("k4v3", "k3qjl-v3")):
    fmt = parse_turbo(preset, window=8)
    st = CompressedCache(model.a, fmt, torch.float32, torch.device(dev), capacity=512)
    st.use_triton = st.kc.use_triton = st.vc.use_triton = True
    dy = CompressedCache(model.a, fmt, torch.float32, torch.device(dev))
    gd = GraphDecoder(model, torch.device(dev))
    toks = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    worst = 0.0
    with torch.inference_mode():
        for c in (st, dy):
            model(torch.tensor(toks[:60], device=dev), c, 0)
        pos = 60
        for step in range(16 if interp else 70):
            if step == (10 if interp else 30):
                pos -= 3  # roll back three positions (a rejected speculative tail)
            a_ = gd.run_turbo(st, toks[pos], pos)
            b_ = model(torch.tensor([toks[pos]], device=dev), dy, pos)[-1]
            worst = max(worst, float((a_ - b_).abs().max()))
            pos += 1
    out["graph/" + preset] = [worst, float(st.counts()[0]), float(dy.counts()[0])]
print(json.dumps(out))
"""


def _run_tq(device: str, interpret: bool) -> dict:
    import json

    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", TQ_CODE.format(device=device)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@triton_missing
def test_turboquant_attention_kernel_interpreted():
    """The packed-code decode attention kernel (TRITON_INTERPRET=1 on CPU) against the torch
    reference (fp32, relative) and, rotated back, against the numpy reference attention over the
    compressed history (relative to its largest value), both to the fp32 rounding bound: key/value
    bits 1-4, N not a multiple of the block."""
    for name, vals in _run_tq("cpu", interpret=True).items():
        _check_tq(name, *vals)


def _check_tq(name: str, a: float, b: float, c: float, ref_max: float = 1.0, gpu: bool = False) -> None:
    if name.startswith("encode/"):
        # a coordinate within float32 rounding of a decision boundary may take the neighbouring
        # code (the kernel's dot product sums in another order): a rare flip, not an error; norms
        # are fp16 values at most one ulp apart (norms of these vectors are < 16: ulp <= 2^-7 < 8e-3)
        assert a < 2e-3 and b <= 1e-3 * 8, (name, a, b)
    elif name.startswith("f16/"):
        # fp16 operands (query, centroids, p * |v|) with fp32 accumulation: each operand rounded once
        # (u = 2^-11), the output a convex combination of values: ~ a few u relative to its largest
        # value; 4e-3 is 8 u
        assert a < 4e-3, (name, a)
    elif name.startswith("cache16/"):
        # fp16 cache: the kernel's fp16 dot operands (lookup-table centroids, p * |v|) against the
        # plain path's fp32 math, both outputs rounded to fp16 (values < 4 here: ulp <= 2^-9); 1e-2
        # is a few ulps plus the operand rounding
        assert a < 1e-2, (name, a)
    elif name.startswith("cache/"):
        # kernel path vs plain-torch path of the cache, fp32 (rounding alone is far smaller): the two paths encode
        # the rows with different kernels, so a boundary flip (see encode/) may move an output by a
        # centroid step's share; 1e-4 is an allowance for that, not a rounding bound
        assert a < 1e-4, (name, a)
    elif name.startswith("graph/"):
        # fp32 logits; both caches compressed alike; the same flip allowance
        assert a < 1e-3 and b == c and b > 0, (name, a, b, c)
    else:
        # the same codes on both sides: scores (D terms), the softmax sum and P.V (N terms) and the
        # rotation back (D terms), 4 chained fp32 reductions; on the GPU a floor of 1e-4 on top (the
        # kernel's tiles and MMA accumulation order differ from the interpreter's)
        D, N = (128, 64) if name == "gqa" else map(int, name.split("/")[:2])
        tol = fp32_matmul_tol(max(D, N), 1.0, 4)
        if gpu:
            tol = max(tol, 1e-4)
        assert a <= tol and b <= tol and c <= tol * ref_max, (name, a, b, c, tol)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_turboquant_attention_kernel_on_gpu():
    for name, vals in _run_tq("cuda", interpret=False).items():
        _check_tq(name, *vals, gpu=True)


TQ_SWAR_CODE = """
import json, os, torch
from swiftlm.cuda_ext import turboquant_kernels as tk
from swiftlm.cuda_ext.tq_codes import _PLANES
from swiftlm.cuda_ext.turboquant_kernels import tq_decode_attention, tq_decode_attention_ref
dev = "{device}"
g = torch.Generator().manual_seed(0)
out = []
# (D, N, key bits, value bits, query heads per KV head): 2- and 3-bit codes on either side, row counts not
# a multiple of the tile, planes that are views of a larger store (row stride > N)
# 4-bit keys: an odd-symmetric codebook (as Lloyd-Max ones are: the 32-bit word path, prmt_asm4s on CUDA) and
# a random one (CUDA falls back to the byte path; the interpreter takes the word path either way)
# 4 splits: 330 rows are 6 tiles of 64, ranges of 1-2 tiles (BAL) or 2, 2, 2 and an empty one (BAL=0); 77 rows
# leave empty splits either way
for D, N, kb, vb, rep, sym in [(128, 77, 3, 2, 4, 0), (64, 100, 4, 3, 1, 1), (128, 130, 2, 3, 4, 0),
                               (64, 33, 4, 2, 2, 0), (128, 330, 4, 3, 4, 1)]:
    KVH = 2
    pl = lambda b: [torch.randint(0, 256, (KVH, N + 5, D * w // 8), generator=g, dtype=torch.uint8)[:, :N].to(dev)
                    for w in _PLANES[b] if w]
    kp, vp = pl(kb), pl(vb)
    kn, vn = ((torch.rand(KVH, N, generator=g) + 0.5).half().to(dev) for _ in range(2))
    kc, vc = (torch.sort(torch.randn(2 ** b, generator=g)).values.to(dev) for b in (kb, vb))
    if sym:
        half = torch.sort(torch.rand(2 ** (kb - 1), generator=g) + 0.05).values
        kc = torch.cat([-half.flip(0), half]).to(dev)
    q = (torch.randn(KVH * rep, D, generator=g) * 0.3).to(dev)
    res = {{}}
    for name, swar, tune in [("byte", "0", {{"TRANS": 0}}), ("swar", "1", {{"TRANS": 0}}), ("swar_trans", "1", {{"TRANS": 1}}),
                             ("ceil", "1", {{"TRANS": 1, "BAL": 0}})]:
        os.environ["SWIFTLM_TQ_SWAR"] = swar
        tk._TUNE.clear(); tk._TUNE.update(tune)
        m, l, a = tq_decode_attention(q, kp, kn, kc, kb, vp, vn, vc, vb, rep=rep, f16=True, splits=4)
        res[name] = (a / l[:, None]).double()
        if N == 330 and name in ("swar_trans", "ceil"):  # the splits that held no row
            ls = tk._split_pass(q, kp, kn, kc, kb, vp, vn, vc, vb, None, rep, None, None, True, 4)[1]
            res[name + "_empty"] = int((ls == 0).all(0).sum())
    tk._TUNE.clear()
    mr, lr, ar = tq_decode_attention_ref(q, kp, kn, kc, kb, vp, vn, vc, vb, rep=rep)
    ref = (ar / lr[:, None]).double()
    out.append(dict(case=[D, N, kb, vb, rep], ref_max=float(ref.abs().max()),
                    swar_vs_byte=float((res["swar"] - res["byte"]).abs().max()),
                    trans_vs_ref=float((res["swar_trans"] - ref).abs().max() / ref.abs().max()),
                    ceil_vs_ref=float((res["ceil"] - ref).abs().max() / ref.abs().max()),
                    empty=[res.get("swar_trans_empty"), res.get("ceil_empty")],
                    byte_vs_ref=float((res["byte"] - ref).abs().max() / ref.abs().max())))
print(json.dumps(out))
"""


def _run_cases(code: str, device: str, interpret: bool) -> list:
    """Run a kernel-check script (``code`` formatted with ``device``) in a subprocess; its last line's JSON."""
    import json

    env = dict(os.environ, TRITON_INTERPRET="1") if interpret else dict(os.environ)
    r = subprocess.run(
        [sys.executable, "-c", code.format(device=device)],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _check_tq_swar(device: str, interpret: bool) -> None:
    cases = _run_cases(TQ_SWAR_CODE, device, interpret)
    assert len(cases) == 5
    for c in cases:
        # the selector-word path looks up the same fp16 centroids as the byte path and feeds them to the same
        # dots: equal bits under the interpreter (numpy's dot either way); on the GPU the tensor-core dot may
        # accumulate in another order for another register layout of the same tile, so there: the fp32 bound
        # for two summation orders of the 2 chained reductions (D, N terms)
        D, N = c["case"][:2]
        bound = 0.0 if interpret else fp32_matmul_tol(max(D, N), c["ref_max"], 2)
        assert c["swar_vs_byte"] <= bound, (c, bound)
        # fp16 dot operands with fp32 accumulation, as the f16/ cases of _check_tq: 8 u of fp16
        assert c["trans_vs_ref"] < 4e-3 and c["byte_vs_ref"] < 4e-3 and c["ceil_vs_ref"] < 4e-3, c
        if N == 330:  # 6 tiles over 4 splits: 1-2 tiles each, or 2, 2, 2, 0
            assert c["empty"] == [0, 1], c


@triton_missing
def test_turboquant_selector_words_equal_byte_path_interpreted():
    """2- and 3-bit codes read as whole 32/16-bit words and spread into selector nibbles (``_sel_words``)
    decode to exactly what the byte-tile path decodes; the transposed-operand variant (TRANS), with even or
    ceil-sized split ranges, agrees with the reference to fp16-operand rounding."""
    _check_tq_swar("cpu", interpret=True)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_turboquant_selector_words_equal_byte_path_on_gpu():
    _check_tq_swar("cuda", interpret=False)


TQ_FULL_CODE = """
import json, torch
from swiftlm.cuda_ext import turboquant_kernels as tk
from swiftlm.cuda_ext.tq_codes import _PLANES
dev = "{device}"
g = torch.Generator().manual_seed(1)
out = []
# (D, N code rows, 16-bit buffer rows, rows valid (None: no mask), key bits, value bits, query heads per KV head,
# fp16 dots): a buffer larger than one 64-row block, a masked prefix, GQA and one query head per KV head
for D, N, R, nv, kb, vb, rep, f16 in [(128, 77, 160, 97, 4, 3, 4, True), (64, 130, 40, None, 3, 2, 2, True),
                                      (128, 33, 70, 70, 2, 3, 4, False), (64, 200, 64, 1, 4, 2, 1, False)]:
    KVH = 2
    pl = lambda b: [torch.randint(0, 256, (KVH, N, D * w // 8), generator=g, dtype=torch.uint8).to(dev)
                    for w in _PLANES[b] if w]
    kp, vp = pl(kb), pl(vb)
    kn, vn = ((torch.rand(KVH, N, generator=g) + 0.5).half().to(dev) for _ in range(2))
    kc, vc = (torch.sort(torch.randn(2 ** b, generator=g)).values.to(dev) for b in (kb, vb))
    dt = torch.bfloat16 if f16 else torch.float32
    q = torch.randn(KVH * rep, D, generator=g).to(dt).to(dev)
    rot = torch.linalg.qr(torch.randn(D, D, generator=g))[0].to(dev)
    q_rot = (q.float() @ rot.T) * D ** -0.5
    dk, dv = (torch.randn(KVH, R, D, generator=g).to(dt).to(dev) for _ in range(2))
    valid = None if nv is None else (torch.arange(R) < nv).to(dev)
    # float64 reference: the codes' softmax partials (tq_decode_attention_ref), rotated back, merged with the rows'
    m, l, acc = (t.double() for t in tk.tq_decode_attention_ref(q_rot, kp, kn, kc, kb, vp, vn, vc, vb, rep=rep))
    acc = acc @ rot.double()
    kd, vd = (t.double().repeat_interleave(rep, 0) for t in (dk, dv))
    sc = torch.einsum("hd,hrd->hr", q.double(), kd) * D ** -0.5
    if valid is not None:
        sc = sc.masked_fill(~valid, float("-inf"))
    M = torch.maximum(m, sc.max(1).values)
    p, w = torch.exp(sc - M[:, None]), torch.exp(m - M)
    ref = (acc * w[:, None] + torch.einsum("hr,hrd->hd", p, vd)) / (l * w + p.sum(1))[:, None]
    res = {{}}
    for name, knobs in (("default", {{}}), ("chunked", dict(SB=32, num_warps=4))):  # one sequence's, batched rows'
        tk._COMBINE.clear()
        tk._COMBINE.update(knobs)
        res[name] = tk.tq_decode_attention_full(q, q_rot, kp, kn, kc, kb, vp, vn, vc, vb, rot, dk, dv, D ** -0.5,
                                                rep=rep, valid=valid, f16=f16, splits=3).double()
    out.append(dict(case=[D, N, R, nv, rep, f16], ref_max=float(ref.abs().max()),
                    err=float((res["default"] - ref).abs().max()),
                    merge_diff=float((res["default"] - res["chunked"]).abs().max()),
                    finite=bool(torch.isfinite(res["default"]).all())))
print(json.dumps(out))
"""


def _check_tq_full(device: str, interpret: bool) -> None:
    cases = _run_cases(TQ_FULL_CODE, device, interpret)
    assert len(cases) == 4
    for c in cases:
        D, N, R, _, _, f16 = c["case"]
        assert c["finite"], c
        # the two merge layouts (all splits in one load; 32 at a time) sum the same 3 partials in another order,
        # then the same window rows: the fp32 bound for two orders of 3 chained reductions (D, R terms), before the
        # output's rounding to its dtype (bfloat16: half an ulp of 2^-8 at the largest value)
        bound = fp32_matmul_tol(max(D, N, R), c["ref_max"], 3) + (2**-8 * c["ref_max"] if f16 else 0.0)
        assert c["merge_diff"] <= bound, (c, bound)
        # against float64: fp16 dot operands (see _check_tq's f16/: 4e-3 of the largest value) plus the bfloat16
        # output's half ulp, or fp32 throughout (4 chained reductions: scores, softmax, P.V, the rotation back)
        tol = (4e-3 + 2**-8) * c["ref_max"] if f16 else fp32_matmul_tol(max(D, N, R), c["ref_max"], 4)
        assert c["err"] <= tol, (c, tol)


@triton_missing
def test_turboquant_decode_row_matches_reference_interpreted():
    """The whole TurboQuant decode row (split pass over codes, combine pass: merge, rotation back, the 16-bit
    window rows, normalisation) against a float64 reference, with the one-load merge one sequence's row takes and
    the 32-splits-at-a-time merge of batched rows (masked and unmasked buffers, GQA, fp16 and fp32 dots)."""
    _check_tq_full("cpu", interpret=True)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
def test_turboquant_decode_row_matches_reference_on_gpu():
    _check_tq_full("cuda", interpret=False)


GEMV_CODE = """
import json, torch
from swiftlm.cuda_ext.gemv import linear_small_m, linear_small_m_ref
g = torch.Generator().manual_seed(0)
out = []
# (M, N, K, config): the default tiling, odd N and K (masked tails), several rows (tl.dot), split K (atomics)
for M, N, K, cfg in [(1, 100, 960, None), (1, 37, 333, (8, 128, 1, 4)), (1, 64, 1000, (16, 256, 2, 4)),
                     (3, 50, 300, None), (5, 70, 513, (32, 128, 2, 4))]:
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    y, ref = linear_small_m(x, w, cfg), linear_small_m_ref(x.double(), w.double())
    out.append(dict(M=M, N=N, K=K, shape=list(y.shape), err=float((y.double() - ref).abs().max()),
                    scale=float((x.double().abs() @ w.double().abs().T).max())))
print(json.dumps(out))
"""


@triton_missing
def test_gemv_matches_reference_interpreted():
    """The small-M linear kernel (``cuda_ext/gemv.py``, one decode row on CUDA) in fp32 against float64:
    one reduction of length K in another order, so within fp32_matmul_tol(K) of the sum of |products|."""
    import json

    r = subprocess.run(
        [sys.executable, "-c", GEMV_CODE],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        env=dict(os.environ, TRITON_INTERPRET="1"),
    )
    assert r.returncode == 0, r.stderr[-3000:]
    cases = json.loads(r.stdout.strip().splitlines()[-1])
    assert len(cases) == 5
    for c in cases:
        assert c["shape"] == [c["M"], c["N"]], c
        assert c["err"] <= fp32_matmul_tol(c["K"], c["scale"]), c


# ------------------------------------------------------------------------------ affine kv_bits kernels
AFFINE_CODE = r"""
import json, sys, time
import torch
from types import SimpleNamespace
from swiftlm.cuda_ext.affine_kv_kernels import affine_decode_attention, affine_decode_attention_ref, affine_encode_rows
from swiftlm.backends.torch.kv_quant import AffineCodec
dev, part = sys.argv[1], sys.argv[2]
gpu = dev == "cuda"
out = {}
g = torch.Generator().manual_seed(0)
if part == "kernel":
    # bits x group x head_dim x GQA rep; row counts 1, 37, 1000 in turn; the row count from the device over
    # a larger store, or views of the first N rows; 0 or 2 16-bit rows (one masked off)
    KVH, i = 2, 0
    for bits in (4, 8):
        for group in (32, 64, 128):
            for D in (64, 128):
                for rep in (1, 4):
                    if group > D:
                        continue
                    N = (1, 37, 1000)[i % 3]
                    cap, levels = N + 13, (1 << bits) - 1
                    codes = [torch.randint(0, 256, (KVH, cap, D * bits // 8), generator=g, dtype=torch.uint8)
                             for _ in range(2)]
                    scale = [(torch.rand(KVH, cap, D // group, generator=g) * 3 / levels + 1e-3).half() for _ in range(2)]
                    bias = [(torch.rand(KVH, cap, D // group, generator=g) * -3).half() for _ in range(2)]
                    q = torch.randn(KVH * rep, D, generator=g) * 1.5
                    R = 2 if i % 2 else 0
                    dense = [torch.randn(KVH, R, D, generator=g).half().to(dev) for _ in range(2)] if R else [None, None]
                    args = [q.to(dev), codes[0].to(dev), scale[0].to(dev), bias[0].to(dev), codes[1].to(dev),
                            scale[1].to(dev), bias[1].to(dev), bits, group, D ** -0.5]
                    kw = dict(rep=rep, dk=dense[0], dv=dense[1], valid=torch.tensor([True, False], device=dev) if R else None)
                    if i % 4 < 2:
                        kw["n_rows"] = torch.tensor([N], device=dev)
                    else:
                        for j in range(1, 7):
                            args[j] = args[j][:, :N]
                    tag = f"b{bits}/g{group}/d{D}/rep{rep}/n{N}/r{R}"
                    ref = affine_decode_attention_ref(*args, **kw)
                    got = affine_decode_attention(*args, f16=False, **kw)
                    out["fp32/" + tag] = [float((got - ref).abs().max()), float(ref.abs().max()), max(D, N)]
                    if i % 3 == 1 or gpu:  # 16-bit queries: fp16 dot operands, output in the query's dtype
                        for dt in ((torch.float16, torch.bfloat16) if gpu else (torch.float16,)):
                            args[0] = q.to(dev, dt)
                            got, ref = affine_decode_attention(*args, **kw), affine_decode_attention_ref(*args, **kw)
                            out[f"{str(dt)[6:]}/" + tag] = [float((got.float() - ref.float()).abs().max()),
                                                            float(ref.float().abs().max()), max(D, N)]
                    i += 1
elif part == "encode":
    # the fused encoder against AffineCodec.encode on the same device: codes, scales and biases bit-equal;
    # rows with constant groups, exact halves (rounding ties), large and tiny ranges; 16-bit inputs too
    for bits in (4, 8):
        for D in (64, 128):
            for group in (32, 64, 128):
                if group > D:
                    continue
                codec = AffineCodec(D, bits, group)
                x = torch.randn(2, 2, 37, D, generator=g) * 2
                x[:, :, 0] = 0.7
                x[:, :, 1] = (torch.arange(D) % (2 * ((1 << bits) - 1) + 1)) / 2
                x[:, :, 2] *= 1000
                x[:, :, 3] *= 1e-3
                # ranges whose fp16 scale differs between (hi - lo) / levels and (hi - lo) * fp32(1 / levels)
                # (torch's CPU and CUDA kernels): rows 4.. hold one such range per group (lo 0, hi d)
                levels = (1 << bits) - 1
                cand = torch.rand(1 << 20, generator=g) * 8 + 0.01
                d = cand[(cand / levels).half() != (cand * torch.tensor(1.0 / levels)).half()]
                G = D // group
                assert len(d) >= 4 * G, len(d)
                for r in range(min(8, len(d) // G)):
                    dr = d[r * G:(r + 1) * G].repeat_interleave(group).view(D)
                    x[:, :, 4 + r] = torch.rand(2, 2, D, generator=g) * dr
                    x[:, :, 4 + r, ::group] = 0.0
                    x[:, :, 4 + r, 1::group] = dr[::group]
                dt = (torch.float32, torch.float16, torch.bfloat16)[(bits + D + group) % 3]
                x = x.to(dev, dt)
                cap = 50
                enc0, enc1 = codec.encode(x[0]), codec.encode(x[1])
                store = [torch.zeros((t.shape[0], cap, t.shape[2]), dtype=t.dtype, device=dev) for e in (enc0, enc1)
                         for t in (e.planes[0], e.norms, e.signs)]
                affine_encode_rows(x[0], x[1], *store, bits, group, torch.tensor([5], device=dev))
                # a second call at an int position: rows at or past the capacity are dropped
                affine_encode_rows(x[0][:, :20], x[1][:, :20], *store, bits, group, 40)
                bad = 0
                for got, want in zip(store, (enc0.planes[0], enc0.norms, enc0.signs, enc1.planes[0], enc1.norms,
                                             enc1.signs)):
                    bad += int((got[:, 5:40] != want[:, :35]).sum()) + int((got[:, 40:50] != want[:, :10]).sum())
                    bad += int((got[:, :5] != 0).sum())
                out[f"encode/b{bits}/d{D}/g{group}/{str(dt)[6:]}"] = [bad, 0.0, 0]
elif part in ("cache", "graph"):
    from swiftlm.backends.torch.compressed_cache import CompressedCache
    from swiftlm.turboquant.presets import affine
    cpu_dense = None if gpu else torch.float16  # the runner's choice: fp16 16-bit rows under an fp32 model on CPU
    if part == "cache":
        # the static cache's graph-step attention (encode the row at n_code, attend it in 16 bits) and the
        # eager cache's kernel path against the eager cache's plain-torch path; codes stay bit-equal
        a = SimpleNamespace(layers=1, kv_heads=2, heads=8, head_dim=64)
        for bits, gs in ((4, 32), (8, 64)):
            fmt = affine(bits, gs)
            st = CompressedCache(a, fmt, torch.float32, torch.device(dev), dense_dtype=cpu_dense, capacity=200)
            dy = CompressedCache(a, fmt, torch.float32, torch.device(dev), dense_dtype=cpu_dense)
            kt = CompressedCache(a, fmt, torch.float32, torch.device(dev), dense_dtype=cpu_dense)
            kt.use_triton = True
            pos, worst, worst_k, mag, same = 0, 0.0, 0.0, 0.0, True
            for T in [37, 1, 1, 1, 50, 1, 1]:
                q, k, v = (torch.randn(n, T, 64, generator=g).to(dev) for n in (8, 2, 2))
                ref = dy.update_attend(0, pos, q, k, v)
                worst_k = max(worst_k, float((kt.update_attend(0, pos, q, k, v) - ref).abs().max()))
                if T == 1:
                    st.truncate(st.layers[0], pos)
                    o = st.attend_static(0, q[:, 0], torch.tensor([st.layers[0].n_code], device=dev), None, k=k, v=v)
                    st.after_graph_step(pos)
                    worst = max(worst, float((o - ref).abs().max()))
                else:
                    st.update_attend(0, pos, q, k, v)
                pos += T
                mag = max(mag, float(ref.abs().max()))
                L1, L2 = st.layers[0], dy.layers[0]
                same = same and L1.n_code == L2.n_code == pos and all(
                    torch.equal(x[:, :pos], y[:, :pos]) for x, y in ((L1.kp[0], L2.kp[0]), (L1.kn, L2.kn), (L1.ks, L2.ks),
                                                                      (L1.vp[0], L2.vp[0]), (L1.vn, L2.vn), (L1.vb, L2.vb)))
            out[f"cache/static/{fmt.name}"] = [worst, mag, pos, int(same)]
            out[f"cache/kernel/{fmt.name}"] = [worst_k, mag, pos, 1]
    else:
        # a tiny model decoding through GraphDecoder.run_turbo over a static affine cache (graph replays on a
        # GPU, eager under the interpreter) against the eager cache's plain path, across a rollback
        from swiftlm.backends.torch.model import Transformer
        from swiftlm.backends.torch.model_config import Args
        from swiftlm.backends.torch.graphs import GraphDecoder
        cfg = dict(model_type="llama", hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=256, vocab_size=512, rms_norm_eps=1e-5,
                   rope_theta=10000.0, max_position_embeddings=512, tie_word_embeddings=True)
        torch.manual_seed(0)
        with torch.device(dev):
            model = Transformer(Args.from_config(cfg))
        with torch.no_grad():
            for p_ in model.parameters():
                p_.normal_(0, 0.05)
        model.eval(); model.init_rope()
        with torch.no_grad():
            for blk in model.layers:
                blk.self_attn.fuse(); blk.mlp.fuse()
        for bits in ((4, 8) if gpu else (4,)):
            fmt = affine(bits, 32)
            st = CompressedCache(model.a, fmt, torch.float32, torch.device(dev), dense_dtype=cpu_dense, capacity=512)
            st.use_triton = True
            dy = CompressedCache(model.a, fmt, torch.float32, torch.device(dev), dense_dtype=cpu_dense)
            gd = GraphDecoder(model, torch.device(dev))
            toks = torch.randint(0, 512, (150,), generator=torch.Generator().manual_seed(1)).tolist()
            worst, mag = 0.0, 0.0
            with torch.inference_mode():
                for c in (st, dy):
                    model(torch.tensor(toks[:60], device=dev), c, 0)
                pos = 60
                for step in range(40 if gpu else 10):
                    if step == 5:
                        pos -= 3  # roll back three positions (a rejected speculative tail)
                    a_ = gd.run_turbo(st, toks[pos], pos)
                    b_ = model(torch.tensor([toks[pos]], device=dev), dy, pos)[-1]
                    worst, mag = max(worst, float((a_ - b_).abs().max())), max(mag, float(b_.abs().max()))
                    pos += 1
            out[f"graph/{fmt.name}"] = [worst, mag, pos, int(st.counts() == dy.counts() == (pos, 0)),
                                        int(st.graphable() and gd.fused)]
print(json.dumps(out))
"""


def _run_affine(device: str, part: str, interpret: bool) -> dict:
    import json

    env = dict(os.environ)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run(
        [sys.executable, "-c", AFFINE_CODE, device, part],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res, part
    return res


def _check_affine(name: str, vals: list) -> None:
    from types import SimpleNamespace

    from tolerances import transformer_logits_tol

    err, mag = vals[0], vals[1]
    if name.startswith("fp32/"):
        # the same codes on both sides, fp32 against float64: dequantization, Q.K^T (D terms), the
        # softmax sum and P.V (N terms), the split merge: 5 chained fp32 reductions of length <= max(D, N)
        assert err <= fp32_matmul_tol(vals[2], mag, 5), (name, err, mag)
    elif name.startswith(("float16/", "bfloat16/")):
        # 16-bit queries: fp16 dot operands (dequantized keys and values rounded once or twice, u = 2^-11,
        # p once), fp32 accumulation, the output rounded to fp16 (u) or bf16 (2^-9): 8 u of the output's
        # type, relative to the largest output
        assert err <= (4e-3 if name.startswith("float16/") else 1.6e-2) * mag, (name, err, mag)
    elif name.startswith("encode/"):
        assert err == 0, (name, err)  # bit-equal codes, scales and biases; rows past the capacity dropped
    elif name.startswith("cache/"):
        # one decode row over <= 92 rows: both paths dequantize the same codes (the kernel as code * scale
        # + bias per coordinate, the torch path as scale * (q . codes) + bias * sum(q) per group) and sum in
        # other orders, fp32: 5 chained reductions as above; the codes the two caches hold are bit-equal
        assert err <= fp32_matmul_tol(max(vals[2], 64), mag, 5) and vals[3] == 1, (name, vals)
    elif name.startswith("graph/"):
        # fp32 logits of a 2-layer model: the attention difference above (fp32 summation orders) carried
        # through the layers; the caches hold the same rows (counts equal, rollback included)
        a = SimpleNamespace(
            hidden=128, heads=4, head_dim=32, intermediate=256, moe_intermediate=0, shared_intermediate=0, layers=2
        )
        assert err <= transformer_logits_tol(a, mag, vals[2]) and vals[3] == 1 and vals[4] == 1, (name, vals)
    else:
        raise AssertionError(name)


@triton_missing
@pytest.mark.parametrize("part", ["kernel", "encode", "cache", "graph"])
def test_affine_kv_kernels_interpreted(part):
    """The affine ``kv_bits`` kernels (cuda_ext/affine_kv_kernels.py) under TRITON_INTERPRET=1 on CPU:
    decode attention against the float64 reference (bits 4/8, groups 32/64/128, head_dim 64/128, GQA rep 1
    and 4, 1 / 37 / 1000 rows, the row count on the device below the storage's); the fused encoder
    bit-equal to ``AffineCodec.encode``; a static affine cache's graph step and the eager kernel path
    against the eager plain-torch path; a tiny model through ``GraphDecoder.run_turbo``."""
    for name, vals in _run_affine("cpu", part, interpret=True).items():
        _check_affine(name, vals)


@pytest.mark.skipif("not __import__('torch').cuda.is_available()", reason="no CUDA GPU on this machine")
@pytest.mark.parametrize("part", ["kernel", "encode", "cache", "graph"])
def test_affine_kv_kernels_on_gpu(part):
    """The same on a GPU (bf16 queries too; the encoder against torch's CUDA division; graph replays)."""
    for name, vals in _run_affine("cuda", part, interpret=False).items():
        _check_affine(name, vals)
