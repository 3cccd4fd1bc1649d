"""Media inputs without a model: sources (data: URIs; files and URLs only behind flags), image and
audio decoding, limits and their 400/413 errors naming the part, resampling, and the Gemma 4
preprocessing against transformers' processors."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import numpy as np
import pytest

from swiftlm.chat.messages import normalize_messages
from swiftlm.errors import InvalidRequest
from swiftlm.media import MediaPolicy, MediaTooLarge
from swiftlm.media.items import resample

PIL = pytest.importorskip("PIL.Image")
sf = pytest.importorskip("soundfile")


def png(arr: np.ndarray, fmt: str = "PNG", **kw) -> bytes:
    b = io.BytesIO()
    PIL.fromarray(arr).save(b, format=fmt, **kw)
    return b.getvalue()


def data_url(raw: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(raw).decode()


def wav(x: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = "FLOAT") -> str:
    b = io.BytesIO()
    sf.write(b, x, rate, format=fmt, subtype=subtype)
    return base64.b64encode(b.getvalue()).decode()


def img_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def aud_part(data: str, fmt: str = "wav") -> dict:
    return {"type": "input_audio", "input_audio": {"data": data, "format": fmt}}


RNG = np.random.default_rng(0)
IMG = RNG.integers(0, 255, (40, 60, 3), dtype=np.uint8)
ON = MediaPolicy(image=True, audio=True)


def collect(parts: list, policy: MediaPolicy = ON) -> tuple[list[dict], list]:
    bag: list = []
    msgs = normalize_messages([{"role": "user", "content": parts}], (policy, bag))
    return msgs, bag


@pytest.mark.parametrize(
    "fmt,mime,exact",
    [
        ("PNG", "image/png", True),
        ("WEBP", "image/webp", True),
        ("JPEG", "image/jpeg", False),
        ("GIF", "image/gif", False),
    ],
)
def test_image_formats_decode_to_rgb(fmt, mime, exact):
    kw = {"lossless": True} if fmt == "WEBP" else {}
    raw = png(IMG, fmt, **kw)
    _, bag = collect([{"type": "text", "text": "hi"}, img_part(data_url(raw, mime))])
    got = np.asarray(bag[0].image)
    assert got.shape == IMG.shape and bag[0].image.mode == "RGB"
    want = np.asarray(PIL.open(io.BytesIO(raw)).convert("RGB"))  # what Pillow itself decodes
    assert np.array_equal(got, want)
    if exact:  # lossless formats round-trip the pixels
        assert np.array_equal(got, IMG)


def test_gif_takes_the_first_frame():
    frames = [PIL.fromarray(np.full((16, 16, 3), c, np.uint8)) for c in (10, 200)]
    b = io.BytesIO()
    frames[0].save(b, format="GIF", save_all=True, append_images=frames[1:])
    _, bag = collect([img_part(data_url(b.getvalue(), "image/gif"))])
    assert np.asarray(bag[0].image).mean() < 50  # frame 0 (dark), not frame 1 (bright)


def test_marker_text_and_order():
    msgs, bag = collect(
        [
            {"type": "text", "text": "a"},
            img_part(data_url(png(IMG))),
            aud_part(wav(np.zeros(1600, np.float32), 16000)),
            img_part(data_url(png(IMG[:20]))),
        ]
    )
    from swiftlm.media.processor import MARKER_RE

    assert [int(i) for i in MARKER_RE.findall(msgs[0]["content"])] == [0, 1, 2]
    assert [it.kind for it in bag] == ["image", "audio", "image"]


@pytest.mark.parametrize(
    "part,needle,status",
    [
        (img_part("data:image/png;base64,@@not-base64@@"), "not valid base64", 400),
        (img_part(data_url(b"definitely not an image")), "could not be decoded", 400),
        (img_part(data_url(png(IMG, "BMP"), "image/bmp")), "BMP image; supported", 400),
        (img_part("data:image/png;base64"), "malformed data: URI", 400),
        (img_part("ftp://x/y.png"), "must be a data: URI", 400),
        (aud_part("%%%"), "not valid base64", 400),
        (aud_part(base64.b64encode(b"RIFF....WAVEjunk").decode()), "could not be decoded as wav", 400),
        (aud_part(wav(np.zeros(100, np.float32), 16000), "aac"), "format 'aac' is not supported", 400),
        ({"type": "input_audio", "input_audio": "x"}, "must be an object", 400),
    ],
)
def test_bad_media_is_a_400_naming_the_part(part, needle, status):
    with pytest.raises(InvalidRequest) as e:
        collect([{"type": "text", "text": "x"}, part])
    assert needle in str(e.value)
    assert getattr(e.value, "status", 400) == status
    assert e.value.param.startswith("messages[0].content[1]")


def test_limits_are_413_or_400():
    small = MediaPolicy(image=True, audio=True, max_image_pixels=40 * 60 - 1, max_images=2)
    with pytest.raises(MediaTooLarge, match="2400 pixels, over the limit of 2399") as e:
        collect([img_part(data_url(png(IMG)))], small)
    assert e.value.status == 413
    with pytest.raises(MediaTooLarge, match="over the limit of 0.5 s"):
        collect(
            [aud_part(wav(np.zeros(8001 * 2, np.float32)[:8001], 16000, subtype="PCM_16"))],
            MediaPolicy(audio=True, max_audio_seconds=0.5),
        )
    with pytest.raises(MediaTooLarge, match="byte limit"):
        collect(
            [img_part(data_url(png(RNG.integers(0, 255, (64, 64, 3), dtype=np.uint8))))],
            MediaPolicy(image=True, max_part_bytes=4096),
        )
    tiny = data_url(png(IMG[:4, :4]))
    with pytest.raises(InvalidRequest, match="too many images .*limit is 2, --max-images") as e:
        collect([img_part(tiny)] * 3, small)
    assert getattr(e.value, "status", 400) == 400 and e.value.param == "messages[0].content[2]"


def test_modality_off_says_which_flag_and_model():
    text_only = MediaPolicy.from_settings(object(), (), "llama")
    with pytest.raises(InvalidRequest, match="model type 'llama' has no vision tower.*--vision"):
        collect([img_part(data_url(png(IMG)))], text_only)
    with pytest.raises(InvalidRequest, match="has no audio tower.*--audio"):
        collect([aud_part(wav(np.zeros(10, np.float32), 16000))], text_only)

    class S:
        vision, audio = False, True

    no_flag = MediaPolicy.from_settings(S(), ("image", "audio"), "gemma4")
    with pytest.raises(InvalidRequest, match="takes images, but the server was started without --vision"):
        collect([img_part(data_url(png(IMG)))], no_flag)
    collect([aud_part(wav(np.zeros(10, np.float32), 16000))], no_flag)  # audio is on
    with pytest.raises(InvalidRequest, match="takes text only .*--vision"):  # callers without a policy
        normalize_messages([{"role": "user", "content": [img_part(data_url(png(IMG)))]}])


def test_files_only_under_media_dir(tmp_path):
    d = tmp_path / "media"
    d.mkdir()
    (d / "a.png").write_bytes(png(IMG))
    (tmp_path / "secret.png").write_bytes(png(IMG))
    (d / "link.png").symlink_to(tmp_path / "secret.png")
    with pytest.raises(InvalidRequest, match="reading files is off .*--media-dir"):
        collect([img_part(str(d / "a.png"))])
    with pytest.raises(InvalidRequest, match="reading files is off"):
        collect([img_part("file:///etc/passwd")])
    allowed = MediaPolicy(image=True, media_dir=d.resolve())
    for ref in (str(d / "a.png"), f"file://{d / 'a.png'}", "./a.png"):
        _, bag = collect([img_part(ref)], allowed)
        assert np.array_equal(np.asarray(bag[0].image), IMG)
    for ref in (str(tmp_path / "secret.png"), str(d / ".." / "secret.png"), str(d / "link.png"), "file:///etc/passwd"):
        with pytest.raises(InvalidRequest, match="outside the allowed media directory"):
            collect([img_part(ref)], allowed)


def test_remote_urls_only_with_the_flag():
    body = png(IMG)
    hits = []

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            hits.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *a):
            pass

    srv = http.server.HTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{srv.server_port}/cat.png"
    try:
        with pytest.raises(InvalidRequest, match="remote URL; fetching images from the network is off"):
            collect([img_part(url)])
        assert hits == []  # refused before any connection
        _, bag = collect([img_part(url)], MediaPolicy(image=True, allow_remote=True))
        assert hits == ["/cat.png"] and np.array_equal(np.asarray(bag[0].image), IMG)
        with pytest.raises(MediaTooLarge):
            collect([img_part(url)], MediaPolicy(image=True, allow_remote=True, max_part_bytes=100))
    finally:
        srv.shutdown()


def test_audio_decode_downmix_and_formats():
    t = np.arange(8000) / 16000
    left, right = np.sin(2 * np.pi * 300 * t), 0.5 * np.sin(2 * np.pi * 700 * t)
    st = np.stack([left, right], 1).astype(np.float32)
    _, bag = collect([aud_part(wav(st, 16000))])
    clip = bag[0]
    assert clip.rate == 16000 and clip.samples.dtype == np.float32
    np.testing.assert_array_equal(clip.samples, st.mean(axis=1, dtype=np.float32))  # FLOAT wav: exact
    _, bag = collect([aud_part(wav(st, 16000, "FLAC", "PCM_16"), "flac")])
    np.testing.assert_allclose(bag[0].samples, st.mean(1), atol=2 / 32768)  # 16-bit quantisation


def test_resample_is_accurate_and_antialiased():
    r_in, r_out = 48000, 16000
    t = np.arange(r_in) / r_in
    y = resample(np.sin(2 * np.pi * 1000 * t).astype(np.float32), r_in, r_out)
    assert len(y) == r_out
    ref = np.sin(2 * np.pi * 1000 * np.arange(r_out) / r_out)
    assert np.abs(y - ref)[200:-200].max() < 1e-3  # away from the filter's edge transients
    alias = resample(np.sin(2 * np.pi * 12000 * t).astype(np.float32), r_in, r_out)  # above the new Nyquist
    assert np.sqrt(np.mean(alias[200:-200] ** 2)) < 0.01  # removed, not folded to 4 kHz
    x = RNG.standard_normal(100).astype(np.float32)
    assert resample(x, 16000, 16000) is x


# -- Gemma 4 preprocessing against transformers' processors (the same pieces both backends use)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    from conftest import make_ckpt

    return make_ckpt(tmp_path_factory.mktemp("g4") / "gemma4", "--arch", "gemma4")


@pytest.fixture(scope="module")
def proc(gemma4):
    from swiftlm.media import processor_for
    from swiftlm.registry import resolve
    from swiftlm.tokenizer import load_hf_tokenizer

    spec = resolve(str(gemma4))
    return processor_for(spec, load_hf_tokenizer(spec.path, spec.config))


def _reference(gemma4):
    import json

    from transformers.models.gemma4.feature_extraction_gemma4 import Gemma4AudioFeatureExtractor
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    pc = json.loads((gemma4 / "processor_config.json").read_text())
    strip = lambda d: {k: v for k, v in d.items() if not k.endswith("_type")}  # noqa: E731
    return (
        Gemma4ImageProcessorPil(**strip(pc["image_processor"])),
        Gemma4AudioFeatureExtractor(**strip(pc["feature_extractor"])),
    )


def test_pixels_and_audio_features_equal_the_reference(gemma4, proc, tmp_path):
    ref_img, ref_fe = _reference(gemma4)
    a = RNG.integers(0, 255, (200, 300, 3), dtype=np.uint8)
    b = RNG.integers(0, 255, (90, 50, 3), dtype=np.uint8)
    raw_a, raw_b = png(a), png(b, "JPEG", quality=90)
    clip = (0.3 * np.sin(2 * np.pi * 440 * np.arange(24000) / 16000)).astype(np.float32)
    _, bag = collect([img_part(data_url(raw_a)), aud_part(wav(clip, 16000)), img_part(data_url(raw_b, "image/jpeg"))])
    texts, mi = proc.prepare(bag)
    # the reference reads the same files with Pillow and takes the same samples
    ref = ref_img(images=[PIL.open(io.BytesIO(raw_a)), PIL.open(io.BytesIO(raw_b))], return_tensors="np")
    np.testing.assert_array_equal(mi.arrays["pixel_values"], ref["pixel_values"])
    np.testing.assert_array_equal(mi.arrays["image_position_ids"], ref["image_position_ids"])
    fe = ref_fe([clip], return_tensors="np")
    np.testing.assert_array_equal(mi.arrays["input_features"], fe["input_features"])
    np.testing.assert_array_equal(mi.arrays["input_features_mask"], fe["input_features_mask"])
    # placeholder text: BOI + n x IMAGE + EOI per image, n from the reference's soft-token counts
    n = [int(x) for x in ref["num_soft_tokens_per_image"]]
    assert texts[0] == "<|image_start|>" + "<|image|>" * n[0] + "<|image_end|>"
    assert texts[2] == "<|image_start|>" + "<|image|>" * n[1] + "<|image_end|>"
    assert texts[1].startswith("<|audio_start|><|audio|>") and mi.n_images == 2 and mi.n_audio == 1


def test_resampled_audio_matches_reference_on_resampled_input(proc, gemma4):
    _, ref_fe = _reference(gemma4)
    t = np.arange(44100) / 44100
    st = np.stack([np.sin(2 * np.pi * 440 * t), np.sin(2 * np.pi * 660 * t)], 1).astype(np.float32)
    _, bag = collect([aud_part(wav(st, 44100))])
    _, mi = proc.prepare(bag)
    want = ref_fe([resample(st.mean(1, dtype=np.float32), 44100, 16000)], return_tensors="np")["input_features"]
    np.testing.assert_array_equal(mi.arrays["input_features"], want)
    assert mi.arrays["input_features"].shape[1] == 99  # 1 s at 16 kHz, 10 ms hop


def test_expand_inserts_the_right_number_of_tokens(proc, gemma4):
    from swiftlm.media.processor import MARKER, expand
    from swiftlm.tokenizer import load_hf_tokenizer

    tok = load_hf_tokenizer(gemma4)
    imgs = [RNG.integers(0, 255, (h, w, 3), dtype=np.uint8) for h, w in ((64, 64), (300, 100), (48, 200))]
    parts = [img_part(data_url(png(x))) for x in imgs]
    _, bag = collect(parts)
    text = "look: " + " ".join(MARKER.format(i) for i in range(3))
    ids = expand(text, bag, proc, tok)
    _, mi = proc.prepare(bag)
    image_id = proc.image_id
    per = [int(x) for x in proc.image_arrays([b.image for b in bag])["num_soft_tokens_per_image"]]
    assert sum(1 for t in ids if t == image_id) == sum(per) == mi.tokens[image_id]
    boi = tok.encode("<|image_start|>")
    assert len(boi) == 1 and sum(1 for t in ids if t == boi[0]) == 3
    # a prompt that spells the placeholder itself is refused (the counts would not match)
    with pytest.raises(InvalidRequest, match="placeholder tokens"):
        expand("<|image|> " + MARKER.format(0), bag[:1], proc, tok)


@pytest.mark.parametrize("fmt,sfmt", [("mp3", "MP3"), ("ogg", "OGG")])
def test_lossy_audio_formats_decode(fmt, sfmt):
    """mp3 / ogg through libsndfile: lossy, so the decoded tone is compared by correlation (> 0.95)
    and the rate and length (mp3 pads up to a frame, 1152 samples)."""
    t = np.arange(16000) / 16000
    x = (0.5 * np.sin(2 * np.pi * 440 * t)).astype(np.float32)
    _, bag = collect([aud_part(wav(x, 16000, sfmt, None), fmt)])
    y = bag[0].samples
    assert bag[0].rate == 16000 and abs(len(y) - len(x)) <= 1152 * 2
    n = min(len(x), len(y))
    best = max(np.corrcoef(x[: n - s], y[s:n])[0, 1] for s in range(0, 1200, 1))
    assert best > 0.95


def test_images_across_the_conversation_share_one_limit_and_order():
    from swiftlm.media.processor import MARKER_RE

    tiny = img_part(data_url(png(IMG[:8, :8])))
    conv = [
        {"role": "user", "content": [tiny, {"type": "text", "text": "and"}, tiny]},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": [{"type": "text", "text": "now"}, tiny]},
    ]
    bag: list = []
    msgs = normalize_messages(conv, (MediaPolicy(image=True), bag))
    assert [int(i) for m in msgs for i in MARKER_RE.findall(m["content"])] == [0, 1, 2] and len(bag) == 3
    with pytest.raises(InvalidRequest, match="too many images") as e:
        normalize_messages(conv, (MediaPolicy(image=True, max_images=2), []))
    assert e.value.param == "messages[2].content[1]"
