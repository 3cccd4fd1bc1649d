"""Model-family preprocessing: media items -> the arrays a model's towers take, and the
placeholder tokens they fill in the prompt.

The arrays come from transformers' own (numpy / PIL) image processors and feature extractors
for the family, so both backends get identical inputs and they equal the reference processor's.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..errors import InvalidRequest
from .items import AudioClip, ImageItem, MediaItem, resample

MARKER = "\ue000swiftlm-media-{}\ue001"  # private-use code points around the item's index
MARKER_RE = re.compile("\ue000swiftlm-media-(\\d+)\ue001")


@dataclass
class MediaInputs:
    """Arrays named as the model's forward takes them (pixel_values, input_features, ...)."""

    arrays: dict[str, np.ndarray] = field(default_factory=dict)
    n_images: int = 0
    n_audio: int = 0
    tokens: dict[int, int] = field(default_factory=dict)  # placeholder token id -> count in the prompt

    def for_length(self, n: int) -> dict[str, np.ndarray]:
        """The arrays for a prefill of ``n`` tokens: per-token arrays (mm_token_type_ids) are cut or
        zero-padded to ``n`` (a preempted sequence re-prefills its prompt plus generated tokens)."""
        out = dict(self.arrays)
        tt = out.get("mm_token_type_ids")
        if tt is not None and tt.shape[1] != n:
            fixed = np.zeros((1, n), dtype=tt.dtype)
            fixed[:, : min(n, tt.shape[1])] = tt[:, :n]
            out["mm_token_type_ids"] = fixed
        return out

    def digest(self) -> str:
        h = hashlib.sha256()
        for k in sorted(self.arrays):
            h.update(k.encode())
            h.update(np.ascontiguousarray(self.arrays[k]).tobytes())
        return h.hexdigest()[:16]


class MediaPrompt(list):
    """Prompt token ids that carry the request's media (engine.submit reads ``.media``)."""

    media: MediaInputs | None = None


class MediaProcessor(Protocol):
    modalities: tuple[str, ...]

    def prepare(self, items: list[MediaItem]) -> tuple[list[str], MediaInputs]:
        """Per item the text that replaces its marker, and the model arrays."""

    def token_types(self, ids: list[int]) -> np.ndarray | None:
        """Per-token modality ids (transformers' mm_token_type_ids) where the family uses them."""


def _load_processor_config(path: Path) -> dict:
    """transformers 5 writes processor_config.json with nested image_processor / feature_extractor
    dicts; older checkpoints have preprocessor_config.json."""
    out: dict = {}
    for name in ("preprocessor_config.json", "processor_config.json"):
        f = path / name
        if f.is_file():
            d = json.loads(f.read_text())
            if "image_processor" in d or "feature_extractor" in d:
                out.update(d)
            else:
                key = "feature_extractor" if "feature_extractor_type" in d else "image_processor"
                out.setdefault(key, d)
    return out


def _kwargs(d: dict | None) -> dict:
    return {k: v for k, v in (d or {}).items() if not k.endswith("_type") and k != "processor_class"}


class Gemma4Media:
    """Gemma 4: images -> patches (aspect-preserving resize to a soft-token budget), audio ->
    128-bin log-mel frames at 16 kHz; each item's placeholder is BOI + N x IMAGE + EOI."""

    def __init__(self, path: Path, config: dict, tokenizer: Any):
        from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
        from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

        pc = _load_processor_config(path)
        self.modalities: tuple[str, ...] = ()
        tok = tokenizer.id_to_token
        self.image_proc = self.audio_fe = None
        if config.get("vision_config"):
            self.image_proc = Gemma4ImageProcessorPil(**_kwargs(pc.get("image_processor")))
            self.image_id = int(config["image_token_id"])
            self.image_tok, self.boi, self.eoi = (
                tok(int(config[k])) for k in ("image_token_id", "boi_token_id", "eoi_token_id")
            )
            self.modalities += ("image",)
        if config.get("audio_config"):
            self.audio_fe = Gemma4AudioFeatureExtractor(**_kwargs(pc.get("feature_extractor")))
            self.audio_id = int(config["audio_token_id"])
            self.audio_tok, self.boa, self.eoa = (
                tok(int(config[k])) for k in ("audio_token_id", "boa_token_id", "eoa_token_index")
            )
            self.modalities += ("audio",)

    def token_types(self, ids: list[int]) -> np.ndarray:
        """transformers' mm_token_type_ids: 1 image, 3 audio, 0 text.  Gemma 4 models with
        ``use_bidirectional_attention: "vision"`` attend bidirectionally within each image's run."""
        a = np.asarray(ids)
        out = np.zeros((1, len(ids)), dtype=np.int64)
        if self.image_proc is not None:
            out[0, a == self.image_id] = 1
        if self.audio_fe is not None:
            out[0, a == self.audio_id] = 3
        return out

    @property
    def sampling_rate(self) -> int:
        return int(self.audio_fe.sampling_rate) if self.audio_fe is not None else 0

    def image_arrays(self, images: list[Any]) -> dict[str, np.ndarray]:
        out = self.image_proc(images=images, return_tensors="np")
        return {k: np.asarray(v) for k, v in out.items()}

    def audio_arrays(self, clips: list[np.ndarray]) -> dict[str, np.ndarray]:
        out = self.audio_fe(clips, return_tensors="np")
        return {k: np.asarray(v) for k, v in out.items()}

    @staticmethod
    def audio_tokens(mask: np.ndarray) -> int:
        """Soft tokens for one clip: its valid frames after the two stride-2 convolutions."""
        for _ in range(2):
            t_out = (len(mask) + 2 - 3) // 2 + 1
            mask = mask[::2][:t_out]
        return int(mask.sum())

    def prepare(self, items: list[MediaItem]) -> tuple[list[str], MediaInputs]:
        images = [it.image for it in items if isinstance(it, ImageItem)]
        clips = [resample(it.samples, it.rate, self.sampling_rate) for it in items if isinstance(it, AudioClip)]
        mi = MediaInputs(n_images=len(images), n_audio=len(clips))
        per_image: list[int] = []
        per_clip: list[int] = []
        if images:
            arr = self.image_arrays(images)
            per_image = [int(n) for n in arr.pop("num_soft_tokens_per_image")]
            mi.arrays.update(arr)
            mi.tokens[self.image_id] = sum(per_image)
        if clips:
            arr = self.audio_arrays(clips)
            per_clip = [self.audio_tokens(m) for m in arr["input_features_mask"]]
            mi.arrays.update(arr)
            mi.tokens[self.audio_id] = sum(per_clip)
        texts, ii, ai = [], iter(per_image), iter(per_clip)
        for it in items:
            if isinstance(it, ImageItem):
                texts.append(f"{self.boi}{self.image_tok * next(ii)}{self.eoi}")
            else:
                texts.append(f"{self.boa}{self.audio_tok * next(ai)}{self.eoa}")
        return texts, mi


FAMILIES = {"gemma4": Gemma4Media}


def processor_for(spec: Any, tokenizer: Any) -> MediaProcessor | None:
    """The media processor for a model, or None for text-only models / unknown families."""
    if not is_multimodal(spec):
        return None
    return FAMILIES[spec.arch](Path(spec.path), spec.config, tokenizer)


def expand(text: str, items: list[MediaItem], processor: MediaProcessor, tokenizer: Any) -> MediaPrompt:
    """(``items`` non-empty.)  Replace each item's marker in the rendered prompt by its placeholder tokens, tokenize,
    and check the placeholder count (a prompt that spells a placeholder token itself is refused)."""
    found = [int(m) for m in MARKER_RE.findall(text)]
    if sorted(found) != list(range(len(items))):
        raise InvalidRequest("the chat template dropped or repeated a media part", param="messages")
    texts, mi = processor.prepare([items[i] for i in found])
    by_index = dict(zip(found, texts))
    ids = MediaPrompt(
        tokenizer.encode(MARKER_RE.sub(lambda m: by_index[int(m.group(1))], text), add_special_tokens=False)
    )
    for tid, want in mi.tokens.items():
        got = sum(1 for t in ids if t == tid)
        if got != want:
            raise InvalidRequest(
                f"the prompt has {got} media placeholder tokens where {want} were expected: the "
                "text must not contain the model's image/audio tokens itself",
                param="messages",
            )
    types = processor.token_types(ids)
    if types is not None:
        mi.arrays["mm_token_type_ids"] = types
    ids.media = mi
    return ids


def is_multimodal(spec: Any) -> bool:
    """Served through the library multimodal path (mlx-vlm / transformers) rather than the text engines."""
    return getattr(spec, "arch", "") in FAMILIES and spec.format != "gguf" and bool(spec.vision or spec.audio)


def check_settings(spec: Any, settings: Any) -> None:
    """Refuse flag combinations that cannot work, at startup."""
    from ..errors import ConfigError

    what = f"{spec.name} (model type {spec.arch!r})"
    if getattr(settings, "vision", False) and not spec.vision:
        raise ConfigError(f"--vision: {what} has no vision tower; serve a vision-language model (e.g. gemma4)")
    if getattr(settings, "audio", False) and not spec.audio:
        raise ConfigError(f"--audio: {what} has no audio tower; serve an audio-language model (e.g. gemma4)")
    if (getattr(settings, "vision", False) or getattr(settings, "audio", False)) and not is_multimodal(spec):
        raise ConfigError(f"{what}: media input is built for {', '.join(sorted(FAMILIES))} checkpoints (HF layout)")
    if is_multimodal(spec):
        for flag, on in (
            ("--turbo-kv", getattr(settings, "turbo_kv", None)),
            ("--stream-experts", getattr(settings, "stream_experts", False)),
            ("--speculative", getattr(settings, "speculative", None) or getattr(settings, "draft_model", None)),
        ):
            if on:
                raise ConfigError(f"{flag} is not available for multimodal models ({what}) yet")
