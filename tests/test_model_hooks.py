"""The optional model hooks are one declared protocol (backend.ModelHooks): every model class
inherits it, and the core calls hooks directly instead of probing for them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from swiftlm.backend import ModelHooks

ROOT = Path(__file__).resolve().parent.parent
HOOKS = {
    "snapshot_prefix",
    "restore_prefix",
    "share_prefix",
    "kv_block_spec",
    "attach_kv_blocks",
    "adopt_prefix",
    "code_page_spec",
    "attach_code_pages",
    "kv_stats",
    "kv_default",
    "expert_stream",
    "hidden_states",
    "lora",
    "score",
    "close",
    "graph_capture",
    "reset_peak_memory",
}


def probes(source: str, filename: str = "<src>") -> list[str]:
    """``hasattr(x, HOOK)`` and ``getattr(x, HOOK, default)`` calls in ``source``."""
    out = []
    for node in ast.walk(ast.parse(source, filename)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)):
            continue
        name, args = node.func.id, node.args
        if name not in ("hasattr", "getattr") or len(args) < 2:
            continue
        if name == "getattr" and len(args) < 3:
            continue
        if isinstance(args[1], ast.Constant) and args[1].value in HOOKS:
            out.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return out


def test_no_hook_probes_in_the_core():
    found = [p for f in sorted((ROOT / "swiftlm").rglob("*.py")) for p in probes(f.read_text(), str(f))]
    assert found == []


def test_the_probe_check_finds_a_planted_probe(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        "def f(model):\n"
        "    if hasattr(model, 'snapshot_prefix'):\n"
        "        pass\n"
        "    return getattr(model, 'kv_stats', None), getattr(model, 'info')\n"
    )
    found = probes(planted.read_text(), str(planted))
    assert len(found) == 2 and ":2:" in found[0] and "kv_stats" in found[1]


def _model_classes() -> list[type]:
    from swiftlm.engine_views import ModelView
    from swiftlm.media.model import MultimodalModel

    classes: list[type] = [MultimodalModel, ModelView]
    fake = importlib.import_module("swiftlm_fake_backend")
    classes.append(fake.FakeModel)
    return classes


@pytest.mark.parametrize("cls", _model_classes(), ids=lambda c: c.__name__)
def test_model_classes_are_model_hooks(cls):
    assert issubclass(cls, ModelHooks)


def test_torch_model_is_model_hooks():
    pytest.importorskip("torch")
    from swiftlm.backends.torch.fallback import TransformersFallback
    from swiftlm.backends.torch.runner import TorchModel
    from swiftlm.backends.torch.vlm import TorchMultimodal

    for cls in (TorchModel, TorchMultimodal, TransformersFallback):
        assert issubclass(cls, ModelHooks)
    # the mixins' hooks win over the defaults, and the flags follow
    assert TorchModel.can_snapshot_prefix and TorchModel.can_share_prefix
    assert TorchModel.can_embed and TorchModel.can_score
    assert TorchModel.kv_block_spec is not ModelHooks.kv_block_spec


def test_flags_follow_the_hooks_a_class_defines():
    class Plain(ModelHooks):
        pass

    class Caching(Plain):
        def snapshot_prefix(self, seq_id):
            return ("rows", seq_id)

        def restore_prefix(self, seq_id, payload, n):
            pass

        def hidden_states(self, prompts):
            return []

    class Stage(Caching):  # withholds an inherited hook, for its subclasses too
        can_embed = False

    class SubStage(Stage):
        pass

    assert not Plain.can_snapshot_prefix and not Plain.can_embed and not Plain.can_share_prefix
    assert Caching.can_snapshot_prefix and Caching.can_embed and not Caching.can_score
    assert Stage.can_snapshot_prefix and not Stage.can_embed and not SubStage.can_embed
    m = Plain()  # the defaults: "not supported" / "nothing to report"
    assert m.snapshot_prefix(1) is None and m.share_prefix(1) is None and m.kv_block_spec() is None
    assert m.code_page_spec() is None and m.kv_stats() is None
    assert m.lora is None and m.expert_stream is None and m.graph_capture is None and m.kv_default is None
    m.close()
    m.reset_peak_memory()
    with pytest.raises(NotImplementedError):
        m.hidden_states([[1]])


def test_the_leader_forwards_hooks_and_declares_what_differs():
    from swiftlm.distributed.control import Leader

    class Local(ModelHooks):
        lora = "adapters"

        def share_prefix(self, seq_id):
            return ("blocks", seq_id)

    leader = Leader.__new__(Leader)  # (no follower connections: only attribute access is tested)
    leader.__dict__["_model"] = Local()
    assert not isinstance(leader, ModelHooks)
    assert leader.lora == "adapters" and leader.kv_block_spec() is None and leader.kv_stats() is None
    assert Local.can_share_prefix and not leader.can_share_prefix  # share_prefix is not mirrored to followers


def test_engine_process_view_declares_the_childs_facts():
    from swiftlm.engine_views import ModelView

    v = ModelView({"can_embed": True, "lora_names": ("a", "b"), "kv_default": None})
    assert v.can_embed and v.lora.names == ("a", "b") and not v.can_snapshot_prefix
    bare = ModelView({})
    assert not bare.can_embed and bare.lora is None and bare.kv_stats() is None
