"""SWIFTLM_GIL_SWITCH_MS (swiftlm/gil.py): the engine's process hands the GIL over at the interval asked for;
anything that is not a positive number of milliseconds up to 1000 leaves the interval as it was."""

from __future__ import annotations

import sys

import pytest

from swiftlm.gil import tune_switch_interval


@pytest.fixture
def restore():
    old = sys.getswitchinterval()
    yield
    sys.setswitchinterval(old)


def test_sets_interval(monkeypatch, restore):
    monkeypatch.setenv("SWIFTLM_GIL_SWITCH_MS", "0.5")
    assert tune_switch_interval() == pytest.approx(0.0005)
    assert sys.getswitchinterval() == pytest.approx(0.0005)


@pytest.mark.parametrize("raw", ["", "abc", "0", "-1", "nan", "5000"])
def test_bad_or_unset_values_leave_it(monkeypatch, restore, raw):
    sys.setswitchinterval(0.003)
    monkeypatch.setenv("SWIFTLM_GIL_SWITCH_MS", raw)
    assert tune_switch_interval() == pytest.approx(0.003)
