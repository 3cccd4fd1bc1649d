"""Test-suite start-up hook (tests/conftest.py puts this folder on PYTHONPATH): under ``TRITON_INTERPRET=1`` with
the Triton version it was written against, a kernel's nested ``@triton.jit`` calls skip re-patching the language
modules the kernel's launch has already patched.  Elsewhere it does nothing.

Triton's interpreter patches ``triton.language`` (every builtin, via ``inspect.getmembers``) when a kernel is
launched (``GridExecutor.__call__``, restored when the launch ends) and again at every call of a nested jit
function (``InterpretedFunction.__call__``, whose patch scope is dropped unrestored).  On modules the launch has
patched, that second patch finds no builtins left to wrap and replaces the tensor and core hooks with equivalent
new closures: it changes nothing, yet it was ~20% of the interpreted tests' time (the TurboQuant kernels call
their helpers per tile).  A nested function whose globals hold a language module the launch did not patch is
patched as Triton does (and the module is counted as patched for the rest of the launch).  The kernels run the
same numpy operations on the same values either way (bit-equal outputs: checked on test_code_pages' script)."""

import os

if os.environ.get("TRITON_INTERPRET") == "1":
    try:
        import triton
        from triton.runtime import interpreter as _ti
    except Exception:  # noqa: BLE001 - no triton, or one that fails to import: nothing to speed up
        _ti = None
    if _ti is not None and triton.__version__ == "3.9.0":
        import inspect

        import triton.language as _tl

        _orig_patch_lang = _ti._patch_lang
        _orig_launch = _ti.GridExecutor.__call__
        _launches: list[set] = []  # the modules each running launch has patched (innermost last)

        def _langs(fn) -> set:
            return {id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (_tl, _tl.core)}

        def _patch_lang(fn):
            if _launches:
                langs = _langs(fn)
                if langs <= _launches[-1]:
                    return _ti._LangPatchScope()  # nothing to undo: the launch's own scope restores the modules
                _launches[-1].update(langs)
            return _orig_patch_lang(fn)

        def _launch(self, *args, **kwargs):
            _launches.append(set())
            try:
                return _orig_launch(self, *args, **kwargs)
            finally:
                _launches.pop()

        _ti._patch_lang = _patch_lang
        _ti.GridExecutor.__call__ = _launch
