"""/v1/embeddings: pooling math, the engine's embedding job on both backends, an embedding-only
checkpoint (Qwen3-Embedding layout) against transformers, and the route through the openai SDK."""

from __future__ import annotations

import base64
import json

import numpy as np
import openai
import pytest
import requests
from conftest import BACKENDS, make_ckpt
from server_util import ServerProc
from tolerances import transformer_logits_tol

from swiftlm.embeddings import embed, finish, is_embedding_only, pool, pooling_for

TEXTS = ["The capital of France is Paris.", "a b c", "Embeddings map text to vectors of numbers."]


@pytest.fixture(scope="module")
def emb_ckpt(tmp_path_factory):
    return make_ckpt(
        tmp_path_factory.mktemp("emb") / "qwen3emb",
        "--arch",
        "qwen3",
        "--dtype",
        "float32",
        "--embedding-only",
        "--hidden",
        "64",
        "--intermediate",
        "128",
    )


# ---------------------------------------------------------------- pooling math (core)
def test_pool_and_finish_math():
    rng = np.random.default_rng(0)
    h = rng.standard_normal((5, 8)).astype(np.float32)
    assert np.array_equal(pool(h, "last"), h[-1]) and np.array_equal(pool(h, "cls"), h[0])
    assert np.allclose(pool(h, "mean"), h.mean(axis=0), atol=1e-6)
    v = finish(h[0])
    assert abs(float(np.linalg.norm(v)) - 1.0) < 1e-6 and np.allclose(v * np.linalg.norm(h[0]), h[0], atol=1e-5)
    t = finish(h[0], dimensions=3)  # Matryoshka: truncate, then renormalise
    assert t.shape == (3,) and np.allclose(t, h[0, :3] / np.linalg.norm(h[0, :3]), atol=1e-6)
    with pytest.raises(ValueError):
        pool(h, "max")
    with pytest.raises(ValueError):
        pool(h[:0], "mean")


def test_pooling_from_checkpoint(emb_ckpt, tiny_llama):
    spec_like = type("S", (), {})
    e, g = spec_like(), spec_like()
    e.path, e.config = emb_ckpt, json.loads((emb_ckpt / "config.json").read_text())
    g.path, g.config = tiny_llama, json.loads((tiny_llama / "config.json").read_text())
    assert is_embedding_only(e.config) and not is_embedding_only(g.config)
    assert pooling_for(e) == "last"  # from 1_Pooling/config.json (pooling_mode_lasttoken)
    assert pooling_for(g) == "mean"  # a generative model asked for embeddings
    (emb_ckpt / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    try:
        assert pooling_for(e) == "mean"  # the sentence-transformers config decides
    finally:
        (emb_ckpt / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))


# ---------------------------------------------------------------- the engine's job
@pytest.mark.parametrize("backend", BACKENDS)
def test_alone_equals_in_batch_and_self_cosine(backend, tiny_llama):
    from swiftlm import LLM

    llm = LLM(str(tiny_llama), backend=backend)
    try:
        e = llm.engine
        prompts = [e.text_prompt(t) for t in TEXTS]
        batch = e.embed(prompts).result(timeout=120)
        for i, p in enumerate(prompts):
            alone = e.embed([p]).result(timeout=120)[0]
            # packed with other inputs (torch) the math is the same up to summation order; 1e-5 on
            # unit vectors is far above fp32's rounding walk here
            assert float(np.abs(alone - batch[i]).max()) <= 1e-5
            assert abs(float(alone @ alone) - 1.0) < 1e-5
        assert float(batch[0] @ batch[1]) < 0.9999  # different texts, different vectors
        small = e.embed(prompts[:1], dimensions=16).result(timeout=120)[0]
        assert small.shape == (16,) and abs(float(np.linalg.norm(small)) - 1) < 1e-5
    finally:
        llm.close()


def test_embedding_only_checkpoint_matches_transformers(emb_ckpt):
    """Our torch forward's last-token state of a Qwen3Model checkpoint vs transformers' AutoModel
    (the reference a sentence-transformers user gets), within the derived fp32 tolerance."""
    import torch
    import transformers

    from swiftlm import LLM

    ref = transformers.AutoModel.from_pretrained(str(emb_ckpt), torch_dtype=torch.float32).eval()
    llm = LLM(str(emb_ckpt), backend="torch")
    try:
        e = llm.engine
        assert e.info.embedding_only and e.info.pooling == "last"
        ids = e.text_prompt(TEXTS[0])
        ours = e.model.hidden_states([ids])[0]
        with torch.no_grad():
            theirs = ref(torch.tensor([ids])).last_hidden_state[0].numpy()
        mag = float(np.abs(theirs).max())
        tol = transformer_logits_tol(ref.config, mag, context=len(ids))
        diff = float(np.abs(ours - theirs).max())
        assert diff <= tol, (diff, tol)
        vec = e.embed([ids]).result(timeout=60)[0]
        assert np.allclose(vec, embed([theirs], "last")[0], atol=tol / max(float(np.linalg.norm(theirs[-1])), 1e-9) * 4)
        with pytest.raises(Exception, match="embeddings only"):
            llm.generate("hi")
    finally:
        llm.close()


# ---------------------------------------------------------------- the route
@pytest.fixture(scope="module")
def emb_server(emb_ckpt):
    s = ServerProc("--model", str(emb_ckpt), "--backend", "torch")
    yield s
    assert s.stop() == 0, s.stderr_tail()


def test_openai_sdk_embeddings(emb_server):
    c = openai.OpenAI(base_url=emb_server.base + "/v1", api_key="x", max_retries=0, timeout=60)
    r = c.embeddings.create(model="anything", input=TEXTS)  # the SDK asks for base64 and decodes it
    assert [d.index for d in r.data] == [0, 1, 2] and r.usage.prompt_tokens == r.usage.total_tokens > 0
    vecs = np.array([d.embedding for d in r.data], dtype=np.float32)
    assert np.allclose(np.linalg.norm(vecs, axis=1), 1.0, atol=1e-5)
    f = requests.post(
        emb_server.base + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "float"}, timeout=60
    ).json()
    assert np.array_equal(np.array(f["data"][1]["embedding"], dtype=np.float32), vecs[1])  # float == base64
    b = requests.post(
        emb_server.base + "/v1/embeddings", json={"input": TEXTS, "encoding_format": "base64"}, timeout=60
    ).json()
    assert np.array_equal(np.frombuffer(base64.b64decode(b["data"][2]["embedding"]), "<f4"), vecs[2])
    d = c.embeddings.create(model="x", input=TEXTS[0], dimensions=8, encoding_format="float")
    assert len(d.data[0].embedding) == 8


def test_token_id_inputs_equal_text(emb_server):
    from swiftlm.registry import resolve
    from swiftlm.tokenizer import load_hf_tokenizer

    spec = resolve(emb_server.ready["model"])
    tok = load_hf_tokenizer(spec.path, spec.config)
    ids = tok.encode(TEXTS[0], add_special_tokens=True)
    url = emb_server.base + "/v1/embeddings"
    by_text = requests.post(url, json={"input": TEXTS[0], "encoding_format": "float"}, timeout=60).json()
    by_ids = requests.post(url, json={"input": ids, "encoding_format": "float"}, timeout=60).json()
    by_ids2 = requests.post(url, json={"input": [ids, ids], "encoding_format": "float"}, timeout=60).json()
    assert by_text["data"][0]["embedding"] == by_ids["data"][0]["embedding"]  # the same forward: exact
    assert np.abs(np.array(by_ids2["data"][1]["embedding"]) - by_ids["data"][0]["embedding"]).max() <= 1e-5
    assert by_ids["usage"]["prompt_tokens"] == len(ids)


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 100000}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 12}, "input"),
        ({"input": [10**9]}, "input"),
        ({}, "input"),
    ],
)
def test_bad_input_is_400(emb_server, body, param):
    r = requests.post(emb_server.base + "/v1/embeddings", json=body, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert requests.get(emb_server.base + "/health", timeout=10).status_code == 200  # still serving


def test_generation_on_embedding_model_is_400(emb_server):
    r = requests.post(
        emb_server.base + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
        timeout=60,
    )
    assert r.status_code == 400 and "embeddings only" in r.json()["error"]["message"]
