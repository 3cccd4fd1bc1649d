"""Decode one OpenAI content part (``image_url`` / ``input_image`` / ``input_audio``) into a
checked image or audio clip."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InvalidRequest
from .policy import MediaPolicy, MediaTooLarge
from .sources import _b64, fetch

IMAGE_FORMATS = {"JPEG": "jpeg", "PNG": "png", "WEBP": "webp", "GIF": "gif"}
AUDIO_FORMATS = ("wav", "flac", "mp3", "ogg")


@dataclass
class ImageItem:
    image: Any  # PIL.Image.Image, RGB
    where: str
    kind: str = "image"


@dataclass
class AudioClip:
    samples: np.ndarray  # float32 mono
    rate: int
    where: str
    kind: str = "audio"

    @property
    def seconds(self) -> float:
        return len(self.samples) / self.rate


MediaItem = ImageItem | AudioClip


def decode_image(data: bytes, where: str, policy: MediaPolicy) -> ImageItem:
    from PIL import Image, UnidentifiedImageError

    try:
        im = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(
            f"{where} could not be decoded as an image (JPEG, PNG, WebP or GIF)", param=where
        ) from None
    if im.format not in IMAGE_FORMATS:
        raise InvalidRequest(f"{where} is a {im.format} image; supported: JPEG, PNG, WebP, GIF", param=where)
    w, h = im.size
    if w * h > policy.max_image_pixels:  # checked from the header, before decoding the pixels
        raise MediaTooLarge(
            f"{where} is {w}x{h} = {w * h} pixels, over the limit of {policy.max_image_pixels} (--max-image-pixels)",
            param=where,
        )
    try:
        im.seek(0)  # animated GIF / WebP: the first frame
        im.load()
        rgb = im.convert("RGB")
    except Exception as exc:  # truncated or corrupt data
        raise InvalidRequest(f"{where} could not be decoded as an image ({exc})", param=where) from None
    return ImageItem(rgb, where)


def decode_audio(data: bytes, fmt: str, where: str, policy: MediaPolicy) -> AudioClip:
    """Decode with libsndfile (soundfile): wav, flac, ogg, mp3; channels averaged to mono."""
    import soundfile as sf

    try:
        info = sf.info(io.BytesIO(data))
    except Exception:
        raise InvalidRequest(f"{where} could not be decoded as {fmt} audio", param=where) from None
    if info.frames / max(1, info.samplerate) > policy.max_audio_seconds:
        raise MediaTooLarge(
            f"{where} is {info.frames / info.samplerate:.1f} s of audio, over the limit of "
            f"{policy.max_audio_seconds:g} s (--max-audio-seconds)",
            param=where,
        )
    try:
        x, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
    except Exception:
        raise InvalidRequest(f"{where} could not be decoded as {fmt} audio", param=where) from None
    if x.shape[0] == 0:
        raise InvalidRequest(f"{where} holds no audio samples", param=where)
    mono = x.mean(axis=1, dtype=np.float32) if x.shape[1] > 1 else x[:, 0]
    return AudioClip(np.ascontiguousarray(mono, dtype=np.float32), int(rate), where)


def resample(x: np.ndarray, rate: int, target: int) -> np.ndarray:
    """Polyphase resampling with scipy's anti-aliasing FIR (Kaiser window)."""
    if rate == target:
        return x
    from math import gcd

    from scipy.signal import resample_poly

    g = gcd(rate, target)
    return resample_poly(x, target // g, rate // g).astype(np.float32)


def collect_part(part: dict, where: str, policy: MediaPolicy) -> MediaItem:
    """Check the modality is on, fetch, decode and limit one content part."""
    kind = part.get("type")
    if kind in ("image_url", "input_image"):
        if not policy.image:
            raise InvalidRequest(f"{where} is an image, but {policy.why_no_image}", param=where)
        ref = part.get("image_url")
        if isinstance(ref, dict):
            ref = ref.get("url")
        data = fetch(ref, f"{where}.image_url", policy, "images")
        return decode_image(data, where, policy)
    if kind == "input_audio":
        if not policy.audio:
            raise InvalidRequest(f"{where} is audio, but {policy.why_no_audio}", param=where)
        spec = part.get("input_audio")
        if not isinstance(spec, dict) or not isinstance(spec.get("data"), str):
            raise InvalidRequest(
                f"{where}.input_audio must be an object with base64 'data' and a 'format'", param=where
            )
        fmt = str(spec.get("format") or "").lower()
        if fmt not in AUDIO_FORMATS:
            raise InvalidRequest(
                f"{where}.input_audio.format {spec.get('format')!r} is not supported; "
                f"use one of {', '.join(AUDIO_FORMATS)}",
                param=where,
            )
        data = _b64(spec["data"], f"{where}.input_audio.data", policy)
        return decode_audio(data, fmt, where, policy)
    raise InvalidRequest(f"{where} has unsupported type {kind!r}", param=where)
