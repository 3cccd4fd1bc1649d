"""LoRA adapters on the MLX backend: mlx-lm and PEFT adapter directories served per request (mixed
in one decode batch), compared with mlx-lm's own ``load(path, adapter_path=...)``; the server's
model=NAME selection; and ``swiftlm finetune --backend mlx`` (mlx-lm's trainer) really learning.

The model is tiny (hidden 64, 2 layers, SmolLM2's 49k vocabulary): MLX's CPU matmuls are slow."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
from conftest import make_ckpt, needs_mlx

pytestmark = needs_mlx

RANK, SCALE = 4, 2.0
TARGETS = ("self_attn.q_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.down_proj")
CHATS = [
    ([{"role": "user", "content": "What is the capital of France?"}], "Paris is the capital."),
    ([{"role": "user", "content": "Name a color."}], "Blue sky blue."),
    ([{"role": "user", "content": "Count to three."}], "One two three."),
    ([{"role": "user", "content": "Say hello."}], "Hello there friend."),
]
SYSTEM = [{"role": "system", "content": "Be brief."}]  # a short prompt (SmolLM2's default system prompt is long)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_ckpt(
        tmp_path_factory.mktemp("ck") / "tiny",
        "--arch",
        "llama",
        "--dtype",
        "float32",
        "--hidden",
        "64",
        "--layers",
        "2",
        "--heads",
        "2",
        "--kv-heads",
        "1",
        "--intermediate",
        "128",
    )


def _dims(cfg: dict) -> dict:
    H = cfg["hidden_size"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv, inter = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd, cfg["intermediate_size"]
    return {
        "q_proj": (H, q),
        "k_proj": (H, kv),
        "v_proj": (H, kv),
        "o_proj": (q, H),
        "gate_proj": (H, inter),
        "up_proj": (H, inter),
        "down_proj": (inter, H),
    }


def write_mlx_lm(d: Path, cfg: dict, seed: int, targets=TARGETS) -> dict[str, np.ndarray]:
    """An mlx-lm adapter directory with random lora_a [in, r] and lora_b [r, out] (b non-zero)."""
    import mlx.core as mx

    rng = np.random.default_rng(seed)
    dims = _dims(cfg)
    t = {}
    for i in range(cfg["num_hidden_layers"]):
        for k in targets:
            fi, fo = dims[k.rpartition(".")[2]]
            t[f"model.layers.{i}.{k}.lora_a"] = (rng.standard_normal((fi, RANK)) * 0.3).astype(np.float32)
            t[f"model.layers.{i}.{k}.lora_b"] = (rng.standard_normal((RANK, fo)) * 0.5).astype(np.float32)
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "adapters.safetensors"), {k: mx.array(v) for k, v in t.items()})
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "fine_tune_type": "lora",
                "num_layers": cfg["num_hidden_layers"],
                "lora_parameters": {"rank": RANK, "scale": SCALE, "dropout": 0.0, "keys": list(targets)},
            }
        )
    )
    return t


def write_peft_from(d: Path, t: dict[str, np.ndarray]) -> None:
    """The same A/B in PEFT's layout: A = lora_a^T [r, in], B = lora_b^T [out, r], alpha / r = SCALE."""
    import mlx.core as mx

    out = {}
    for k, v in t.items():
        mod, _, leaf = k.rpartition(".")
        out[f"base_model.model.{mod}.lora_{'A' if leaf == 'lora_a' else 'B'}.weight"] = mx.array(v.T.copy())
    d.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(d / "adapter_model.safetensors"), out)
    (d / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": RANK,
                "lora_alpha": SCALE * RANK,
                "bias": "none",
                "target_modules": sorted({k.rpartition(".")[2] for k in TARGETS}),
            }
        )
    )


@pytest.fixture(scope="module")
def adapters(tiny, tmp_path_factory):
    cfg = json.loads((tiny / "config.json").read_text())
    root = tmp_path_factory.mktemp("lora_mlx")
    t1 = write_mlx_lm(root / "a1", cfg, 1)
    write_mlx_lm(root / "a2", cfg, 2, targets=("self_attn.k_proj", "mlp.up_proj"))
    write_peft_from(root / "p1", t1)
    return {"a1": root / "a1", "a2": root / "a2", "p1": root / "p1", "cfg": cfg}


@pytest.fixture(scope="module")
def lora_llm(tiny, adapters):
    from swiftlm import LLM

    llm = LLM(
        str(tiny),
        backend="mlx",
        parallel=4,
        adapter=[f"a1={adapters['a1']}", f"a2={adapters['a2']}", f"p1={adapters['p1']}"],
    )
    yield llm
    llm.close()


def _np(x) -> np.ndarray:
    import mlx.core as mx

    return np.array(x.astype(mx.float32))


def _logits(model, ids, adapter=0, sid=900) -> np.ndarray:
    out = _np(model.logits(sid, ids, 0, adapter=adapter))
    model.free([sid])
    return out


def test_adapter_logits_equal_mlx_lm_load(lora_llm, tiny, adapters):
    """First-step logits with an adapter = mlx-lm's ``load(path, adapter_path=...)`` model (its
    LoRALinear layers) on the same ids; fp32, the same ops in the same order: within 1e-5
    (expected equal).  The base (no adapter) = mlx-lm's plain ``load``, and the PEFT copy of the
    same weights gives the same logits."""
    import mlx.core as mx
    from mlx_lm.utils import load

    model = lora_llm.engine.model
    ids = [1, 5, 9, 42, 7, 3, 300, 12]
    base = _logits(model, ids)
    adapted = _logits(model, ids, model.lora.index("a1"))
    peft = _logits(model, ids, model.lora.index("p1"))
    ref, _ = load(str(tiny), adapter_path=str(adapters["a1"]))
    ref_adapted = np.array(ref(mx.array([ids]))[0, -1])
    plain, _ = load(str(tiny))
    ref_base = np.array(plain(mx.array([ids]))[0, -1])
    assert np.abs(adapted - base).max() > 1e-1  # the adapter changes the output
    assert np.abs(adapted - ref_adapted).max() <= 1e-5
    assert np.abs(base - ref_base).max() <= 1e-5
    assert np.abs(peft - adapted).max() <= 1e-5


def test_mixed_batch_rows_match_solo_runs(lora_llm, tiny):
    """Base rows and two adapters decoded in one batch: each row's greedy tokens are its solo run's,
    and the base rows' tokens and logits equal a model loaded without adapters."""
    from swiftlm import LLM, SamplingParams
    from swiftlm.engine import SyncSink
    from swiftlm.llm import CompletionOutput, _collect

    prompts = ["hello world", "the quick brown fox", "one two three"]
    names = [None, "a1", "a2"]
    p = lambda a: SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, adapter=a)  # noqa: E731
    solo = {(pr, a): lora_llm.generate(pr, p(a)).token_ids for pr in prompts for a in names}
    lset = lora_llm.engine.model.lora
    seen, rows = [], lset.rows

    def spy(ids=None, single=0):
        if ids:
            seen.append(list(ids))
        return rows(ids, single)

    lset.rows = spy
    try:
        jobs = [(pr, a) for pr in prompts for a in names]
        sinks = []
        for pr, a in jobs:  # submitted together: decoded in shared batches (parallel=4)
            sinks.append(SyncSink())
            lora_llm.engine.submit(lora_llm.engine.text_prompt(pr), p(a), sinks[-1])
        for (pr, a), sink in zip(jobs, sinks):
            out = CompletionOutput(0)
            for ev in sink:
                _collect(out, ev)
            assert out.token_ids == solo[(pr, a)], (pr, a)
    finally:
        del lset.rows
    assert any(0 in ids and 1 in ids and 2 in ids for ids in seen), seen  # base + both adapters in one batch
    assert solo[(prompts[0], "a1")] != solo[(prompts[0], None)]
    assert solo[(prompts[0], "a2")] != solo[(prompts[0], None)]
    plain = LLM(str(tiny), backend="mlx")
    try:
        for pr in prompts:
            assert plain.generate(pr, p(None)).token_ids == solo[(pr, None)]
        ids = lora_llm.engine.text_prompt(prompts[1])
        assert np.array_equal(_logits(plain.engine.model, ids), _logits(lora_llm.engine.model, ids))
    finally:
        plain.close()


def test_unknown_and_bad_adapters_are_refused(lora_llm, tiny, tmp_path, adapters):
    from swiftlm import LLM, SamplingParams
    from swiftlm.errors import ConfigError, InvalidRequest

    with pytest.raises(InvalidRequest, match="not loaded"):
        lora_llm.generate("hi", SamplingParams(max_tokens=2, adapter="nope"))
    d = tmp_path / "bad"
    write_mlx_lm(
        d, {**adapters["cfg"], "hidden_size": adapters["cfg"]["hidden_size"] * 2}, 3, targets=("self_attn.q_proj",)
    )
    with pytest.raises(ConfigError, match="do not fit this model"):
        LLM(str(tiny), backend="mlx", adapter=[f"x={d}"])
    with pytest.raises(ConfigError, match="no adapter_config.json"):
        LLM(str(tiny), backend="mlx", adapter=[f"x={tmp_path}"])


def test_server_selects_adapter_by_model_name(tiny, adapters, lora_llm):
    from server_util import ServerProc

    from swiftlm import SamplingParams

    srv = ServerProc("--model", str(tiny), "--backend", "mlx", "--adapter", f"a1={adapters['a1']}")
    try:

        def complete(model):
            body = json.dumps(
                {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            ).encode()
            req = urllib.request.Request(srv.base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())

        listed = json.loads(urllib.request.urlopen(srv.base + "/v1/models", timeout=10).read())["data"]
        ids = [m["id"] for m in listed]
        assert "a1" in ids and len(ids) == 2
        base = next(m["id"] for m in listed if m["id"] != "a1")
        assert next(m for m in listed if m["id"] == "a1").get("parent") == base
        t_base = complete(base)["choices"][0]["text"]
        t_a1 = complete("a1")["choices"][0]["text"]
        t_full = complete(f"{base}:a1")["choices"][0]["text"]
        want = lora_llm.generate(
            "hello world", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, adapter="a1")
        ).text
        base_want = lora_llm.generate(
            "hello world", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        ).text
        assert t_a1 == t_full == want
        assert t_base == base_want and t_a1 != t_base
        for bad in ("a9", f"{base}:a9"):
            body = json.dumps({"model": bad, "prompt": "hi", "max_tokens": 2}).encode()
            req = urllib.request.Request(srv.base + "/v1/completions", body, {"Content-Type": "application/json"})
            with pytest.raises(urllib.error.HTTPError) as ei:
                urllib.request.urlopen(req, timeout=30)
            assert ei.value.code == 404
            err = json.loads(ei.value.read())["error"]
            assert err["code"] == "model_not_found" and err["param"] == "model"
    finally:
        srv.stop()


def test_finetune_mlx_learns_and_adapter_serves(tiny, tmp_path, capsys):
    """`swiftlm finetune --backend mlx` (mlx-lm's trainer) on 4 chats: the loss goes down, the
    answer's first token becomes the argmax on its training prompt (it was not before), the adapter
    loads in mlx-lm and in our server, and the fused checkpoint gives the adapted logits."""
    import mlx.core as mx
    from mlx_lm.utils import load

    from swiftlm import LLM, SamplingParams
    from swiftlm.cli import main

    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": SYSTEM + m + [{"role": "assistant", "content": a}]}) + "\n" for m, a in CHATS)
    )
    out = tmp_path / "adapter"
    assert (
        main(
            [
                "finetune",
                "--backend",
                "mlx",
                "--model",
                str(tiny),
                "--data",
                str(data),
                "--out",
                str(out),
                "--rank",
                "16",
                "--alpha",
                "32",
                "--steps",
                "30",
                "--lr",
                "3e-3",
                "--batch-size",
                "4",
                "--targets",
                "q_proj,v_proj,o_proj,down_proj",
                "--fuse",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    res = json.loads(lines[-1])
    print("\n".join(lines))
    assert res["steps"] == 30 and res["last_loss"] < 0.1 * res["first_loss"]  # real learning
    assert lines[0].startswith("step 1: loss") and any(x.startswith("step 30: loss") for x in lines)
    assert (out / "adapters.safetensors").is_file()
    acfg = json.loads((out / "adapter_config.json").read_text())
    assert acfg["fine_tune_type"] == "lora" and acfg["lora_parameters"]["scale"] == 2.0
    llm = LLM(str(tiny), backend="mlx", adapter=[f"ft={out}"])
    try:
        m = llm.engine.model
        for msgs, answer in CHATS[::-1]:  # every training prompt's answer now starts right; the base's does not
            prompt = llm.engine.chat_prompt(SYSTEM + msgs)
            first = llm.tokenizer.encode(answer)[0]
            base = _logits(m, prompt)
            tuned = _logits(m, prompt, m.lora.index("ft"))
            assert int(tuned.argmax()) == first and int(base.argmax()) != first, answer
        p = lambda a: SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, adapter=a)  # noqa: E731
        assert llm.generate(prompt, p("ft")).token_ids[0] == first
        assert llm.generate(prompt, p(None)).token_ids[0] != first
    finally:
        llm.close()
    ref, _ = load(str(tiny), adapter_path=str(out))  # mlx-lm reads what we wrote
    assert np.abs(np.array(ref(mx.array([prompt]))[0, -1]) - tuned).max() <= 1e-5
    fused = LLM(str(out / "fused"), backend="mlx")  # --fuse: mlx-lm's fuse; the merged weights
    try:
        f = _logits(fused.engine.model, prompt)
        assert np.abs(f - tuned).max() <= 1e-4
    finally:
        fused.close()
