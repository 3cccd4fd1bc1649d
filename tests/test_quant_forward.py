"""Quantized weights inside the torch forward pass: ``--quantize fp8`` end to end on the CPU, the model built with
its projections kept quantized (quant_linear.QuantProj / fused QuantLinear, the layout CUDA runs), and the fused
concatenation of quantized parts.  The kernels themselves are tested in test_quant_formats.py (interpreted) and
by cuda_ext.selfcheck on a GPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import make_ckpt
from safetensors.torch import load_file, save_file
from test_quant_formats import PROMPT, run

from swiftlm.backends.torch import quant_linear as QL
from swiftlm.backends.torch.build import build, param_bytes
from swiftlm.backends.torch.model import PackedAttend
from swiftlm.backends.torch.quant_weights import dequantize_state
from swiftlm.quant_config import parse

SHAPE = ("--dtype", "float32", "--hidden", "128", "--intermediate", "256", "--layers", "2")


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("qfwd")


def _rounded_copy(src: Path, dst: Path) -> Path:
    """``src`` with every layer projection's weight replaced by its FP8 (per-row e4m3) rounding, in float32: the
    weights ``--quantize fp8`` runs, written by the plain reference arithmetic (``w8 * s``)."""
    shutil.copytree(src, dst)
    st = load_file(str(src / "model.safetensors"))
    for k, w in st.items():
        if k.endswith("_proj.weight") and ".layers." in k:
            s = (w.float().abs().amax(dim=1) / 448.0).clamp(min=1e-12)
            w8 = (w.float() / s[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn)
            st[k] = (w8.float() * s[:, None]).contiguous()
    save_file(st, str(dst / "model.safetensors"))
    return dst


def _run(path: Path, **settings) -> tuple[torch.Tensor, list[int]]:
    first, toks, _ = run(path, **settings)
    return first, toks


def test_quantize_fp8_runs_the_fp8_rounded_weights(root):
    """``--quantize fp8`` on the CPU runs the FP8-rounded weights in float32: the same float32 weights as the
    reference checkpoint written with them (rounded by independent arithmetic above), the same model, so the
    logits agree to float32 rounding (bound 1e-5 of the largest logit; observed 0) and greedy 32 tokens are
    equal.  The 16-bit run differs (FP8 rounding moves the logits), so the test can fail."""
    src = make_ckpt(root / "dense", *SHAPE)
    ref = _rounded_copy(src, root / "rounded")
    q_logits, q_toks = _run(src, quantize="fp8")
    r_logits, r_toks = _run(ref)
    d_logits, _ = _run(src)
    bound = 1e-5 * float(r_logits.abs().max())
    assert float((q_logits - r_logits).abs().max()) <= bound
    assert q_toks == r_toks and len(q_toks) == 32
    assert float((d_logits - r_logits).abs().max()) > 100 * bound


def test_quantize_refuses_a_quantized_checkpoint_and_unknown_methods(root):
    from swiftlm.config import Settings
    from swiftlm.errors import UnsupportedArchitecture

    with pytest.raises(ValueError, match="must be fp8"):
        Settings(quantize="int3")
    path = make_ckpt(root / "fp8ck", *SHAPE, "--quant-format", "fp8-channel")
    with pytest.raises(UnsupportedArchitecture, match="--quantize fp8 does not read quantized checkpoints"):
        _run(path, quantize="fp8")


def _all_logits(config: dict, state: dict) -> tuple[torch.Tensor, object]:
    m = build(config, state, torch.float32, torch.device("cpu"))
    tokens = torch.tensor(PROMPT)
    with torch.no_grad():
        return m(tokens, PackedAttend([len(PROMPT)], tokens.device), 0, last_only=False), m


@pytest.mark.parametrize("fmt", ["quantize-fp8", "fp8-tensor", "fp8-deepseek", "gptq-act-order", "awq", "gptq-8bit"])
def test_model_with_quantized_projections_equals_dequantised(root, fmt):
    """The model built with its projections kept quantized (QuantProj for o/down, fused QuantLinear for QKV and
    gate/up: the structure CUDA runs; here each call dequantises, the CPU branch of QuantLinear) against the model
    built from the dequantised weights: the same float32 weights (fused parts concatenated with their scales
    dequantise exactly), matmuls summed in another order, so logits at every position agree within 1e-5 of the
    largest.  FP8 per-tensor scales become per-row scales (fused Q/K/V carry three); 128x128 block scales of parts
    narrower than a block (this model's K/V) are repeated per row; act-order permutations are shared by the fused
    parts or the fusion falls back to the dequantised tensor."""
    src = make_ckpt(root / fmt, *SHAPE, *(() if fmt == "quantize-fp8" else ("--quant-format", fmt)))
    config = json.loads((src / "config.json").read_text())
    scheme = parse(config)
    config.pop("quantization_config", None)
    st = load_file(str(src / "model.safetensors"))
    if scheme is None:  # --quantize fp8: per-row FP8 on the CPU
        q_state = {
            k: (QL.quantize_fp8(v) if k.endswith("_proj.weight") and ".layers." in k else v) for k, v in st.items()
        }
        r_state = {k: (v.dequantized() if isinstance(v, QL.QuantLinear) else v) for k, v in q_state.items()}
    else:
        q_state = QL.quantized_state(dict(st), scheme)
        r_state = dequantize_state(dict(st), scheme)
    r_logits, r_model = _all_logits(config, r_state)
    q_logits, q_model = _all_logits(config, q_state)
    assert float((q_logits - r_logits).abs().max()) <= 1e-5 * float(r_logits.abs().max())
    layer = q_model.layers[0]
    kinds = {type(layer.self_attn.o_proj).__name__, type(layer.self_attn.qkv[0]).__name__}
    if fmt == "gptq-8bit":  # no 8-bit kernel: the dequantised weight, stored 16/32-bit
        assert param_bytes(q_model) == param_bytes(r_model)
    else:  # float32 reference: 4 bytes a weight; FP8 1 (+ a scale a row), int4 1/2 (+ group scales and zeros)
        assert kinds == {"QuantProj", "QuantParts" if fmt == "gptq-act-order" else "QuantLinear"}
        assert _proj_bytes(q_model) <= (0.3 if fmt.startswith(("fp8", "quantize")) else 0.2) * _proj_bytes(r_model)
        assert param_bytes(r_model) - param_bytes(q_model) == _proj_bytes(r_model) - _proj_bytes(q_model)


def _proj_bytes(m) -> int:
    return sum(
        QL.weight_bytes(w)
        for b in m.layers
        for w in (b.self_attn.qkv[0], b.self_attn.o_proj.weight, b.mlp.gate_up, b.mlp.down_proj.weight)
    )


def test_cat_rows_keeps_scales_with_their_rows():
    """Fused projections: per-row FP8 parts (each with its own scale), int4 parts with one column order, and a
    mix that cannot share a layout (different permutations: the dequantised tensor) dequantise to exactly the
    concatenation of the parts' weights; quantized parts of two column orders stay separate (QuantParts), a dense
    part makes the whole a dense tensor."""
    g = torch.Generator().manual_seed(0)
    parts = [QL.quantize_fp8(torch.randn(n, 64, generator=g) * (i + 1)) for i, n in enumerate((32, 16, 16))]
    fused = QL.cat_rows(parts)
    assert isinstance(fused, QL.QuantLinear) and fused.shape == (64, 64)
    assert torch.equal(fused.dequantized(), torch.cat([p.dequantized() for p in parts]))

    def int4(n: int, perm: torch.Tensor | None) -> QL.QuantLinear:
        codes = torch.randint(0, 16, (n, 64), generator=g)
        s, z = torch.rand(n, 2, generator=g), torch.randint(0, 16, (n, 2), generator=g).float()
        return QL.QuantLinear("int4", QL.pack_rows(codes), s, z, group=32, perm=perm)

    p1 = torch.randperm(64, generator=g)
    same = [int4(32, p1), int4(16, p1.clone())]
    assert isinstance(QL.cat_rows(same), QL.QuantLinear)
    assert torch.equal(QL.cat_rows(same).dequantized(), torch.cat([p.dequantized() for p in same]))
    mixed = [int4(32, p1), int4(16, torch.randperm(64, generator=g))]
    out = QL.cat_rows(mixed)
    assert isinstance(out, QL.QuantParts) and torch.equal(
        out.dequantized(), torch.cat([p.dequantized() for p in mixed])
    )
    dense = QL.cat_rows([torch.ones(8, 64), mixed[1]])
    assert torch.is_tensor(dense) and torch.equal(dense[8:], mixed[1].dequantized())
