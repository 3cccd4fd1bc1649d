"""Multimodal plumbing on a random-weight Gemma 4 (vision + audio towers; written by
scripts/make_checkpoint.py --arch gemma4): media reach the model (different media -> different
first-step logits, the same media -> identical logits), MLX (mlx-vlm) and torch (transformers)
agree, media prompts batch with running text streams, and the OpenAI SDK drives it all through
the real server.  Random weights: plumbing only, never quality."""

from __future__ import annotations

import base64
import io
import threading

import numpy as np
import pytest
from conftest import BACKENDS, HAS_MLX, HAS_TORCH, make_ckpt
from server_util import ServerProc
from tolerances import fp32_matmul_tol

PIL = pytest.importorskip("PIL.Image")
sf = pytest.importorskip("soundfile")
RNG = np.random.default_rng(1)


def image_url(arr: np.ndarray) -> str:
    b = io.BytesIO()
    PIL.fromarray(arr).save(b, format="PNG")
    return "data:image/png;base64," + base64.b64encode(b.getvalue()).decode()


def wav_b64(x: np.ndarray, rate: int = 16000) -> str:
    b = io.BytesIO()
    sf.write(b, x.astype(np.float32), rate, format="WAV", subtype="FLOAT")
    return base64.b64encode(b.getvalue()).decode()


IMG_A = RNG.integers(0, 255, (120, 160, 3), dtype=np.uint8)
IMG_B = RNG.integers(0, 255, (120, 160, 3), dtype=np.uint8)
T = np.arange(16000) / 16000
AUD_A = 0.3 * np.sin(2 * np.pi * 440 * T)
AUD_B = 0.3 * np.sin(2 * np.pi * 1250 * T)


def msgs(*parts: dict, text: str = "Describe.") -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": text}, *parts]}]


def img(arr: np.ndarray) -> dict:
    return {"type": "image_url", "image_url": {"url": image_url(arr)}}


def aud(x: np.ndarray, rate: int = 16000) -> dict:
    return {"type": "input_audio", "input_audio": {"data": wav_b64(x, rate), "format": "wav"}}


def fp32_logits_tol(scale: float) -> float:
    """The fp32 rounding bound (tests/tolerances.py) for this checkpoint's first-step logits: the
    longest reduction is the 16x16x3 patch embedding (768 products); from pixels or audio frames to
    the logits at most 40 chained reductions (patch embedding, a vision block, pooling, projection
    or two subsampling convs, a conformer block, projection; two text blocks of 6 and their
    per-layer inputs; the LM head): 1.7e-4 of the largest logit."""
    return fp32_matmul_tol(768, scale, 40)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    return make_ckpt(tmp_path_factory.mktemp("mm") / "gemma4", "--arch", "gemma4")


class Loaded:
    """A backend's model with the engine's prompt path (policy + processor), no engine thread."""

    def __init__(self, path, backend: str):
        from swiftlm.backend import discover_backends
        from swiftlm.config import Settings
        from swiftlm.media import MediaPolicy, processor_for
        from swiftlm.registry import resolve

        self.spec = resolve(str(path))
        settings = Settings(model=str(path), vision=True, audio=True)
        self.model = discover_backends()[backend].backend.load(self.spec, settings)
        self.proc = processor_for(self.spec, self.model.tokenizer)
        self.policy = MediaPolicy.from_settings(settings, self.proc.modalities, self.spec.arch)

    def prompt(self, messages: list[dict]):
        from swiftlm.chat.messages import normalize_messages
        from swiftlm.media.processor import expand

        bag: list = []
        m = normalize_messages(messages, (self.policy, bag))
        text = self.model.tokenizer.apply_chat_template(m, add_generation_prompt=True)
        return expand(text, bag, self.proc, self.model.tokenizer)

    def first_logits(self, messages: list[dict]) -> np.ndarray:
        ids = self.prompt(messages)
        out = self.model.run(self.model.new_cache(), list(ids), ids.media)
        return np.array(out.tolist() if hasattr(out, "tolist") else out, dtype=np.float32)


@pytest.fixture(scope="module", params=BACKENDS)
def loaded(request, gemma4):
    return Loaded(gemma4, request.param)


def test_media_change_the_first_step_logits(loaded):
    a = loaded.first_logits(msgs(img(IMG_A)))
    b = loaded.first_logits(msgs(img(IMG_B)))
    a2 = loaded.first_logits(msgs(img(IMG_A)))
    assert np.array_equal(a, a2)  # the same image twice: identical logits (fresh caches, same arrays)
    assert np.abs(a - b).max() > 1e-3 * np.abs(a).max()  # a different image reaches the logits
    x = loaded.first_logits(msgs(aud(AUD_A)))
    y = loaded.first_logits(msgs(aud(AUD_B)))
    assert np.array_equal(x, loaded.first_logits(msgs(aud(AUD_A))))
    assert np.abs(x - y).max() > 1e-3 * np.abs(x).max()


def test_n_images_insert_their_placeholder_tokens(loaded):
    images = [IMG_A, IMG_B[:50], RNG.integers(0, 255, (300, 90, 3), dtype=np.uint8)]
    ids = loaded.prompt(msgs(*[img(x) for x in images], aud(AUD_A)))
    per = [int(n) for n in loaded.proc.image_arrays([PIL.fromarray(x) for x in images])["num_soft_tokens_per_image"]]
    assert ids.media.n_images == 3 and ids.media.n_audio == 1
    assert sum(1 for t in ids if t == loaded.proc.image_id) == sum(per)
    audio_frames = ids.media.arrays["input_features_mask"][0]
    assert sum(1 for t in ids if t == loaded.proc.audio_id) == loaded.proc.audio_tokens(audio_frames) == 25


@pytest.mark.skipif(not (HAS_MLX and HAS_TORCH), reason="needs both mlx and torch installed")
def test_mlx_and_torch_agree_on_first_step_logits(gemma4):
    """Same checkpoint, same image and audio: mlx-vlm and transformers, both fp32 on the CPU.
    The two libraries sum in different orders (conv, attention, softmax kernels): equal to the fp32
    rounding bound (1.7e-4 of the largest logit); a wiring difference (a missing
    scale, a wrong position) is orders larger (different media move logits by > 1e-3 of it)."""
    t, m = Loaded(gemma4, "torch"), Loaded(gemma4, "mlx")
    for conv in (msgs(img(IMG_A)), msgs(aud(AUD_B)), msgs(img(IMG_B), aud(AUD_A), img(IMG_A[:60]))):
        ids_t, ids_m = t.prompt(conv), m.prompt(conv)
        assert list(ids_t) == list(ids_m) and ids_t.media.digest() == ids_m.media.digest()  # same inputs
        lt, lm = t.first_logits(conv), m.first_logits(conv)
        scale = np.abs(lt).max()
        assert scale > 1.0  # non-trivial logits
        assert np.abs(lt - lm).max() <= fp32_logits_tol(scale), (np.abs(lt - lm).max(), fp32_logits_tol(scale))
        assert lt.argmax() == lm.argmax()


@pytest.fixture(scope="module")
def gemma4_bidir(gemma4, tmp_path_factory):
    """The same weights with Gemma 4's bidirectional attention inside each image (as the larger
    Gemma 4 configs set it): it depends on the per-token modality ids reaching the model."""
    import json
    import shutil

    d = tmp_path_factory.mktemp("bidir") / "gemma4"
    shutil.copytree(gemma4, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["text_config"]["use_bidirectional_attention"] = "vision"
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_bidirectional_image_attention_is_wired(gemma4, gemma4_bidir):
    """Causal vs bidirectional-within-image on the same weights must differ (the modality ids reach
    the mask) and only from the first image token on; MLX and torch agree on the bidirectional one."""
    conv = msgs(img(IMG_A), aud(AUD_A))
    got = {}
    for b in [p.values[0] for p in BACKENDS if not any(m.args[0] for m in p.marks)]:
        causal, bidir = Loaded(gemma4, b), Loaded(gemma4_bidir, b)
        ids = causal.prompt(conv)
        types = ids.media.arrays["mm_token_type_ids"][0]
        assert (types == 1).sum() == sum(1 for t in ids if t == causal.proc.image_id)
        assert (types == 3).sum() == sum(1 for t in ids if t == causal.proc.audio_id)
        lc, lb = causal.first_logits(conv), bidir.first_logits(conv)
        assert np.abs(lc - lb).max() > 1e-3 * np.abs(lc).max()
        text_only = [{"role": "user", "content": "hello"}]
        assert np.array_equal(causal.first_logits(text_only), bidir.first_logits(text_only))
        got[b] = lb
    if len(got) == 2:
        assert np.abs(got["mlx"] - got["torch"]).max() <= fp32_logits_tol(np.abs(got["torch"]).max())


def wait_for(cond, timeout: float = 60.0) -> None:
    import time

    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.002)


def test_media_prompt_does_not_disturb_a_running_text_stream(gemma4):
    """A media prompt is prefilled alone in one step while a text stream decodes: the text stream
    keeps its exact greedy output, and the media request completes."""
    pytest.importorskip("torch")
    from swiftlm import LLM, SamplingParams

    llm = LLM(str(gemma4), backend="torch", vision=True, audio=True, parallel=2)
    try:
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        solo = llm.chat([{"role": "user", "content": "Count."}], p).outputs[0].token_ids
        got: dict = {}

        def text():
            got["text"] = llm.chat([{"role": "user", "content": "Count."}], p).outputs[0].token_ids

        th = threading.Thread(target=text)
        th.start()
        wait_for(lambda: llm.engine.stats.tokens_generated >= len(solo) + 4)  # the text stream is decoding
        media = llm.chat(msgs(img(IMG_A), aud(AUD_A)), SamplingParams(max_tokens=8, temperature=0))
        th.join(60)
        assert got["text"] == solo
        assert len(media.outputs[0].token_ids) == 8
    finally:
        llm.close()


def test_a_failing_media_forward_fails_only_its_request(gemma4):
    """A media prompt whose forward raises (here: injected) ends with an error; the text stream
    decoding beside it keeps its exact output."""
    pytest.importorskip("torch")
    from swiftlm import LLM, SamplingParams

    llm = LLM(str(gemma4), backend="torch", vision=True, audio=True, parallel=2)
    try:
        p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
        solo = llm.chat([{"role": "user", "content": "Count."}], p).outputs[0].token_ids
        model = llm.engine.model
        real = model.run

        def broken(cache, tokens, media):
            if media is not None:
                raise RuntimeError("tower exploded")
            return real(cache, tokens, media)

        model.run = broken
        got: dict = {}
        th = threading.Thread(
            target=lambda: got.update(text=llm.chat([{"role": "user", "content": "Count."}], p).outputs[0].token_ids)
        )
        th.start()
        wait_for(lambda: llm.engine.stats.tokens_generated >= len(solo) + 4)
        with pytest.raises(RuntimeError, match="tower exploded"):
            list(llm.stream(msgs(img(IMG_A)), SamplingParams(max_tokens=4)))
        th.join(60)
        assert got["text"] == solo
        model.run = real
        assert len(llm.chat(msgs(img(IMG_A)), SamplingParams(max_tokens=3)).outputs[0].token_ids) == 3
    finally:
        llm.close()


# -- the real server, driven by the OpenAI SDK

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module", params=BACKENDS)
def mm_server(request, gemma4):
    s = ServerProc(
        "--model",
        str(gemma4),
        "--backend",
        request.param,
        "--vision",
        "--audio",
        "--parallel",
        "2",
        "--max-tokens",
        "16",
        "--max-image-pixels",
        "200000",
        "--max-audio-seconds",
        "5",
    )
    yield s
    assert s.stop() == 0, s.stderr_tail()


def test_openai_sdk_image_and_audio(mm_server):
    c = openai.OpenAI(base_url=mm_server.base + "/v1", api_key="x", max_retries=0, timeout=120)
    content = [
        {"type": "text", "text": "What do you see and hear?"},
        {"type": "image_url", "image_url": {"url": image_url(IMG_A)}},
        {"type": "input_audio", "input_audio": {"data": wav_b64(AUD_A), "format": "wav"}},
    ]
    r = c.chat.completions.create(
        model="x", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens > 63 + 25  # the image's and the clip's placeholder tokens are counted
    stream = c.chat.completions.create(
        model="x", messages=[{"role": "user", "content": content}], max_tokens=6, temperature=0, stream=True
    )
    text = "".join(ch.choices[0].delta.content or "" for ch in stream if ch.choices)
    assert text == r.choices[0].message.content  # greedy: streaming and not agree


def test_server_media_errors(mm_server):
    import httpx

    def post(content):
        return httpx.post(
            mm_server.base + "/v1/chat/completions",
            timeout=60,
            json={"model": "x", "messages": [{"role": "user", "content": content}], "max_tokens": 2},
        )

    big = RNG.integers(0, 255, (500, 500, 3), dtype=np.uint8)  # 250000 > --max-image-pixels 200000
    r = post([{"type": "image_url", "image_url": {"url": image_url(big)}}])
    assert r.status_code == 413 and "over the limit of 200000" in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "messages[0].content[0]"
    r = post([{"type": "input_audio", "input_audio": {"data": wav_b64(np.zeros(16000 * 6)), "format": "wav"}}])
    assert r.status_code == 413 and "--max-audio-seconds" in r.json()["error"]["message"]
    r = post([{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}])
    assert r.status_code == 400 and "--allow-remote-media" in r.json()["error"]["message"]
    r = post([{"type": "image_url", "image_url": {"url": "/etc/passwd"}}])
    assert r.status_code == 400 and "--media-dir" in r.json()["error"]["message"]
    r = post([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert r.status_code == 400 and "could not be decoded" in r.json()["error"]["message"]
    r = post([{"type": "text", "text": "still fine"}])  # the server is unharmed
    assert r.status_code == 200


def test_text_server_refuses_media_naming_the_flag(tiny_llama):
    pytest.importorskip("torch")
    import httpx

    s = ServerProc("--model", str(tiny_llama), "--backend", "torch")
    try:
        r = httpx.post(
            s.base + "/v1/chat/completions",
            timeout=60,
            json={
                "model": "x",
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image_url(IMG_A)}}]}
                ],
            },
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert "model type 'llama' has no vision tower" in err["message"] and "--vision" in err["message"]
        assert err["type"] == "invalid_request_error"
    finally:
        s.stop()
