"""``swiftlm download`` / ``swiftlm models`` / ``swiftlm rm``: the Hugging Face cache, through huggingface_hub.

Downloads go through ``huggingface_hub.snapshot_download`` (its tqdm progress bars; an interrupted file is kept
as ``.incomplete`` and resumed with an HTTP range request next time), into the same cache the registry reads:
``HF_HUB_CACHE``, else ``$HF_HOME/hub``, else ``~/.cache/huggingface/hub``.  ``HF_TOKEN`` is sent when set,
``HF_HUB_OFFLINE=1`` (or ``SWIFTLM_OFFLINE=1``) forbids the network, ``HF_ENDPOINT`` names another hub.
Every failure is one sentence (``registry.HubError``, exit code 1; a malformed id is a usage error, exit code 2).
"""

from __future__ import annotations

import ast
import importlib.util
import os
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import SwiftLMError
from .registry import HubError, _first_line, _hf_cache_dir, _looks_like_repo_id, _offline, explain_hub_error


def _check_id(repo_id: str) -> None:
    if not _looks_like_repo_id(repo_id):
        raise SwiftLMError(
            f"{repo_id!r} is not a Hugging Face repo id; give it as owner/name, "
            "e.g. HuggingFaceTB/SmolLM2-135M-Instruct"
        )


def download(
    repo_id: str,
    revision: str | None = None,
    include: list[str] | None = None,
    exclude: list[str] | None = None,
    local_dir: str | None = None,
) -> Path:
    """Fetch a snapshot (or the files matching ``include`` less ``exclude``); return its local folder."""
    _check_id(repo_id)
    from huggingface_hub import snapshot_download

    try:
        path = snapshot_download(
            repo_id,
            revision=revision,
            cache_dir=str(_hf_cache_dir()),
            local_dir=local_dir,
            allow_patterns=include or None,
            ignore_patterns=exclude or None,
            local_files_only=_offline(),
            library_name="swiftlm",
        )
    except KeyboardInterrupt:
        raise
    except Exception as exc:
        raise explain_hub_error(exc, repo_id, revision) from None
    return Path(path)


# --------------------------------------------------------------------------- which backend runs what
def _literal_from_source(module: str, name: str) -> Any:
    """A module-level constant read from the module's source without importing it (no torch/mlx import)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(spec.origin).read_text())
    except (OSError, SyntaxError):
        return None
    for node in tree.body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == name for t in targets) and node.value is not None:
            try:
                return ast.literal_eval(node.value)
            except ValueError:
                return None
    return None


def _installed(pkg: str) -> bool:
    try:
        return importlib.util.find_spec(pkg) is not None
    except (ImportError, ValueError):
        return False


def backend_architectures() -> dict[str, set[str]]:
    """Architectures each installed backend plugin loads (read from the plugins' sources, nothing imported)."""
    out: dict[str, set[str]] = {}
    if _installed("torch"):
        out["torch"] = set(_literal_from_source("swiftlm.backends.torch.model_config", "SUPPORTED") or ())
    if _installed("mlx") and _installed("mlx_lm"):
        spec = importlib.util.find_spec("mlx_lm")
        archs: set[str] = set()
        for loc in spec.submodule_search_locations or []:
            archs |= {m.name for m in pkgutil.iter_modules([os.path.join(loc, "models")])}
        archs -= {"base", "cache", "rope_utils", "switch_layers", "activations", "pipeline", "bitlinear_layers"}
        archs |= set((_literal_from_source("mlx_lm.utils", "MODEL_REMAPPING") or {}).keys())
        out["mlx"] = archs
    return out


def runnable_by(spec: Any, archs: dict[str, set[str]] | None = None) -> list[str]:
    """Installed backends that load this model's architecture and format."""
    archs = backend_architectures() if archs is None else archs
    arch = (spec.config.get("model_type") if spec.format == "hf" else None) or spec.arch
    names = []
    for name, supported in sorted(archs.items()):
        if spec.format == "gguf":
            ok = arch == "llama"  # both backends read llama-family GGUF files
        else:
            ok = arch in supported
            if name == "torch" and (spec.config.get("quantization") or {}).get("bits"):
                ok = False  # MLX-quantized weights: MLX only
            if name == "torch" and ok and not _torch_reads_quantization(spec.config):
                ok = False  # a quantization_config layout swiftlm/quant_config.py refuses
        if ok:
            names.append(name)
    return names


def _torch_reads_quantization(config: dict) -> bool:
    from .errors import UnsupportedArchitecture
    from .quant_config import parse

    try:
        parse(config)
    except UnsupportedArchitecture:
        return False
    return True


# --------------------------------------------------------------------------- the cache
@dataclass
class CachedModel:
    repo_id: str
    size_bytes: int
    nb_files: int
    revisions: list[str]
    refs: list[str]
    path: Path | None
    arch: str
    backends: list[str]
    note: str = ""


def cached_models() -> list[CachedModel]:
    from huggingface_hub import scan_cache_dir

    from .registry import inspect_gguf, inspect_hf_dir

    cache = _hf_cache_dir()
    if not cache.exists():
        return []
    try:
        info = scan_cache_dir(cache)
    except Exception as exc:
        raise HubError(f"could not read the Hugging Face cache {cache}: {_first_line(exc)}") from exc
    archs = backend_architectures()
    out = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id.lower()):
        if repo.repo_type != "model":
            continue
        revs = sorted(repo.revisions, key=lambda r: r.last_modified, reverse=True)
        newest = revs[0] if revs else None
        arch, backends, note = "?", [], ""
        if newest is not None:
            snap = Path(newest.snapshot_path)
            try:
                if (snap / "config.json").exists():
                    spec = inspect_hf_dir(snap, repo.repo_id)
                else:
                    ggufs = sorted(snap.glob("*.gguf"))
                    if not ggufs:
                        raise SwiftLMError("no config.json or .gguf file")
                    spec = inspect_gguf(ggufs[0], repo.repo_id)
                arch = spec.arch
                backends = runnable_by(spec, archs)
            except SwiftLMError as exc:
                note = str(exc)
        out.append(
            CachedModel(
                repo_id=repo.repo_id,
                size_bytes=repo.size_on_disk,
                nb_files=repo.nb_files,
                revisions=[r.commit_hash for r in revs],
                refs=sorted({ref for r in revs for ref in r.refs}),
                path=Path(newest.snapshot_path) if newest else None,
                arch=arch,
                backends=backends,
                note=note,
            )
        )
    return out


def remove(repo_id: str, revision: str | None = None) -> int:
    """Delete a cached repo (or one revision of it); return the bytes freed."""
    _check_id(repo_id)
    from huggingface_hub import scan_cache_dir

    cache = _hf_cache_dir()
    try:
        info = scan_cache_dir(cache) if cache.exists() else None
    except Exception as exc:
        raise HubError(f"could not read the Hugging Face cache {cache}: {_first_line(exc)}") from exc
    repo = next(
        (r for r in (info.repos if info else []) if r.repo_type == "model" and r.repo_id.lower() == repo_id.lower()),
        None,
    )
    if repo is None:
        raise HubError(f"{repo_id} is not in the Hugging Face cache {cache} (see `swiftlm models`)")
    if revision is None:
        hashes = [r.commit_hash for r in repo.revisions]
    else:
        hashes = [r.commit_hash for r in repo.revisions if r.commit_hash.startswith(revision) or revision in r.refs]
        if not hashes:
            raise HubError(
                f"{repo_id} has no cached revision {revision!r} (cached: "
                f"{', '.join(r.commit_hash[:12] for r in repo.revisions) or 'none'})"
            )
    strategy = info.delete_revisions(*hashes)
    freed = strategy.expected_freed_size
    try:
        strategy.execute()
        if revision is None and repo.repo_path.exists():  # a repo dir left with only refs/ or .no_exist
            import shutil

            shutil.rmtree(repo.repo_path, ignore_errors=True)
    except OSError as exc:
        raise HubError(f"could not delete {repo_id} from {cache}: {_first_line(exc)}") from exc
    return freed
