#!/usr/bin/env python3
"""torch backend on a CUDA GPU: decode tok/s of Llama-shaped bf16 models (random weights)
next to transformers' ``generate`` on the very same weight tensors and next to the roofline
(weight bytes / measured device-to-device copy bandwidth).  Batch 1, 128-token prompt,
128 new tokens, greedy.  Also checks that CUDA-graph decoding gives the same tokens as the
eager fixed-shape path, and how close our first-step logits are to transformers'.

    python scripts/bench_torch_gpu.py [--shapes 1b,8b] [--out DIR]

Runs without installing the package (the device machine has torch and transformers but
not our other dependencies): the repository root is put on sys.path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import backends  # noqa: E402  (installed as swiftlm.backends; alias it for a source checkout)
import cuda_ext  # noqa: E402

sys.modules.setdefault("swiftlm.backends", backends)
sys.modules.setdefault("swiftlm.cuda_ext", cuda_ext)

import torch  # noqa: E402

SHAPES = {  # Llama-3.2-1B and Llama-3.1-8B shapes
    "1b": dict(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        head_dim=64,
    ),
    "8b": dict(
        hidden_size=4096,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=14336,
        vocab_size=128256,
        tie_word_embeddings=False,
        head_dim=128,
    ),
}


def _token(tm, work) -> int:
    """One engine step for one sequence: the model's forward, then the core's batched sampler."""
    from swiftlm.backend import StepBatch
    from swiftlm.sampler import Row, launch

    fwd = tm.forward(StepBatch([work]))
    return launch(tm.ops, fwd.logits, [Row(work.params, work.state)]).finish()[0].token


def copy_bandwidth() -> float:
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    a = torch.randn(n, device="cuda", dtype=torch.bfloat16)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    times = []
    for _ in range(10):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        b.copy_(a)
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    del a, b
    torch.cuda.empty_cache()
    return 2 * n * 2 / statistics.median(times)  # bytes read + written per second


class _Tok:
    vocab_size = 128256
    eos_token_ids: set = set()


def run_shape(name: str, prompt_len: int, new: int, bw: float) -> dict:
    import transformers

    from swiftlm.backend import ModelInfo, SeqWork
    from swiftlm.backends.torch.build import build
    from swiftlm.backends.torch.runner import TorchModel
    from swiftlm.sampling import SamplerState, SamplingParams

    cfg = dict(
        SHAPES[name],
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    hf_cfg = transformers.LlamaConfig(**cfg)
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16).eval()
    with torch.no_grad():  # weights with a realistic spread (init is fine, but make norms non-trivial)
        for n_, p in ref.named_parameters():
            if "norm" in n_:
                p.normal_(1.0, 0.05)
    state = {k: v for k, v in ref.state_dict().items()}
    weight_bytes = sum(v.numel() * v.element_size() for k, v in ref.named_parameters())
    ours = build(cfg, state, torch.bfloat16, torch.device("cuda"))
    info = ModelInfo("llama", cfg["num_hidden_layers"], 1024, cfg["vocab_size"], 0, "bf16")
    tm = TorchModel(ours, _Tok(), info, torch.device("cuda"), torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 128000, (prompt_len,), generator=g).tolist()

    from swiftlm.backends.torch.graphs import GraphDecoder

    variants = {
        "graph+triton": GraphDecoder(ours, torch.device("cuda"), fused=True),
        "graph, plain torch": GraphDecoder(ours, torch.device("cuda"), fused=False),
        "no graph, triton": GraphDecoder(ours, torch.device("cuda"), use_graph=False, fused=True),
    }

    def ours_decode(variant: str) -> tuple[float, float, list[int]]:
        tm.graphs = variants[variant]
        p = SamplingParams(temperature=0, max_tokens=new)
        st = SamplerState(seed=0)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        toks = [_token(tm, SeqWork(1, prompt, 0, True, p, st))]
        t1 = time.perf_counter()
        for i in range(new - 1):
            toks.append(_token(tm, SeqWork(1, [toks[-1]], prompt_len + i, True, p, st)))
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        tm.free([1])
        return t1 - t0, (new - 1) / (t2 - t1), toks

    class Timer(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            torch.cuda.synchronize()
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def ref_decode() -> tuple[float, float, list[int]]:
        x = torch.tensor([prompt], device="cuda")
        timer = Timer()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ref.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                streamer=timer,
                pad_token_id=0,
            )
        ts = timer.times[1:]
        return ts[0] - t0, (len(ts) - 1) / (ts[-1] - ts[0]), out[0, prompt_len:].tolist()

    # correctness: first-step logits vs transformers; graph vs eager fixed-shape tokens
    with torch.inference_mode():
        lo = tm.logits(99, prompt, 0).float()
        tm.free([99])
        lr = ref(torch.tensor([prompt], device="cuda")).logits[0, -1].float()
    rel = float((lo - lr).norm() / lr.norm())
    results = {}
    for v in variants:
        ours_decode(v)  # warm-up (+ graph capture)
        results[v] = [ours_decode(v) for _ in range(3)]
    graph_tokens = results["graph+triton"][0][2]
    ref_decode()  # warm-up
    ref_runs = [ref_decode() for _ in range(2)]
    tps = {v: statistics.median(r[1] for r in rs) for v, rs in results.items()}
    ref_tps = statistics.median(r[1] for r in ref_runs)
    roof = bw / weight_bytes
    out = {
        "shape": name,
        "weight_bytes": weight_bytes,
        "roofline_tok_s": roof,
        "swiftlm_tok_s": tps["graph+triton"],
        "variants_tok_s": tps,
        "transformers_tok_s": ref_tps,
        "fraction_of_roofline": tps["graph+triton"] / roof,
        "speedup_vs_transformers": tps["graph+triton"] / ref_tps,
        "swiftlm_ttft_s": statistics.median(r[0] for r in results["graph+triton"]),
        "transformers_ttft_s": statistics.median(r[0] for r in ref_runs),
        "graph_equals_eager_tokens": graph_tokens == results["no graph, triton"][0][2],
        "greedy_agree_with_transformers_prefix": next(
            (i for i, (a, b) in enumerate(zip(graph_tokens, ref_runs[0][2])) if a != b), new
        ),
        "first_step_logits_rel_err": rel,
        "graph_captures": variants["graph+triton"].captures,
    }
    del ref, ours, tm, state
    torch.cuda.empty_cache()
    return out


def fp32_agreement(new: int = 32) -> dict:
    """1B shape in fp32 on both sides (TF32 off): our graph+triton decode against transformers
    token for token; bf16 runs differ in rounding, so exactness is shown here."""
    import transformers

    from swiftlm.backend import ModelInfo, SeqWork
    from swiftlm.backends.torch.build import build
    from swiftlm.backends.torch.runner import TorchModel
    from swiftlm.sampling import SamplerState, SamplingParams

    torch.backends.cuda.matmul.allow_tf32 = False
    cfg = dict(
        SHAPES["1b"],
        model_type="llama",
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        max_position_embeddings=8192,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        ref = transformers.AutoModelForCausalLM.from_config(transformers.LlamaConfig(**cfg), dtype=torch.float32).eval()
        with torch.no_grad():
            for p in ref.parameters():
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5) if p.dim() == 2 else p.normal_(1.0, 0.05)
    ours = build(cfg, dict(ref.state_dict()), torch.float32, torch.device("cuda"))
    tm = TorchModel(ours, _Tok(), ModelInfo("llama", 16, 1024, 128256, 0, "fp32"), torch.device("cuda"), torch.float32)
    prompt = torch.randint(0, 128000, (128,), generator=torch.Generator().manual_seed(2)).tolist()
    p, st = SamplingParams(temperature=0, max_tokens=new), SamplerState(seed=0)
    with torch.inference_mode():
        toks = [_token(tm, SeqWork(1, prompt, 0, True, p, st))]
        for i in range(new - 1):
            toks.append(_token(tm, SeqWork(1, [toks[-1]], 128 + i, True, p, st)))
        x = torch.tensor([prompt], device="cuda")
        hf = ref.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            pad_token_id=0,
        )[0, 128:].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(toks, hf)) if a != b), new)
    out = {
        "fp32_tokens_compared": new,
        "fp32_greedy_agree_prefix": agree,
        "fp32_fused_kernels": tm.graphs.fn.__name__ if tm.graphs else None,
    }
    del ref, ours, tm
    torch.cuda.empty_cache()
    torch.backends.cuda.matmul.allow_tf32 = True
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_results"))
    a = ap.parse_args()
    import transformers

    from swiftlm.cuda_ext.selfcheck import check_all

    kernel_errs = {dt: check_all("cuda", getattr(torch, dt), seed=s_) for dt in ("float32", "bfloat16") for s_ in (0,)}
    print("kernel vs reference relative errors:", json.dumps(kernel_errs))
    bw = copy_bandwidth()
    fp32 = fp32_agreement()
    print("fp32 check:", json.dumps(fp32))
    rows = [run_shape(s, a.prompt, a.new, bw) for s in a.shapes.split(",")]
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "copy_bandwidth_GBps": bw / 1e9,
        "prompt_tokens": a.prompt,
        "new_tokens": a.new,
        "kernel_rel_errors": kernel_errs,
        **fp32,
    }
    Path(a.out).mkdir(parents=True, exist_ok=True)
    (Path(a.out) / "bench_torch_gpu.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    print(json.dumps(meta))
    print(
        f"{'shape':5} {'roofline':>8} {'g+triton':>8} {'g+torch':>8} {'eager':>7} {'hf':>6} {'%roof':>6} "
        f"{'x hf':>5} {'g=eager':>7} {'agree':>5} {'relerr':>7}"
    )
    for r in rows:
        v = r["variants_tok_s"]
        print(
            f"{r['shape']:5} {r['roofline_tok_s']:8.1f} {v['graph+triton']:8.1f} {v['graph, plain torch']:8.1f} "
            f"{v['no graph, triton']:7.1f} {r['transformers_tok_s']:6.1f} {100 * r['fraction_of_roofline']:5.1f}% "
            f"{r['speedup_vs_transformers']:5.1f} {str(r['graph_equals_eager_tokens']):>7} "
            f"{r['greedy_agree_with_transformers_prefix']:5d} {r['first_step_logits_rel_err']:7.1e}"
        )


if __name__ == "__main__":
    main()
