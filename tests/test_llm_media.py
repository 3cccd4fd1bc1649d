"""LLM.chat passes images and audio to the model: the first token's log-probability changes with
the image and the clip, and repeats for the same ones (it dropped the media before, giving the
text-only answer for every image)."""

import pytest
from conftest import HAS_TORCH, make_ckpt

pytest.importorskip("PIL.Image")
pytest.importorskip("soundfile")
pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="torch not installed on this machine")

from test_multimodal import AUD_A, AUD_B, IMG_A, IMG_B, aud, img, msgs  # noqa: E402


def test_llm_chat_uses_the_media(tmp_path_factory):
    from swiftlm import LLM, SamplingParams

    path = make_ckpt(tmp_path_factory.mktemp("mm") / "gemma4", "--arch", "gemma4")
    llm = LLM(str(path), backend="torch", vision=True, audio=True, parallel=2)
    try:
        p = SamplingParams(max_tokens=1, temperature=0, logprobs=True, top_logprobs=5)

        def first(m):
            o = llm.chat(m, p).outputs[0]
            return [(t, round(v, 5)) for t, _, v in o.logprobs[0].top]

        a, b, text = first(msgs(img(IMG_A))), first(msgs(img(IMG_B))), first(msgs())
        assert a != b and a != text
        assert first(msgs(img(IMG_A))) == a
        assert first(msgs(aud(AUD_A))) != first(msgs(aud(AUD_B)))
    finally:
        llm.close()
