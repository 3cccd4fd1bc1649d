"""Screenshots of the built-in chat page for the docs: docs/images/webui-desktop.png and webui-phone.png.

Starts `swiftlm serve` on the bundled model (or uses --url), asks one question through the page with
Playwright driving the system Chromium, and saves the page at desktop and phone width.

    .venv/bin/python scripts/webui_screenshots.py [--url http://127.0.0.1:5413] [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
QUESTION = "Show me how to reverse a list in Python, with a short example."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "swiftlm.cli", "serve", "--model", model, "--port", str(port), "--log-level", "warning"],
        stdout=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false"),
    )
    for line in proc.stdout:  # the ready line
        if line.startswith("{") and json.loads(line).get("event") == "ready":
            return proc, f"http://127.0.0.1:{port}"
    raise SystemExit(f"the server exited before it was ready (code {proc.wait()})")


def shoot(base: str, out: Path, chromium: str) -> None:
    from playwright.sync_api import sync_playwright

    out.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        page = browser.new_page(viewport={"width": 1280, "height": 800})
        page.set_default_timeout(900_000)  # a busy CPU can take minutes
        page.goto(base + "/")
        page.evaluate("localStorage.setItem('swiftlm.settings.v1', JSON.stringify({temperature: 0, max_tokens: 200}))")
        page.reload()
        page.wait_for_selector("body[data-ready=true]")
        page.fill("#prompt", QUESTION)
        page.keyboard.press("Enter")
        page.wait_for_selector(".msg.assistant .stats:not([hidden])")
        page.evaluate("document.activeElement.blur()")
        page.screenshot(path=str(out / "webui-desktop.png"))
        page.set_viewport_size({"width": 390, "height": 844})
        page.evaluate("document.getElementById('log').scrollTop = 0")
        page.screenshot(path=str(out / "webui-phone.png"))
        browser.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", help="a running server (default: start one on the bundled model)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="the model to serve when starting a server")
    ap.add_argument("--out", default=str(ROOT / "docs" / "images"), help="folder for the PNGs")
    ap.add_argument("--chromium", default=shutil.which("chromium") or "/usr/bin/chromium")
    args = ap.parse_args()
    if not Path(args.chromium).exists():
        print(f"no Chromium at {args.chromium}: apt-get install chromium (scripts/test.sh does)", file=sys.stderr)
        return 2
    proc = None
    base = args.url
    if base is None:
        proc, base = start_server(args.model)
    try:
        t = time.time()
        shoot(base.rstrip("/"), Path(args.out), args.chromium)
        print(f"wrote {args.out}/webui-desktop.png and webui-phone.png in {time.time() - t:.0f} s")
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
