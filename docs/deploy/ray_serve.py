"""SwiftLM replicas under Ray Serve, as a file for `serve run` / `serve deploy` (needs `pip install "swiftlm[torch,ray]"`).

    SWIFTLM_MODEL=/models/Llama-3.1-8B-Instruct serve run docs/deploy/ray_serve.py:app

is the same application as

    serve run swiftlm.deploy.ray_serve:build_app model=/models/Llama-3.1-8B-Instruct replicas=2 num_gpus=1 \
        serve_args="--parallel 64 --offline"

Each replica is one `swiftlm serve` on its own GPU; the ingress routes by prompt prefix (swiftlm.deploy.ray_serve
explains the rest).  Edit ARGS below for your cluster; every key is a field of swiftlm.deploy.ray_serve.RayServeArgs.
"""

import os

from swiftlm.deploy.ray_serve import build_app

ARGS = {
    "model": os.environ.get("SWIFTLM_MODEL", "/models/Llama-3.1-8B-Instruct"),  # a directory every node can read
    "replicas": 2,
    "num_gpus": 1,  # per replica
    "serve_args": "--parallel 64 --offline",  # more `swiftlm serve` flags for every replica
}

app = build_app(ARGS)
