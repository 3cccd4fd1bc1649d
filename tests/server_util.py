"""Start the real server (a subprocess on a loopback port) and wait for its ready line."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

from conftest import ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProc:
    def __init__(self, *args: str, timeout: float = 180):
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "swiftlm.cli", "serve", "--port", str(self.port),
                                      "--log-level", "warning", *args], stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        self.ready: dict | None = None
        self.stdout_lines: list[str] = []
        got = threading.Event()

        def reader():
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                if line.startswith("{") and '"ready"' in line:
                    self.ready = json.loads(line)
                    got.set()
            got.set()

        threading.Thread(target=reader, daemon=True).start()
        deadline = time.time() + timeout
        while not got.wait(0.2):
            if time.time() > deadline or self.proc.poll() is not None:
                break
        if self.ready is None:
            self.stop()
            raise RuntimeError(f"server did not become ready: {self.proc.stderr.read()[-2000:]}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.returncode
