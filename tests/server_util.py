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
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "swiftlm.cli", "serve", "--port", str(self.port), "--log-level", "warning", *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env=env,
        )
        self.ready: dict | None = None
        self.stdout_lines: list[str] = []
        self.stderr_lines: list[str] = []  # drained continuously: a full pipe would block the server
        got = threading.Event()

        def reader():
            for line in self.proc.stdout:
                self.stdout_lines.append(line)
                if line.startswith("{") and '"ready"' in line:
                    self.ready = json.loads(line)
                    got.set()
            got.set()

        def err_reader():
            for line in self.proc.stderr:
                self.stderr_lines.append(line)

        threading.Thread(target=reader, daemon=True).start()
        self._err_thread = threading.Thread(target=err_reader, daemon=True)
        self._err_thread.start()
        deadline = time.time() + timeout
        while not got.wait(0.2):
            if time.time() > deadline or self.proc.poll() is not None:
                break
        if self.ready is None:
            self.stop()
            raise RuntimeError(f"server did not become ready: {self.stderr_tail()}")

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(20)
        self._err_thread.join(5)
        return self.proc.returncode

    def stderr_tail(self, n: int = 4000) -> str:
        """The end of what the server wrote to stderr (for assertion messages)."""
        self._err_thread.join(0.5) if self.proc.poll() is not None else None
        return "".join(self.stderr_lines)[-n:]
