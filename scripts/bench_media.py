#!/usr/bin/env python3
"""Media input cost on each backend, against a text-only baseline in the same process.

    python scripts/bench_media.py [--model DIR] [--backends torch,mlx] [--repeat 3] [--json OUT]

Model: a random-weight Gemma 4 (vision + audio) written by make_checkpoint.py --arch gemma4 when
--model is not given (plumbing cost only: a real model's towers are far larger).  Per backend:
- preprocess: data: URI -> decoded -> model arrays, for a 1024x768 JPEG and a 10 s 44.1 kHz stereo WAV
- prefill: time to the first token for an image (or audio) prompt vs a text prompt of the same
  token count (the ratio is the towers' cost on top of the language model)
- decode: tokens/s after a media prompt vs after the text prompt (should match: media are prefill-only)
Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _media():
    import soundfile as sf
    from PIL import Image

    rng = np.random.default_rng(0)
    b = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (768, 1024, 3), dtype=np.uint8)).save(b, format="JPEG", quality=90)
    img = {
        "type": "image_url",
        "image_url": {"url": "data:image/jpeg;base64," + base64.b64encode(b.getvalue()).decode()},
    }
    t = np.arange(441000) / 44100
    st = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], 1).astype(np.float32) * 0.3
    a = io.BytesIO()
    sf.write(a, st, 44100, format="WAV", subtype="PCM_16")
    aud = {"type": "input_audio", "input_audio": {"data": base64.b64encode(a.getvalue()).decode(), "format": "wav"}}
    return img, aud


def bench_backend(model: str, backend: str, repeat: int, gen: int) -> dict:
    from swiftlm import LLM, SamplingParams

    llm = LLM(model, backend=backend, vision=True, audio=True)
    eng = llm.engine
    img, aud = _media()
    out: dict = {"backend": backend}
    for name, part in (("image", img), ("audio", aud)):
        msgs = [{"role": "user", "content": [{"type": "text", "text": "Describe it."}, part]}]
        pre = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            ids = eng.chat_prompt(msgs)
            pre.append(time.perf_counter() - t0)
        n = len(ids)
        # a text prompt of the same length (ordinary tokens)
        filler = eng.tokenizer.encode(" the" * (n + 8))[:n]
        p = SamplingParams(max_tokens=gen, temperature=0, ignore_eos=True)

        def run(prompt):
            t0 = time.perf_counter()
            first = None
            toks = 0
            for d in llm.stream(prompt, p):
                if d.token_ids and first is None:
                    first = time.perf_counter()
                toks += len(d.token_ids)
            end = time.perf_counter()
            return first - t0, (toks - 1) / (end - first) if toks > 1 else 0.0

        media = [run(msgs) for _ in range(repeat)]
        text = [run(list(filler)) for _ in range(repeat)]
        med = lambda xs: statistics.median(xs)  # noqa: E731
        out[name] = {
            "prompt_tokens": n,
            "preprocess_ms": med(pre) * 1e3,
            "prefill_media_ms": med([m[0] for m in media]) * 1e3,
            "prefill_text_ms": med([t[0] for t in text]) * 1e3,
            "decode_media_tok_s": med([m[1] for m in media]),
            "decode_text_tok_s": med([t[1] for t in text]),
        }
    llm.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None)
    ap.add_argument("--backends", default="torch,mlx")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:  # one backend per process: a clean allocator and thread pool for each
        print(json.dumps(bench_backend(a.model, a.child, a.repeat, a.gen)))
        return
    model = a.model
    if model is None:
        model = str(Path(tempfile.mkdtemp(prefix="swiftlm-mm-")) / "gemma4")
        subprocess.run(
            [sys.executable, str(ROOT / "scripts" / "make_checkpoint.py"), model, "--arch", "gemma4"],
            check=True,
            capture_output=True,
        )
    rows = []
    for b in a.backends.split(","):
        r = subprocess.run(
            [sys.executable, __file__, "--model", model, "--child", b, "--repeat", str(a.repeat), "--gen", str(a.gen)],
            capture_output=True,
            text=True,
        )
        if r.returncode != 0:
            print(f"{b}: failed\n{r.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(
        f"{'backend':8} {'media':6} {'tokens':>6} {'preproc ms':>10} {'prefill media ms':>16} {'prefill text ms':>15} "
        f"{'ratio':>6} {'decode media tok/s':>18} {'decode text tok/s':>17}"
    )
    for r in rows:
        for k in ("image", "audio"):
            x = r[k]
            print(
                f"{r['backend']:8} {k:6} {x['prompt_tokens']:>6} {x['preprocess_ms']:>10.1f} "
                f"{x['prefill_media_ms']:>16.1f} {x['prefill_text_ms']:>15.1f} "
                f"{x['prefill_media_ms'] / x['prefill_text_ms']:>6.2f} {x['decode_media_tok_s']:>18.1f} "
                f"{x['decode_text_tok_s']:>17.1f}"
            )
    if a.json:
        Path(a.json).write_text(json.dumps({"model": model, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
