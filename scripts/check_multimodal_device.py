#!/usr/bin/env python3
"""Multimodal checks on a GPU: the torch backend's Gemma 4 path on CUDA (bf16) against the same
checkpoint on the CPU (fp32), first-step logits for an image, a clip and both; then greedy
generation with media through the engine on CUDA.  Prints a table and writes JSON.

    python scripts/check_multimodal_device.py CKPT [--json OUT]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import time

import numpy as np


def parts():
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (240, 320, 3), dtype=np.uint8)).save(b, format="PNG")
    img = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()},
    }
    a = io.BytesIO()
    sf.write(
        a,
        (0.3 * np.sin(2 * np.pi * 440 * np.arange(16000) / 16000)).astype(np.float32),
        16000,
        format="WAV",
        subtype="FLOAT",
    )
    aud = {"type": "input_audio", "input_audio": {"data": base64.b64encode(a.getvalue()).decode(), "format": "wav"}}
    return img, aud


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    import torch

    from swiftlm import LLM, SamplingParams

    img, aud = parts()
    convs = {"image": [img], "audio": [aud], "image+audio": [img, aud]}
    rows = []
    from swiftlm.backends.torch.vlm import TorchMultimodal
    from swiftlm.config import Settings
    from swiftlm.registry import resolve

    gpu = LLM(a.ckpt, backend="torch", vision=True, audio=True)
    cpu_model = TorchMultimodal(resolve(a.ckpt), Settings(model=a.ckpt), torch.device("cpu"), torch.float32)
    print("gpu model dtype:", gpu.engine.model.dtype, gpu.engine.model.device)
    for name, ps in convs.items():
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe."}, *ps]}]
        ids_g = gpu.engine.chat_prompt(msgs)
        lc = cpu_model.forward(cpu_model.new_cache(), list(ids_g), ids_g.media).numpy()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        lg = gpu.engine.model.forward(gpu.engine.model.new_cache(), list(ids_g), ids_g.media).cpu().numpy()
        torch.cuda.synchronize()
        prefill = time.perf_counter() - t0
        scale = float(np.abs(lc).max())
        out = gpu.chat(msgs, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
        rows.append(
            {
                "media": name,
                "prompt_tokens": len(ids_g),
                "max_abs_diff": float(np.abs(lc - lg).max()),
                "max_abs_logit": scale,
                "rel": float(np.abs(lc - lg).max()) / scale,
                "argmax_equal": bool(lc.argmax() == lg.argmax()),
                "gpu_prefill_ms": prefill * 1e3,
                "gpu_tokens": len(out.outputs[0].token_ids),
            }
        )
    print(
        f"{'media':12} {'tokens':>6} {'max|diff|':>10} {'max|logit|':>10} {'rel':>8} {'argmax=':>7} {'prefill ms':>10}"
    )
    for r in rows:
        print(
            f"{r['media']:12} {r['prompt_tokens']:>6} {r['max_abs_diff']:>10.4f} {r['max_abs_logit']:>10.3f} "
            f"{r['rel']:>8.4f} {str(r['argmax_equal']):>7} {r['gpu_prefill_ms']:>10.1f}"
        )
    if a.json:
        json.dump(
            {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows},
            open(a.json, "w"),
            indent=2,
        )


if __name__ == "__main__":
    main()
