#!/usr/bin/env python3
"""torch backend decode speed vs transformers' ``generate`` on the same fp32 weights, one run.

    python scripts/bench_torch_cpu.py [--tokens 64] [--repeats 3]

Both load SmolLM2 from the bundled GGUF dequantized to fp32 (transformers through its own
GGUF loader, swiftlm through gguf-py); both decode greedily from the same prompt ids with
EOS ignored.  Prints a table (medians) and the ratio; writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", default="bench_results/bench_torch_cpu.json")
    a = ap.parse_args()

    import torch
    import transformers
    from rich.console import Console
    from rich.table import Table

    from swiftlm import LLM, SamplingParams
    from swiftlm.registry import bundled_model_path

    gguf = bundled_model_path()
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()
    llm = LLM(backend="torch")
    ids = llm.engine.chat_prompt([{"role": "user", "content": "Write a short story about a robot who paints."}])
    params = SamplingParams(max_tokens=a.tokens, temperature=0, ignore_eos=True)

    def run_ours():
        t0 = time.perf_counter()
        first = last = None
        toks = []
        for d in llm.stream(ids, params):
            if d.token_ids:
                now = time.perf_counter()
                first = first or now
                last = now
                toks += d.token_ids
        return first - t0, (len(toks) - 1) / (last - first), toks

    class Timer(transformers.generation.streamers.BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    def run_ref():
        timer = Timer()
        x = torch.tensor([ids])
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = ref.generate(
                x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=a.tokens,
                min_new_tokens=a.tokens,
                do_sample=False,
                streamer=timer,
                pad_token_id=0,
            )
        ts = timer.times[1:]  # the first put() is the prompt
        return ts[0] - t0, (len(ts) - 1) / (ts[-1] - ts[0]), out[0, len(ids) :].tolist()

    run_ours(), run_ref()  # warm up
    res = {"swiftlm": {"ttft": [], "tps": []}, "transformers": {"ttft": [], "tps": []}}
    for _ in range(a.repeats):
        for name, fn in (("transformers", run_ref), ("swiftlm", run_ours)):
            ttft, tps, _ = fn()
            res[name]["ttft"].append(ttft)
            res[name]["tps"].append(tps)
    med = {k: {m: statistics.median(v[m]) for m in v} for k, v in res.items()}
    ratio = med["swiftlm"]["tps"] / med["transformers"]["tps"]
    t = Table(
        title=f"torch CPU decode, SmolLM2-135M fp32, {len(ids)}-token prompt, {a.tokens} new, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, transformers {transformers.__version__}"
    )
    for col in ("runner", "TTFT s", "decode tok/s"):
        t.add_column(col)
    for k in ("transformers", "swiftlm"):
        t.add_row(k, f"{med[k]['ttft']:.3f}", f"{med[k]['tps']:.2f}")
    t.add_row(
        "ratio swiftlm/transformers", f"{med['swiftlm']['ttft'] / med['transformers']['ttft']:.2f}", f"{ratio:.2f}"
    )
    Console().print(t)
    out = {
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "prompt_tokens": len(ids),
        "new_tokens": a.tokens,
        "runs": res,
        "median": med,
        "decode_ratio": ratio,
    }
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.json).write_text(json.dumps(out, indent=2))
    llm.close()


if __name__ == "__main__":
    main()
