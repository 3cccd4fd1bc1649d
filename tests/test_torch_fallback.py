"""torch backend: architectures model.py does not implement run through transformers (the
"transformers fallback"), with the same greedy tokens as transformers' own ``generate``."""

from __future__ import annotations

import logging

import pytest
from conftest import needs_torch
from test_torch_config_fields import PROMPT, tok_dir, write_hf  # noqa: F401 (fixture)

pytestmark = [needs_torch]

N_TOKENS = 24


@pytest.mark.parametrize(
    "arch,extra",
    [
        ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)),
        ("olmo", dict(pad_token_id=0)),  # OLMo 1 (phi3, tested here before, is native now: test_torch_archs.py)
    ],
)
def test_fallback_greedy_equals_transformers(arch, extra, tok_dir, tmp_path, caplog):  # noqa: F811
    import torch
    import transformers

    from swiftlm import LLM
    from swiftlm.sampling import SamplingParams

    path = write_hf(tok_dir, tmp_path / arch, arch, **extra)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    prompts = [PROMPT, PROMPT[:9], PROMPT[5:20]]
    want = []
    with torch.no_grad():
        for p in prompts:
            out = ref.generate(
                torch.tensor([p]),
                max_new_tokens=N_TOKENS,
                min_new_tokens=N_TOKENS,
                do_sample=False,
                pad_token_id=0,
                eos_token_id=None,
            )
            want.append(out[0, len(p) :].tolist())
    with caplog.at_level(logging.INFO):
        llm = LLM(str(path), backend="torch", parallel=3, prefill_size=8)  # chunked prefill, 3 rows a step
    try:
        assert llm.engine.model.info.arch == f"{arch} (transformers fallback)"
        assert any("transformers fallback" in r.getMessage() for r in caplog.records)
        outs = llm.generate(prompts, SamplingParams(max_tokens=N_TOKENS, temperature=0, ignore_eos=True))
        assert [o.token_ids for o in outs] == want
    finally:
        llm.close()


def test_native_arch_is_not_fallback(tok_dir):  # noqa: F811
    from swiftlm.backends.torch import TorchBackend
    from swiftlm.registry import resolve

    assert TorchBackend().model_path(resolve(str(tok_dir))) == "native"


def test_unknown_to_transformers_refused(tok_dir, tmp_path):  # noqa: F811
    import json
    import shutil

    from swiftlm import LLM
    from swiftlm.errors import UnsupportedArchitecture

    path = tmp_path / "odd"
    shutil.copytree(tok_dir, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["model_type"] = "no_such_arch"
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception) as exc:
        LLM(str(path), backend="torch")
    assert "no_such_arch" in str(exc.value)
    assert isinstance(exc.value, UnsupportedArchitecture), type(exc.value)


def test_info_names_the_fallback(tok_dir, tmp_path):  # noqa: F811
    """`swiftlm info --model` says how the torch backend would run a checkpoint, without loading it."""
    import json

    from conftest import run_cli

    path = write_hf(tok_dir, tmp_path / "gpt2", "gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256)
    for model, want in ((path, "transformers fallback"), (tok_dir, "native")):
        r = run_cli("info", "--model", str(model), "--backend", "torch", "--json", timeout=120)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["model"]["runs_as"]["torch"] == want
