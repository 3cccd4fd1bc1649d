"""The fused decode steps (``backends/torch/fused_decode.py``: rope + KV write, add + RMSNorm and
SiLU * up as Triton kernels) against the unfused torch steps they replace, on CPU tensors under
TRITON_INTERPRET=1 in a subprocess (the flag must be set before triton is imported): the batched
step over a slot pool (with the paged attention kernel and with gather + SDPA) and the one-sequence
step (its cache read by the same kernel as a one-slot pool, and by SDPA), for a llama checkpoint and a Qwen3 one (q/k norms between the QKV matmul and the rope kernel).
fp32 both ways, so the two differ by rounding only: the logits within ``transformer_logits_tol``, the
greedy token the same, every KV row written within rounding of the other path's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
from conftest import make_ckpt, needs_torch
from tolerances import transformer_logits_tol

pytestmark = [
    needs_torch,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec("triton") is None, reason="triton not installed on this machine"
    ),
]

SCRIPT = textwrap.dedent("""
    import json, sys, torch
    from swiftlm.registry import resolve
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.backends.torch.graphs import GraphDecoder, SlotPool, decode_batch_static, decode_static
    from swiftlm.backends.torch.fused_decode import decode_batch_static_fused, decode_static_fused, fusable
    from swiftlm.backends.torch.kv_cache import SeqCache
    torch.manual_seed(0)
    tm = load_model(resolve(sys.argv[1]), None)
    m = tm.module
    a = m.a
    assert fusable(m)
    assert GraphDecoder(m, torch.device("cpu"), use_graph=False).batch_fn is decode_batch_static_fused
    C = 96
    def pool():
        p = SlotPool(a, 4, C, torch.float32, torch.device("cpu"))
        g = torch.Generator().manual_seed(1)
        for t in p.k + p.v:  # every slot filled with random history
            t.copy_(torch.randn(t.shape, generator=g))
        return p
    slots = torch.tensor([2, 0, 3, 4])          # 4 = the scratch slot: a padding row
    pos = torch.tensor([0, 37, C - 1, 0])       # lengths 1, 38, 96 (a full slot) and padding
    toks = torch.tensor([5, 17, 123, 0])
    ar = torch.arange(a.ctx)
    out = {"batch": [], "single": []}
    with torch.inference_mode():
        for splits in (0, 2):
            p1, p2 = pool(), pool()
            ref = decode_batch_static(m, p1, toks, slots, pos, C, ar, splits)[:3]
            got = decode_batch_static_fused(m, p2, toks, slots, pos, C, ar, splits)[:3]
            kv = max(float((x - y).abs().max()) for x, y in zip(p1.k + p1.v, p2.k + p2.v))
            out["batch"].append(dict(splits=splits, err=float((got - ref).abs().max()), scale=float(ref.abs().max()),
                                     argmax_equal=bool((got.argmax(-1) == ref.argmax(-1)).all()), kv_err=kv))
        for p, splits in ((0, 0), (40, 0), (0, 2), (40, 2)):  # SDPA, then the Triton kernel over a one-slot pool
            caches = []
            for _ in range(2):
                c = SeqCache(a, torch.float32, torch.device("cpu"), capacity=C)
                c.k = [torch.randn(a.kv_heads, C, a.head_dim, generator=torch.Generator().manual_seed(i))
                       for i in range(a.layers)]
                c.v = [torch.randn(a.kv_heads, C, a.head_dim, generator=torch.Generator().manual_seed(100 + i))
                       for i in range(a.layers)]
                caches.append(c)
            t, q = torch.tensor([9]), torch.tensor([p])
            ref = decode_static(m, caches[0], t, q, C, ar)
            got = decode_static_fused(m, caches[1], t, q, C, ar, splits)
            kv = max(float((x - y).abs().max()) for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v))
            out["single"].append(dict(pos=p, splits=splits, err=float((got - ref).abs().max()), scale=float(ref.abs().max()),
                                      argmax_equal=bool(got.argmax() == ref.argmax()), kv_err=kv))
        # a static TurboQuant cache (compressed rows + 16-bit buffer): the fused one-sequence step against
        # the unfused one, both reading the codes through the (interpreted) packed-code kernel
        from swiftlm.backends.torch.compressed_cache import CompressedCache
        from swiftlm.backends.torch.graphs import decode_turbo_static
        from swiftlm.backends.torch.fused_decode import decode_turbo_static_fused
        from swiftlm.turboquant.presets import parse_turbo
        tcs = []
        for _ in range(2):
            c = CompressedCache(a, parse_turbo("k4v3", window=8), torch.float32, torch.device("cpu"), capacity=128)
            c.use_triton = c.kc.use_triton = c.vc.use_triton = True
            m(torch.arange(1, 61) % a.vocab, c, 0)
            tcs.append(c)
        L0 = tcs[0].layers[0]
        nd, nc = torch.tensor([L0.n_dense]), torch.tensor([L0.n_code])
        t, q = torch.tensor([9]), torch.tensor([60])
        ref = decode_turbo_static(m, tcs[0], t, q, nd, nc, ar)
        got = decode_turbo_static_fused(m, tcs[1], t, q, nd, nc, ar)
        kv = max(float((x.dk - y.dk).abs().max().item() + (x.dv - y.dv).abs().max().item())
                 for x, y in zip(tcs[0].layers, tcs[1].layers))
        out["turbo"] = dict(n_code=L0.n_code, n_dense=L0.n_dense, err=float((got - ref).abs().max()),
                            scale=float(ref.abs().max()), argmax_equal=bool(got.argmax() == ref.argmax()), kv_err=kv)
    out["args"] = dict(hidden=a.hidden, heads=a.heads, head_dim=a.head_dim, intermediate=a.intermediate,
                       layers=a.layers, vocab=a.vocab)
    print(json.dumps(out))
""")


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory):
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "qwen3", "--arch", "qwen3", "--dtype", "float32", "--shard-mb", "4"
    )


@pytest.mark.parametrize("ckpt", ["tiny_llama", "tiny_qwen3"])
def test_fused_decode_equals_unfused(ckpt, request):
    path = request.getfixturevalue(ckpt)
    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", SCRIPT, str(path)], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])

    class A:  # transformer_logits_tol reads our Args' field names
        pass

    a = A()
    for k, v in res["args"].items():
        setattr(a, k, v)
    a.moe_intermediate = a.shared_intermediate = 0
    assert len(res["batch"]) == 2 and len(res["single"]) == 4
    assert res["turbo"]["n_code"] > 0 and res["turbo"]["n_dense"] > 0, res["turbo"]  # both parts are read
    for case in res["batch"] + res["single"] + [res["turbo"]]:
        # fp32 both ways, rounded in other places: the logits' error is that of another summation order
        assert case["err"] <= transformer_logits_tol(a, case["scale"], context=96), case
        assert case["argmax_equal"], case
        # the KV rows written (rotated k, v) are elementwise results of the same qkv: within a few ulps of
        # the inputs' scale (the random history elsewhere in the pool is untouched, difference 0)
        assert case["kv_err"] <= 1e-4, case
