"""SWIFTLM_LOG_COMPILES: the hooks chained onto Triton's runtime knobs log each compile and keep hooks already set."""

import logging

import pytest

pytest.importorskip("triton", reason="Triton is not installed")


def test_compile_hooks_log_and_chain(caplog, monkeypatch):
    from triton import knobs

    from swiftlm.cuda_ext import compile_log

    seen = []
    monkeypatch.setattr(knobs.runtime, "jit_cache_hook", lambda **kw: seen.append(("start", kw["key"])))
    monkeypatch.setattr(knobs.runtime, "jit_post_compile_hook", lambda **kw: seen.append(("done", kw["key"])))
    assert compile_log.install()
    before = compile_log.COUNT[0]

    class Fn:
        name = "_tq_attn_kernel"

    # the keyword arguments Triton's JITFunction._call_hook passes
    kw = dict(
        key=("sig", 7),
        repr="_tq_attn_kernel[num_warps=4](N: i32)",
        fn=Fn(),
        compile={},
        is_manual_warmup=False,
        already_compiled=False,
    )
    with caplog.at_level(logging.WARNING, logger="swiftlm.compile"):
        assert not knobs.runtime.jit_cache_hook(**kw)  # a true value would make Triton skip the compile
        knobs.runtime.jit_post_compile_hook(**kw)
    assert seen == [("start", ("sig", 7)), ("done", ("sig", 7))]
    assert compile_log.COUNT[0] == before + 1
    (rec,) = [r for r in caplog.records if r.name == "swiftlm.compile"]
    assert "_tq_attn_kernel" in rec.getMessage() and "N: i32" in rec.getMessage()
    assert " ms " in rec.getMessage() and "nan" not in rec.getMessage()
    assert "key=('sig', 7)" in rec.getMessage()
