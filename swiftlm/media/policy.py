"""What a request may send: modalities switched on, where media may come from, and size limits."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import InvalidRequest


class MediaTooLarge(InvalidRequest):
    """A media part over a size limit: HTTP 413."""

    status = 413


@dataclass
class MediaPolicy:
    image: bool = False  # --vision (and a model with a vision tower)
    audio: bool = False  # --audio (and a model with an audio tower)
    allow_remote: bool = False  # --allow-remote-media: http(s) URLs
    media_dir: Path | None = None  # --media-dir: local files under this directory only
    max_images: int = 8  # per request
    max_audio_clips: int = 4  # per request
    max_image_pixels: int = 4096 * 4096  # decoded width x height
    max_audio_seconds: float = 60.0  # per clip
    max_part_bytes: int = 20 * 1024 * 1024  # encoded bytes of one part
    remote_timeout: float = 10.0
    why_no_image: str = "start the server with --vision and a vision-language model"
    why_no_audio: str = "start the server with --audio and an audio-language model"

    @classmethod
    def from_settings(cls, settings: Any, modalities: tuple[str, ...] = (), arch: str = "") -> MediaPolicy:
        """``modalities``: what the loaded model can take; the flags switch them on."""
        has_img, has_aud = "image" in modalities, "audio" in modalities
        want_img, want_aud = bool(getattr(settings, "vision", False)), bool(getattr(settings, "audio", False))
        media_dir = getattr(settings, "media_dir", None)
        p = cls(
            image=want_img and has_img,
            audio=want_aud and has_aud,
            allow_remote=bool(getattr(settings, "allow_remote_media", False)),
            media_dir=Path(media_dir).resolve() if media_dir else None,
            max_images=int(getattr(settings, "max_images", 8)),
            max_audio_clips=int(getattr(settings, "max_audio_clips", 4)),
            max_image_pixels=int(getattr(settings, "max_image_pixels", 4096 * 4096)),
            max_audio_seconds=float(getattr(settings, "max_audio_seconds", 60.0)),
            max_part_bytes=int(getattr(settings, "max_media_bytes", 20 * 1024 * 1024)),
        )
        what = f"model type {arch!r}" if arch else "this model"
        if not has_img:
            p.why_no_image = f"{what} has no vision tower: serve a vision-language model (e.g. gemma4) with --vision"
        elif not want_img:
            p.why_no_image = f"{what} takes images, but the server was started without --vision"
        if not has_aud:
            p.why_no_audio = f"{what} has no audio tower: serve an audio-language model (e.g. gemma4) with --audio"
        elif not want_aud:
            p.why_no_audio = f"{what} takes audio, but the server was started without --audio"
        return p
