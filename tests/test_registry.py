"""--model resolution, model facts, and the one-sentence failures (exit code 2)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import HAS_MLX, run_cli

from swiftlm.errors import CorruptModel, ModelNotFound
from swiftlm.registry import DEFAULT_MODEL, resolve


def test_bundled_default_is_used_when_model_omitted():
    spec = resolve(None)
    assert spec.bundled and spec.format == "gguf" and spec.name == DEFAULT_MODEL
    assert spec.arch == "llama" and spec.context_length == 8192
    assert 130e6 < spec.num_params < 140e6  # SmolLM2-135M
    assert "Q4_1" in spec.quantization and not spec.is_moe


def test_gguf_file_and_hf_dir(bundled_gguf, tiny_llama):
    assert resolve(str(bundled_gguf)).format == "gguf"
    spec = resolve(str(tiny_llama))
    assert spec.format == "hf" and spec.arch == "llama"
    assert len(spec.weight_files) > 1  # sharded with an index
    cfg = json.loads((tiny_llama / "config.json").read_text())
    H, V, L, I = cfg["hidden_size"], cfg["vocab_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    per_layer = 2 * H + H * H * 2 + 2 * kv * H + 3 * H * I
    assert spec.num_params == V * H + H + L * per_layer


def _fake_hf_cache(root: Path, repo: str, src: Path) -> Path:
    folder = root / ("models--" + repo.replace("/", "--"))
    snap = folder / "snapshots" / ("a" * 40)
    shutil.copytree(src, snap)
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text("a" * 40)
    return snap


def test_repo_id_from_hf_cache(tmp_path, tiny_llama, monkeypatch):
    snap = _fake_hf_cache(tmp_path / "hub", "acme/tiny-llama", tiny_llama)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = resolve("acme/tiny-llama")
    assert spec.path == snap and spec.arch == "llama"


def test_repo_id_respects_hf_home(tmp_path, tiny_llama, monkeypatch):
    _fake_hf_cache(tmp_path / "home" / "hub", "acme/tiny", tiny_llama)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert resolve("acme/tiny").arch == "llama"


def test_not_found_lists_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFound) as e:
        resolve("nobody/nothing")
    msg = str(e.value)
    assert "local path" in msg and str(tmp_path / "hub") in msg and DEFAULT_MODEL in msg and "OFFLINE" in msg


@pytest.mark.parametrize("key", ["num_experts", "num_local_experts", "n_routed_experts"])
def test_moe_detection(tmp_path, tiny_llama, key):
    d = tmp_path / "m"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = 16
    cfg["num_experts_per_tok"] = 4
    (d / "config.json").write_text(json.dumps(cfg))
    spec = resolve(str(d))
    assert (spec.is_moe, spec.num_experts, spec.experts_per_token) == (True, 16, 4)


def test_vision_and_audio_detection(tmp_path, tiny_llama):
    d = tmp_path / "vlm"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["vision_config"] = {"hidden_size": 32}
    cfg["audio_config"] = {"d_model": 32}
    (d / "config.json").write_text(json.dumps(cfg))
    spec = resolve(str(d))
    assert spec.vision and spec.audio


def _truncate(src: Path, dst: Path, keep: int) -> None:
    dst.write_bytes(src.read_bytes()[:keep])


def test_truncated_safetensors(tmp_path, tiny_llama):
    d = tmp_path / "t"
    shutil.copytree(tiny_llama, d)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptModel, match="truncated"):
        resolve(str(d))


def test_corrupt_safetensors_header(tmp_path, tiny_llama):
    d = tmp_path / "c"
    shutil.copytree(tiny_llama, d)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"\xff" * 8
    shard.write_bytes(bytes(data))
    with pytest.raises(CorruptModel, match="not valid JSON"):
        resolve(str(d))


def test_missing_shard(tmp_path, tiny_llama):
    d = tmp_path / "s"
    shutil.copytree(tiny_llama, d)
    sorted(d.glob("model-*.safetensors"))[-1].unlink()
    with pytest.raises(CorruptModel, match="missing"):
        resolve(str(d))


def test_truncated_and_bad_gguf(tmp_path, bundled_gguf):
    t = tmp_path / "t.gguf"
    _truncate(bundled_gguf, t, 50_000_000)
    with pytest.raises(CorruptModel, match="truncated"):
        resolve(str(t))
    h = tmp_path / "h.gguf"
    _truncate(bundled_gguf, h, 1000)  # cut inside the metadata
    with pytest.raises(CorruptModel, match="truncated"):
        resolve(str(h))
    b = tmp_path / "b.gguf"
    b.write_bytes(b"NOPE" + bundled_gguf.read_bytes()[4:4096])
    with pytest.raises(CorruptModel, match="not a GGUF"):
        resolve(str(b))


# ---- the same failures through the CLI: one sentence on stderr, exit code 2, no traceback
def _assert_clean_failure(r, *needles):
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr
    line = r.stderr.strip()
    assert line.startswith("swiftlm: error:") and "\n" not in line
    for n in needles:
        assert n in line


def test_cli_not_found(tmp_path):
    r = run_cli("info", "--model", str(tmp_path / "missing"), env={"HF_HUB_CACHE": str(tmp_path / "hub")})
    _assert_clean_failure(r, "not found", "looked in")
    r = run_cli(
        "info", "--model", "org/missing-model", env={"HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    )
    _assert_clean_failure(r, "not found", str(tmp_path / "hub"))


def test_cli_truncated_gguf(tmp_path, bundled_gguf):
    t = tmp_path / "t.gguf"
    _truncate(bundled_gguf, t, 60_000_000)
    _assert_clean_failure(run_cli("info", "--model", str(t)), "truncated")


def test_cli_corrupt_safetensors(tmp_path, tiny_llama):
    d = tmp_path / "t"
    shutil.copytree(tiny_llama, d)
    shard = sorted(d.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    _assert_clean_failure(run_cli("info", "--model", str(d)), "truncated")


@pytest.mark.skipif(not HAS_MLX, reason="mlx / mlx-lm not installed on this machine")
def test_cli_unsupported_architecture(tmp_path, tiny_llama):
    d = tmp_path / "u"
    shutil.copytree(tiny_llama, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "frobnicator"
    (d / "config.json").write_text(json.dumps(cfg))
    r = run_cli("generate", "--backend", "mlx", "--model", str(d), "-p", "hi", "--max-tokens", "1")
    _assert_clean_failure(r, "'frobnicator' is not supported", "supported:", "llama", "qwen3_moe")
