"""`swiftlm download` / `models` / `rm` against a stand-in for the Hugging Face hub on loopback.

The stand-in implements what huggingface_hub's snapshot_download asks for (read from its source):
  GET  /api/models/{id}/revision/{rev}        model info: {"id", "sha", "siblings"}
  GET  /api/models/{id}/tree/{commit}         the file list (type, path, size, oid, lfs)
  HEAD /{id}/resolve/{rev}/{file}             X-Repo-Commit, ETag; LFS files: a redirect carrying X-Linked-Etag
                                              and X-Linked-Size, as the hub answers for them
  GET  /{id}/resolve/{rev}/{file}, /cdn/...   the bytes, with HTTP Range for resumed downloads
Errors carry the hub's X-Error-Code header (RepoNotFound, RevisionNotFound, GatedRepo), which huggingface_hub
maps to its exceptions.  A private repo answers 401 unless `Authorization: Bearer <token>` matches.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

COMMIT = "a" * 40
TOKEN = "hf_test_token_123"


def _safetensors(n: int = 64) -> bytes:
    data = struct.pack("<f", 0.5) * (n * n)
    header = json.dumps(
        {"model.embed_tokens.weight": {"dtype": "F32", "shape": [n, n], "data_offsets": [0, len(data)]}}
    ).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + data


def _repo_files(model_type: str) -> dict[str, bytes]:
    cfg = {
        "model_type": model_type,
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "vocab_size": 64,
        "max_position_embeddings": 256,
    }
    return {
        "config.json": json.dumps(cfg).encode(),
        "model.safetensors": _safetensors(),
        "tokenizer.json": b'{"version": "1.0"}',
        "README.md": b"# a test model\n",
    }


class FakeHub:
    """Repos: {repo_id: {"files": {path: bytes}, "private": bool, "gated": bool}}."""

    LFS = (".safetensors", ".gguf", ".bin")

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.requests: list[tuple[str, str, dict]] = []
        self.cut_first_get: set[str] = set()  # files whose first full GET is cut off halfway
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):  # quiet
                pass

            def do_HEAD(self):
                hub.handle(self, head=True)

            def do_GET(self):
                hub.handle(self, head=False)

        # The API on 127.0.0.1; LFS bytes from a second loopback address, a host of its own as the hub's CDN is
        # (huggingface_hub follows a redirect to the same host for metadata, not one to a CDN host).
        self.servers = [ThreadingHTTPServer(("127.0.0.1", 0), Handler), ThreadingHTTPServer(("127.0.0.2", 0), Handler)]
        self.url = f"http://127.0.0.1:{self.servers[0].server_address[1]}"
        self.cdn = f"http://127.0.0.2:{self.servers[1].server_address[1]}"
        for srv in self.servers:
            threading.Thread(target=srv.serve_forever, daemon=True).start()

    def close(self):
        for srv in self.servers:
            srv.shutdown()
            srv.server_close()

    # ------------------------------------------------------------------ responses
    def _send(self, h, status, body=b"", headers=None, head=False):
        h.send_response(status)
        hdrs = {"Content-Length": str(len(body)), **(headers or {})}
        for k, v in hdrs.items():
            h.send_header(k, v)
        h.end_headers()
        if not head and body:
            h.wfile.write(body)

    def _json(self, h, obj, head=False):
        self._send(h, 200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, head)

    def _error(self, h, status, code, msg, head=False):
        self._send(
            h,
            status,
            json.dumps({"error": msg}).encode(),
            {"Content-Type": "application/json", "X-Error-Code": code, "X-Error-Message": msg},
            head,
        )

    @staticmethod
    def _oid(data: bytes) -> str:
        return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()

    def _repo(self, h, repo_id, head):
        repo = self.repos.get(repo_id)
        if repo is None:
            self._error(h, 404, "RepoNotFound", "Repository not found", head)
            return None
        auth = h.headers.get("Authorization", "")
        if repo.get("private") and auth != f"Bearer {TOKEN}":
            self._error(h, 401, "RepoNotFound", "Repository not found", head)
            return None
        if repo.get("gated") and auth != f"Bearer {TOKEN}":
            self._error(h, 403, "GatedRepo", "Access to this model is restricted", head)
            return None
        return repo

    def _body(self, h, data: bytes, etag: str, key: str, head: bool, extra=None):
        rng = h.headers.get("Range")
        headers = {"ETag": f'"{etag}"', "Accept-Ranges": "bytes", **(extra or {})}
        if rng and rng.startswith("bytes="):
            start = int(rng[6:].split("-")[0])
            part = data[start:]
            headers["Content-Range"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
            self._send(h, 206, part, headers, head)
            return
        if not head and key in self.cut_first_get:
            self.cut_first_get.discard(key)
            h.send_response(200)
            for k, v in {**headers, "Content-Length": str(len(data))}.items():
                h.send_header(k, v)
            h.end_headers()
            h.wfile.write(data[: len(data) // 2])
            h.wfile.flush()
            h.close_connection = True
            import socket

            h.connection.shutdown(socket.SHUT_RDWR)
            return
        self._send(h, 200, data, headers, head)

    def handle(self, h, head: bool):
        from urllib.parse import unquote, urlparse

        path = unquote(urlparse(h.path).path)
        self.requests.append((h.command, path, {k.lower(): v for k, v in h.headers.items()}))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] in ("revision", "tree"):
            repo_id, kind, rev = f"{parts[2]}/{parts[3]}", parts[4], parts[5]
            repo = self._repo(h, repo_id, head)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                return
            files = repo["files"]
            if kind == "revision":
                self._json(
                    h,
                    {
                        "id": repo_id,
                        "modelId": repo_id,
                        "sha": COMMIT,
                        "private": bool(repo.get("private")),
                        "siblings": [{"rfilename": f} for f in files],
                    },
                    head,
                )
            else:
                entries = []
                for f, data in files.items():
                    e = {"type": "file", "path": f, "size": len(data), "oid": self._oid(data)}
                    if f.endswith(self.LFS):
                        e["lfs"] = {"size": len(data), "oid": hashlib.sha256(data).hexdigest(), "pointerSize": 134}
                    entries.append(e)
                self._json(h, entries, head)
            return
        if parts[0] == "cdn" and len(parts) == 2:
            for repo in self.repos.values():
                for f, data in repo["files"].items():
                    if hashlib.sha256(data).hexdigest() == parts[1]:
                        self._body(h, data, parts[1], f, head)
                        return
            self._send(h, 404, b"", head=head)
            return
        if len(parts) >= 5 and parts[2] == "resolve":
            repo_id, rev, fname = f"{parts[0]}/{parts[1]}", parts[3], "/".join(parts[4:])
            repo = self._repo(h, repo_id, head)
            if repo is None:
                return
            if rev not in ("main", COMMIT):
                self._error(h, 404, "RevisionNotFound", f"Invalid rev id: {rev}", head)
                return
            data = repo["files"].get(fname)
            if data is None:
                self._error(h, 404, "EntryNotFound", f"{fname} does not exist", head)
                return
            common = {"X-Repo-Commit": COMMIT}
            if fname.endswith(self.LFS):
                sha = hashlib.sha256(data).hexdigest()
                self._send(
                    h,
                    302,
                    b"",
                    {
                        **common,
                        "Location": f"{self.cdn}/cdn/{sha}",
                        "X-Linked-Etag": f'"{sha}"',
                        "X-Linked-Size": str(len(data)),
                        "ETag": f'"{self._oid(data)}"',
                    },
                    head,
                )
                return
            self._body(h, data, self._oid(data), fname, head, common)
            return
        self._send(h, 404, b"", head=head)


@pytest.fixture()
def hub(tmp_path):
    h = FakeHub()
    h.repos["test-org/tiny-llama"] = {"files": _repo_files("llama")}
    h.repos["test-org/tiny-phi3"] = {"files": _repo_files("phi3")}
    h.repos["test-org/private"] = {"files": _repo_files("llama"), "private": True}
    h.repos["test-org/gated"] = {"files": _repo_files("llama"), "gated": True}
    env = {
        "HF_ENDPOINT": h.url,
        "HF_HOME": str(tmp_path / "hf"),
        "HF_HUB_OFFLINE": "0",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_ETAG_TIMEOUT": "5",
        "HF_HUB_DOWNLOAD_TIMEOUT": "5",
    }
    h.env = env
    yield h
    h.close()


def cli(hub, *args, **extra):
    import subprocess
    import sys

    from conftest import ROOT

    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("HF_TOKEN", "HF_HUB_CACHE", "SWIFTLM_OFFLINE", "HF_HUB_ENABLE_HF_TRANSFER", "HF_ENDPOINT")
    }
    env.update(hub.env, **extra)
    return subprocess.run(
        [sys.executable, "-m", "swiftlm.cli", *args], capture_output=True, text=True, timeout=120, env=env, cwd=ROOT
    )


def snapshot(hub, repo_id: str) -> Path:
    return Path(hub.env["HF_HOME"]) / "hub" / f"models--{repo_id.replace('/', '--')}" / "snapshots" / COMMIT


def one_sentence(stderr: str) -> str:
    lines = [ln for ln in stderr.strip().splitlines() if ln.startswith("swiftlm: error:")]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    return lines[0]


def test_download_models_rm_round_trip(hub):
    r = cli(hub, "download", "test-org/tiny-llama")
    assert r.returncode == 0, r.stderr
    snap = snapshot(hub, "test-org/tiny-llama")
    for f, data in hub.repos["test-org/tiny-llama"]["files"].items():
        assert (snap / f).read_bytes() == data
    assert "downloaded test-org/tiny-llama (4 files)" in r.stdout
    # the LFS file went through the redirect, as on the hub
    assert any(p.startswith("/cdn/") for _, p, _ in hub.requests)

    r = cli(hub, "download", "test-org/tiny-phi3", "--include", "*.json", "--exclude", "tokenizer*")
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in snapshot(hub, "test-org/tiny-phi3").iterdir()) == ["config.json"]

    r = cli(hub, "models", "--json")
    assert r.returncode == 0, r.stderr
    listed = {m["id"]: m for m in json.loads(r.stdout)["models"]}
    llama = listed["test-org/tiny-llama"]
    assert llama["size_bytes"] == sum(map(len, hub.repos["test-org/tiny-llama"]["files"].values()))
    assert llama["architecture"] == "llama" and llama["files"] == 4
    import importlib.util

    expect = {b for b, pkg in (("torch", "torch"), ("mlx", "mlx_lm")) if importlib.util.find_spec(pkg)}
    assert set(llama["backends"]) == expect
    phi = listed["test-org/tiny-phi3"]  # no weights downloaded: listed, with the reason it cannot run
    assert phi["backends"] == [] and "no .safetensors" in phi["note"]
    assert listed["smollm2-135m-instruct"]["source"] == "bundled"

    table = cli(hub, "models", COLUMNS="200")
    assert table.returncode == 0 and "test-org/tiny-llama" in table.stdout

    # the registry finds the downloaded model in the same cache, offline
    r = cli(hub, "info", "--json", "--model", "test-org/tiny-llama", HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["model"]["architecture"] == "llama"

    r = cli(hub, "rm", "test-org/tiny-llama")
    assert r.returncode == 0, r.stderr
    assert "removed test-org/tiny-llama" in r.stdout
    assert not snap.exists()
    r = cli(hub, "rm", "test-org/tiny-llama")
    assert r.returncode == 1 and "is not in the Hugging Face cache" in one_sentence(r.stderr)


def test_download_to_local_dir_and_revision(hub, tmp_path):
    out = tmp_path / "local"
    r = cli(hub, "download", "test-org/tiny-llama", "--revision", COMMIT, "--local-dir", str(out))
    assert r.returncode == 0, r.stderr
    assert (out / "model.safetensors").read_bytes() == hub.repos["test-org/tiny-llama"]["files"]["model.safetensors"]
    assert f"--model {out}" in r.stdout
    r = cli(hub, "download", "test-org/tiny-llama", "--revision", "v9")
    assert r.returncode == 1
    assert "has no revision 'v9'" in one_sentence(r.stderr)


def test_interrupted_file_resumes_with_a_range_request(hub):
    """The stand-in cuts the first transfer of a 27 MB weights file halfway; the download finishes by asking for
    the rest (Range: bytes=N-, N = what arrived: whole 10 MiB chunks) instead of starting again, byte-exact."""
    files = {**_repo_files("llama"), "model.safetensors": _safetensors(2600)}
    hub.repos["test-org/big"] = {"files": files}
    hub.cut_first_get.add("model.safetensors")
    r = cli(hub, "download", "test-org/big", "--include", "model.safetensors")
    assert r.returncode == 0, r.stderr
    assert (snapshot(hub, "test-org/big") / "model.safetensors").read_bytes() == files["model.safetensors"]
    ranges = [hd.get("range") for m, p, hd in hub.requests if m == "GET" and p.startswith("/cdn/")]
    assert any(rg and rg.startswith("bytes=") and rg != "bytes=0-" for rg in ranges), ranges


def test_token_private_and_gated(hub):
    r = cli(hub, "download", "test-org/private")
    assert r.returncode == 1
    assert "test-org/private was not found" in one_sentence(r.stderr) and "HF_TOKEN" in r.stderr
    r = cli(hub, "download", "test-org/gated")
    assert r.returncode == 1 and "gated" in one_sentence(r.stderr)
    r = cli(hub, "download", "test-org/private", HF_TOKEN=TOKEN)
    assert r.returncode == 0, r.stderr
    assert any(hd.get("authorization") == f"Bearer {TOKEN}" for _, _, hd in hub.requests)


def test_missing_repo_offline_and_unreachable_are_one_sentence(hub):
    r = cli(hub, "download", "test-org/nope")
    assert r.returncode == 1 and "test-org/nope was not found on" in one_sentence(r.stderr)

    r = cli(hub, "download", "test-org/tiny-llama", HF_HUB_OFFLINE="1")
    assert r.returncode == 1
    assert "downloads are off" in one_sentence(r.stderr)

    dead = "http://127.0.0.1:9"  # discard port: nothing listens, the connection is refused
    r = cli(hub, "download", "test-org/tiny-llama", HF_ENDPOINT=dead)
    assert r.returncode == 1
    assert f"could not reach {dead}" in one_sentence(r.stderr)

    r = cli(hub, "download", "not-a-repo-id")
    assert r.returncode == 2 and "is not a Hugging Face repo id" in one_sentence(r.stderr)


def test_cached_model_is_used_offline_without_the_network(hub):
    assert cli(hub, "download", "test-org/tiny-llama").returncode == 0
    n = len(hub.requests)
    r = cli(hub, "download", "test-org/tiny-llama", HF_HUB_OFFLINE="1")
    assert r.returncode == 0, r.stderr
    assert len(hub.requests) == n  # nothing asked of the hub
