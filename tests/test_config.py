"""One settings class: env vars, CLI flags over env, help text per field, loud unsupported flags."""

from __future__ import annotations

import argparse

import pytest
from conftest import run_cli

from swiftlm.config import Settings, add_settings_arguments, settings_from_args
from swiftlm.errors import NotSupportedYet


def _parse(argv, groups=None):
    p = argparse.ArgumentParser()
    add_settings_arguments(p, groups)
    return settings_from_args(p.parse_args(argv))


def test_env_sets_and_flag_overrides(monkeypatch):
    monkeypatch.setenv("SWIFTLM_PORT", "6000")
    monkeypatch.setenv("SWIFTLM_TEMP", "0.25")
    s = _parse([])
    assert s.port == 6000 and s.temp == 0.25
    s = _parse(["--port", "7000"])
    assert s.port == 7000 and s.temp == 0.25


def test_defaults_follow_swiftlm():
    s = Settings()
    assert (s.port, s.host, s.max_tokens, s.prefill_size, s.num_draft_tokens) == (5413, "127.0.0.1", 2048, 512, 4)


def test_every_setting_has_help_and_a_flag():
    p = argparse.ArgumentParser()
    add_settings_arguments(p)
    helps = {a.dest: a.help for a in p._actions if a.dest in Settings.model_fields}
    # extra_models has no flag of its own: it is filled by repeating --model
    flagless = {n for n, f in Settings.model_fields.items() if (f.json_schema_extra or {}).get("no_flag")}
    assert flagless == {"extra_models"}
    assert set(helps) == set(Settings.model_fields) - flagless
    for name, h in helps.items():
        assert h and f"SWIFTLM_{name.upper()}" in h


def test_turbo_kv_takes_optional_preset():
    from swiftlm.turboquant.presets import settings_format

    assert _parse(["--turbo-kv"]).turbo_kv == "default"
    assert _parse(["--turbo-kv", "k4v3"]).turbo_kv == "k4v3"
    assert _parse(["--turbo-kv", "off"]).turbo_kv is None
    s = _parse(["--turbo-kv", "--turbo-kv-window", "64", "--turbo-kv-keep-layers", "1"])
    s.check_supported()  # built: accepted
    fmt = settings_format(s)
    assert (fmt.name, fmt.window, fmt.keep_layers) == ("k4v3", 64, 1)
    assert settings_format(_parse([])).compressed is False


def test_bad_turbo_kv_preset_exits_2_from_cli():
    r = run_cli("generate", "-p", "hi", "--turbo-kv", "k9v2")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "turbo" in r.stderr.lower()


def test_unbuilt_features_are_refused():
    """The not-built mark (no field carries it today: --pipeline-parallel, the last one, is built) still
    refuses a set flag loudly and leaves an unset one alone."""
    from swiftlm.config import _f

    class Later(Settings):
        teleport: bool = _f(False, "Not yet.", group="planned", not_built="teleportation")

    Later().check_supported()  # unset: fine
    with pytest.raises(NotSupportedYet, match="--teleport: teleportation is not supported yet"):
        Later(teleport=True).check_supported()
    assert not [n for n, f in Settings.model_fields.items() if (f.json_schema_extra or {}).get("not_built")]


def test_pipeline_parallel_is_accepted():
    s = _parse(["--pipeline-parallel", "2"])
    s.check_supported()
    assert s.pipeline_parallel == 2


@pytest.mark.parametrize("flag,tower", [("--vision", "vision"), ("--audio", "audio")])
def test_media_flag_on_a_text_model_exits_2(flag, tower):
    r = run_cli("serve", "--port", "0", flag)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"{flag}: smollm2-135m-instruct" in r.stderr and f"has no {tower} tower" in r.stderr


def test_info_plans_the_turbo_kv_cache():
    """`swiftlm info --turbo-kv` plans the compressed cache by the layout formula (k4v3 at 8K on
    SmolLM2: the bytes a filled cache measures, tests/test_kv_compressed.py)."""
    import json

    r = run_cli("info", "--model", "smollm2-135m-instruct", "--turbo-kv", "--ctx-size", "8192", "--json")
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["memory_plan"]
    assert plan["kv_format"] == "k4v3"
    assert plan["kv_cache_16bit_bytes"] == 8192 * plan["kv_bytes_per_token"]
    assert plan["kv_cache_bytes"] <= 0.30 * plan["kv_cache_16bit_bytes"]
