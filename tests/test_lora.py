"""LoRA adapters on the torch backend: PEFT files served per request (mixed in one batch), the
server's model=NAME selection, and `swiftlm finetune` (real learning on a tiny dataset)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from swiftlm import LLM, SamplingParams  # noqa: E402

RANK, ALPHA = 4, 8.0


def write_peft(
    d: Path,
    cfg: dict,
    seed: int,
    targets=("q_proj", "v_proj", "o_proj", "gate_proj", "down_proj"),
    scale_b: float = 0.5,
) -> dict:
    """A PEFT LoRA adapter with random A and B (B non-zero, so the adapter changes the output)."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    hd = cfg.get("head_dim") or H // cfg["num_attention_heads"]
    q, kv, inter = (
        cfg["num_attention_heads"] * hd,
        cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * hd,
        cfg["intermediate_size"],
    )
    dims = {
        "q_proj": (H, q),
        "k_proj": (H, kv),
        "v_proj": (H, kv),
        "o_proj": (q, H),
        "gate_proj": (H, inter),
        "up_proj": (H, inter),
        "down_proj": (inter, H),
    }
    t = {}
    for i in range(L):
        for p in targets:
            where = "self_attn" if p in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            fi, fo = dims[p]
            t[f"base_model.model.model.layers.{i}.{where}.{p}.lora_A.weight"] = torch.randn(RANK, fi, generator=g) * 0.3
            t[f"base_model.model.model.layers.{i}.{where}.{p}.lora_B.weight"] = (
                torch.randn(fo, RANK, generator=g) * scale_b
            )
    d.mkdir(parents=True, exist_ok=True)
    save_file(t, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(
        json.dumps(
            {"peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "target_modules": list(targets), "bias": "none"}
        )
    )
    return t


@pytest.fixture(scope="module")
def adapters(tiny_llama, tmp_path_factory):
    cfg = json.loads((tiny_llama / "config.json").read_text())
    root = tmp_path_factory.mktemp("lora")
    w1 = write_peft(root / "a1", cfg, 1)
    write_peft(root / "a2", cfg, 2, targets=("k_proj", "up_proj"))
    return {"a1": root / "a1", "a2": root / "a2", "w1": w1, "cfg": cfg}


@pytest.fixture(scope="module")
def lora_llm(tiny_llama, adapters):
    llm = LLM(str(tiny_llama), backend="torch", parallel=4, adapter=[f"a1={adapters['a1']}", f"a2={adapters['a2']}"])
    yield llm
    llm.close()


def hf_logits(tiny_llama, ids, extra: dict | None = None):
    """transformers' llama on the same weights, with W += scale * B @ A merged in (the LoRA by hand)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig.from_pretrained(str(tiny_llama))
    m = LlamaForCausalLM(cfg).float().eval()
    sd = {}
    for f in sorted(Path(tiny_llama).glob("*.safetensors")):
        sd.update(load_file(str(f)))
    for k, B in (extra or {}).items():
        if k.endswith("lora_B.weight"):
            A = extra[k.replace("lora_B", "lora_A")]
            name = k.replace("base_model.model.", "").replace(".lora_B.weight", ".weight")
            sd[name] = sd[name] + (ALPHA / RANK) * (B @ A)
    m.load_state_dict(sd, strict=False)
    with torch.no_grad():
        return m(torch.tensor([ids])).logits[0, -1]


def test_adapter_logits_equal_base_plus_lora_delta(lora_llm, tiny_llama, adapters):
    """First-step logits of the adapted model = transformers on W + (alpha/r) B A, fp32 within 1e-4."""
    model = lora_llm.engine.model
    ids = [1, 5, 9, 42, 7, 3]
    base = model.logits(900, ids, 0)
    model.free([900])
    adapted = model.logits(901, ids, 0, adapter=model.lora.index("a1"))
    model.free([901])
    ref_base, ref_adapted = hf_logits(tiny_llama, ids), hf_logits(tiny_llama, ids, adapters["w1"])
    assert (adapted - base).abs().max() > 1e-2  # the adapter changes the output
    assert torch.allclose(base, ref_base, atol=1e-4, rtol=0)
    assert torch.allclose(adapted, ref_adapted, atol=1e-4, rtol=0)


def test_mixed_batch_rows_match_solo_runs(lora_llm):
    """Base rows and two adapters in one batch: each row's greedy tokens are its solo run's, and
    the base rows equal a server-less base run."""
    prompts = ["hello world", "the quick brown fox", "one two three"]
    names = [None, "a1", "a2"]
    p = lambda a: SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, adapter=a)  # noqa: E731
    solo = {(pr, a): lora_llm.generate(pr, p(a)).token_ids for pr in prompts for a in names}
    from swiftlm.engine import SyncSink
    from swiftlm.llm import CompletionOutput, _collect

    lset = lora_llm.engine.model.lora
    seen, rows = [], lset.rows

    def spy(ids=None, device=None, single=0):
        if ids:
            seen.append(list(ids))
        return rows(ids, device, single)

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
    assert any(0 in ids and 1 in ids and 2 in ids for ids in seen)  # base + both adapters in one decode batch
    assert solo[(prompts[0], "a1")] != solo[(prompts[0], None)]
    assert solo[(prompts[0], "a2")] != solo[(prompts[0], None)]


def test_unknown_adapter_in_python_api_is_refused(lora_llm):
    from swiftlm.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="not loaded"):
        lora_llm.generate("hi", SamplingParams(max_tokens=2, adapter="nope"))


def test_bad_adapter_files_are_one_sentence(tiny_llama, tmp_path, adapters):
    from swiftlm.errors import ConfigError

    d = tmp_path / "bad"
    write_peft(d, {**adapters["cfg"], "hidden_size": adapters["cfg"]["hidden_size"] * 2}, 3, targets=("q_proj",))
    with pytest.raises(ConfigError, match="do not fit this model"):
        LLM(str(tiny_llama), backend="torch", adapter=[f"x={d}"])
    with pytest.raises(Exception, match="NAME=PATH"):
        LLM(str(tiny_llama), backend="torch", adapter=["no-equals-sign"])


def test_server_selects_adapter_by_model_name(tiny_llama, adapters, lora_llm):
    from server_util import ServerProc

    srv = ServerProc("--model", str(tiny_llama), "--backend", "torch", "--adapter", f"a1={adapters['a1']}")
    try:

        def complete(model):
            body = json.dumps(
                {"model": model, "prompt": "hello world", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
            ).encode()
            req = urllib.request.Request(srv.base + "/v1/completions", body, {"Content-Type": "application/json"})
            with urllib.request.urlopen(req, timeout=60) as r:
                return json.loads(r.read())

        base_name = json.loads(urllib.request.urlopen(srv.base + "/v1/models", timeout=10).read())["data"]
        ids = [m["id"] for m in base_name]
        assert "a1" in ids and len(ids) == 2
        base = next(m["id"] for m in base_name if m["id"] != "a1")
        t_base = complete(base)["choices"][0]["text"]
        t_a1 = complete("a1")["choices"][0]["text"]
        t_full = complete(f"{base}:a1")["choices"][0]["text"]
        want = lora_llm.generate(
            "hello world", SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, adapter="a1")
        ).text
        assert t_a1 == t_full == want
        assert t_a1 != t_base
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


CHATS = [
    ([{"role": "user", "content": "What is the capital of France?"}], "Paris is the capital."),
    ([{"role": "user", "content": "Name a color."}], "Blue sky blue."),
    ([{"role": "user", "content": "Count to three."}], "One two three."),
    ([{"role": "user", "content": "Say hello."}], "Hello there friend."),
]


def test_finetune_learns_and_adapter_serves(tiny_llama, tmp_path):
    from swiftlm.cli import main
    from swiftlm.finetune import finetune_torch

    data = tmp_path / "chat.jsonl"
    data.write_text(
        "".join(json.dumps({"messages": m + [{"role": "assistant", "content": a}]}) + "\n" for m, a in CHATS)
    )
    out = tmp_path / "adapter"
    res = finetune_torch(str(tiny_llama), str(data), str(out), rank=8, alpha=16, steps=30, lr=1e-2, fuse=True)
    print("losses", [round(x, 3) for x in res.losses])
    assert res.losses[-1] < 0.5 * res.losses[0]  # real learning on 4 chats
    assert json.loads((out / "adapter_config.json").read_text())["target_modules"] == ["q_proj", "v_proj"]
    llm = LLM(str(tiny_llama), backend="torch", adapter=[f"ft={out}"])
    try:
        msgs, answer = CHATS[0]
        prompt = llm.engine.chat_prompt(msgs)
        first = llm.tokenizer.encode(answer)[0]
        m = llm.engine.model
        base = m.logits(700, prompt, 0)
        m.free([700])
        tuned = m.logits(701, prompt, 0, adapter=m.lora.index("ft"))
        m.free([701])
        assert int(tuned.argmax()) == first and int(base.argmax()) != first
        p = lambda a: SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, adapter=a)  # noqa: E731
        assert llm.generate(prompt, p("ft")).token_ids != llm.generate(prompt, p(None)).token_ids
    finally:
        llm.close()
    fused = LLM(str(out / "fused"), backend="torch")  # --fuse: the merged checkpoint gives the adapted logits
    try:
        f = fused.engine.model.logits(702, prompt, 0)
        assert torch.allclose(f, tuned, atol=1e-4, rtol=0)
    finally:
        fused.close()
    assert (
        main(
            [
                "finetune",
                "--model",
                str(tiny_llama),
                "--data",
                str(tmp_path / "missing.jsonl"),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "finetune",
                "--backend",
                "mlx",
                "--device",
                "cpu",
                "--model",
                str(tiny_llama),
                "--data",
                str(data),
                "--out",
                str(tmp_path / "x"),
            ]
        )
        == 2
    )  # --device is torch's (mlx training: tests/test_lora_mlx.py)


def test_mlx_lm_adapter_format_loads_the_same(lora_llm, adapters, tmp_path):
    """The same A/B written in mlx-lm's layout (x @ lora_a @ lora_b, lora_parameters.scale) give the
    PEFT adapter's logits exactly (same weights, same scale)."""
    from safetensors.torch import save_file

    from swiftlm.backends.torch.lora import read_adapter

    d = tmp_path / "mlx"
    d.mkdir()
    t = {}
    for k, v in adapters["w1"].items():
        name = (
            k.replace("base_model.model.", "").replace(".lora_A.weight", ".lora_a").replace(".lora_B.weight", ".lora_b")
        )
        t[name] = v.t().contiguous()
    save_file(t, str(d / "adapters.safetensors"))
    (d / "adapter_config.json").write_text(
        json.dumps({"fine_tune_type": "lora", "lora_parameters": {"rank": RANK, "scale": ALPHA / RANK}})
    )
    model = lora_llm.engine.model
    aid = model.lora.add(read_adapter("mlx1", d))
    ids = [1, 5, 9, 42]
    got = model.logits(910, ids, 0, adapter=aid)
    model.free([910])
    want = model.logits(911, ids, 0, adapter=model.lora.index("a1"))
    model.free([911])
    assert torch.equal(got, want)


def test_adapter_with_speculative_decoding_is_refused(tiny_llama, tmp_path):
    """Drafts are verified on the base weights: an adapter request would get the base's tokens, so the
    combination is refused at start-up, before any load."""
    from conftest import run_cli

    r = run_cli(
        "generate",
        "--model",
        str(tiny_llama),
        "--backend",
        "torch",
        "--adapter",
        f"a1={tmp_path}",
        "--speculative",
        "ngram",
        "-p",
        "hi",
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "--adapter does not combine with speculative decoding" in r.stderr


def test_adapter_written_by_peft_gives_peft_logits(tiny_llama, tmp_path):
    """An adapter made and saved by peft itself (get_peft_model + save_pretrained, random A and B on
    q/v/down, rsLoRA off) served by name: first-step and 8-step greedy logits equal peft's own
    forward of the adapted transformers model, fp32, within 1e-4 (two implementations of the same
    fp32 sums: rounding only)."""
    import peft  # a dev dependency (pyproject [dev])
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_llama), torch_dtype=torch.float32).eval()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], lora_dropout=0.0)
    pm = peft.get_peft_model(hf, cfg).eval()
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)  # lora_B starts at zero: give it a real delta
    pm.save_pretrained(str(tmp_path / "peft_a"))
    llm = LLM(str(tiny_llama), backend="torch", parallel=2, adapter=[f"pa={tmp_path / 'peft_a'}"])
    try:
        model = llm.engine.model
        ids = [1, 5, 9, 42, 7, 3, 11, 2]
        ours = model.logits(950, ids, 0, adapter=model.lora.index("pa"))
        model.free([950])
        base = model.logits(951, ids, 0)
        model.free([951])
        with torch.no_grad():
            ref = pm(torch.tensor([ids])).logits[0, -1]
        assert (ours - base).abs().max() > 1e-2  # the adapter changes the output
        assert torch.allclose(ours, ref, atol=1e-4, rtol=0), float((ours - ref).abs().max())
        seq = list(ids)
        for _ in range(8):  # greedy through peft, token by token
            with torch.no_grad():
                seq.append(int(pm(torch.tensor([seq])).logits[0, -1].argmax()))
        got = (
            llm.generate(ids, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, adapter="pa"))
            .outputs[0]
            .token_ids
        )
        assert got == seq[len(ids) :]
    finally:
        llm.close()
