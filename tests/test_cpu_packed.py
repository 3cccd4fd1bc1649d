"""oneDNN-packed fp32 weights on the CPU (backends/torch/cpu_packed.py): every matrix a step multiplies gets a
packed copy, ``rows_linear`` through it equals the MKL path within fp32 rounding at 1-64 rows, the switch
and the memory gate hold, and gradients through the activations keep the differentiable path."""

from __future__ import annotations

import pytest
from conftest import needs_torch


@pytest.fixture()
def module(tiny_llama, monkeypatch):
    monkeypatch.setenv("SWIFTLM_CPU_PACK", "0")  # load without packing: each test packs as it needs
    from swiftlm.backends.torch.runner import load_model
    from swiftlm.registry import resolve

    return load_model(resolve(str(tiny_llama)), None).module


@needs_torch
def test_packed_rows_linear_equals_mkl(module, monkeypatch):
    import torch

    from swiftlm.backends.torch import cpu_packed
    from swiftlm.backends.torch.linear_rows import rows_linear

    ws = cpu_packed._weights(module)
    a = module.a
    assert len(ws) == 4 * a.layers + 1  # qkv, o, gate_up, down per layer; the LM head
    reference = {}
    g = torch.Generator().manual_seed(0)
    xs = {n: torch.randn(n, a.hidden, generator=g) for n in (1, 2, 3, 16, 64)}
    w, b = module.layers[0].self_attn.qkv
    with torch.inference_mode():
        for n, x in xs.items():
            reference[n] = rows_linear(x, w, b)
    monkeypatch.setenv("SWIFTLM_CPU_PACK", "1")
    added = cpu_packed.pack(module)
    assert added == sum(t.numel() * 4 for t in ws)
    assert all(cpu_packed.packed(t) is not None for t in ws)
    with torch.inference_mode():
        for n, x in xs.items():
            got = rows_linear(x, w, b)
            assert got.shape == reference[n].shape
            # fp32 both ways; one dot product of `hidden` terms summed in another order
            torch.testing.assert_close(got, reference[n], rtol=1e-5, atol=1e-5)
    x = xs[3].clone().requires_grad_(True)  # LoRA fine-tuning: gradients must reach x
    rows_linear(x, w, b).sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(3, -1), rtol=1e-5, atol=1e-5)


@needs_torch
def test_pack_switch_and_memory_gate(module, monkeypatch):
    from swiftlm.backends.torch import cpu_packed

    monkeypatch.setenv("SWIFTLM_CPU_PACK", "0")
    assert cpu_packed.pack(module) == 0
    assert all(cpu_packed.packed(t) is None for t in cpu_packed._weights(module))
    monkeypatch.setenv("SWIFTLM_CPU_PACK", "auto")
    monkeypatch.setattr(cpu_packed, "_available_bytes", lambda: 1000)  # a copy that would not fit: not made
    assert cpu_packed.pack(module) == 0
    assert all(cpu_packed.packed(t) is None for t in cpu_packed._weights(module))
    monkeypatch.setattr(cpu_packed, "_available_bytes", lambda: 1 << 40)
    assert cpu_packed.pack(module) > 0
