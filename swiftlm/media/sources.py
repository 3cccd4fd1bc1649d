"""Where a media part's bytes come from.  ``data:`` URIs and bare base64 always; http(s) URLs
only with --allow-remote-media; local files only under --media-dir.  A request can never make
the server read an arbitrary file or reach the network."""

from __future__ import annotations

import base64
import binascii
import urllib.parse
import urllib.request
from pathlib import Path

from ..errors import InvalidRequest
from .policy import MediaPolicy, MediaTooLarge


def _b64(data: str, where: str, policy: MediaPolicy) -> bytes:
    if len(data) * 3 // 4 > policy.max_part_bytes:
        raise MediaTooLarge(
            f"{where} is over the {policy.max_part_bytes} byte limit for one media part (--max-media-bytes)",
            param=where,
        )
    try:
        return base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where} is not valid base64", param=where) from None


def data_uri(url: str, where: str, policy: MediaPolicy) -> bytes:
    """``data:[<mime>][;base64],<payload>`` -> bytes (the content decides the format, not the mime)."""
    head, sep, payload = url.partition(",")
    if not sep:
        raise InvalidRequest(f"{where} is a malformed data: URI (no ',')", param=where)
    if "base64" in (m.strip().lower() for m in head[5:].split(";")[1:]):
        return _b64(payload, where, policy)
    raw = urllib.parse.unquote_to_bytes(payload)
    if len(raw) > policy.max_part_bytes:
        raise MediaTooLarge(f"{where} is over the {policy.max_part_bytes} byte limit (--max-media-bytes)", param=where)
    return raw


def fetch(url: str, where: str, policy: MediaPolicy, kind: str) -> bytes:
    """Bytes for an ``image_url``-style reference."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where} must be a non-empty string URL", param=where)
    low = url[:16].lower()
    if low.startswith("data:"):
        return data_uri(url, where, policy)
    if low.startswith(("http://", "https://")):
        if not policy.allow_remote:
            raise InvalidRequest(
                f"{where} is a remote URL; fetching {kind} from the network is off (start the "
                "server with --allow-remote-media), or send it inline as a data: URI",
                param=where,
            )
        return _download(url, where, policy)
    if low.startswith("file:") or url.startswith(("/", "./", "../", "~")) or (len(url) > 2 and url[1] == ":"):
        return _local(url, where, policy)
    raise InvalidRequest(
        f"{where} must be a data: URI (base64){', an http(s) URL' if policy.allow_remote else ''}"
        f"{' or a file under --media-dir' if policy.media_dir else ''}",
        param=where,
    )


def _local(url: str, where: str, policy: MediaPolicy) -> bytes:
    if policy.media_dir is None:
        raise InvalidRequest(
            f"{where} is a local file path; reading files is off (start the server with "
            "--media-dir DIR to allow files under DIR)",
            param=where,
        )
    path = urllib.parse.unquote(urllib.parse.urlparse(url).path) if url.lower().startswith("file:") else url
    p = Path(path).expanduser()
    p = (p if p.is_absolute() else policy.media_dir / p).resolve()  # follows symlinks before the check
    if not p.is_relative_to(policy.media_dir):
        raise InvalidRequest(f"{where} is outside the allowed media directory (--media-dir)", param=where)
    if not p.is_file():
        raise InvalidRequest(f"{where}: no such file in the media directory", param=where)
    if p.stat().st_size > policy.max_part_bytes:
        raise MediaTooLarge(f"{where} is over the {policy.max_part_bytes} byte limit (--max-media-bytes)", param=where)
    return p.read_bytes()


def _download(url: str, where: str, policy: MediaPolicy) -> bytes:
    req = urllib.request.Request(url, headers={"User-Agent": "swiftlm"})
    try:
        with urllib.request.urlopen(req, timeout=policy.remote_timeout) as resp:  # noqa: S310 (flag-gated)
            body = resp.read(policy.max_part_bytes + 1)
    except Exception as exc:
        raise InvalidRequest(f"{where}: could not fetch the URL ({type(exc).__name__}: {exc})", param=where) from None
    if len(body) > policy.max_part_bytes:
        raise MediaTooLarge(f"{where} is over the {policy.max_part_bytes} byte limit (--max-media-bytes)", param=where)
    return body
