"""SwiftLM replicas under Ray Serve: each Ray Serve replica is one SwiftLM server process on one
GPU (``--data-parallel 1``; Ray places and restarts them), and Ray's HTTP proxy routes clients.

    pip install "ray[serve]" "./dist/swiftlm-0.1.0-py3-none-any.whl[torch]"   # the wheel from `python -m build`
    serve run docs/deploy/ray_serve.py:app  # then POST http://127.0.0.1:8000/v1/chat/completions

Ray Serve is the cluster manager; this file only starts SwiftLM inside each replica and forwards
requests to it (streams included).  MODEL names an HF-format directory every node can read.
tests/test_data_parallel.py checks that this file compiles and that the flags it passes are ones
`swiftlm serve` accepts; Ray itself is not installed on the test machines.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

MODEL = os.environ.get("SWIFTLM_MODEL", "/models/Llama-3.1-8B-Instruct")
SERVE_ARGS = ["--parallel", "64", "--offline", "--data-parallel", "1"]  # one GPU per Ray replica

try:  # importable without Ray, so the flags above can be checked anywhere
    from ray import serve
    from starlette.requests import Request
    from starlette.responses import StreamingResponse
except ImportError:  # pragma: no cover - Ray not installed
    serve = None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SwiftLMReplica:
    def __init__(self) -> None:
        import httpx

        self.port = _free_port()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "swiftlm.cli",
                "serve",
                "--model",
                MODEL,
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                *SERVE_ARGS,
            ]
        )
        self.client = httpx.AsyncClient(base_url=f"http://127.0.0.1:{self.port}", timeout=None)
        deadline = time.time() + 1800
        while time.time() < deadline:  # /health is 503 while the model loads
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError(f"swiftlm exited with code {self.proc.returncode}")
            time.sleep(2)
        raise RuntimeError("swiftlm did not become ready")

    async def __call__(self, request: Request):
        body = await request.body()
        req = self.client.build_request(
            request.method,
            request.url.path,
            content=body,
            headers={"content-type": request.headers.get("content-type", "")},
        )
        resp = await self.client.send(req, stream=True)
        return StreamingResponse(
            resp.aiter_raw(), status_code=resp.status_code, media_type=resp.headers.get("content-type")
        )

    def check_health(self) -> None:  # Ray restarts a replica whose server died
        if self.proc.poll() is not None:
            raise RuntimeError("swiftlm exited")


if serve is not None:
    app = serve.deployment(
        SwiftLMReplica, num_replicas=2, ray_actor_options={"num_gpus": 1}, max_ongoing_requests=128
    ).bind()
