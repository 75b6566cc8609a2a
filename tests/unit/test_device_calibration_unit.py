"""Calibrations stored per device type, layout and precision (mm_adaptor.harness.device_calibration)."""

import json

import pytest

from mm_adaptor.harness import device_calibration
from mm_adaptor.harness.calibration import NoiseRow


def _row(layout, precision, model, worst):
    return NoiseRow(layout, precision, model, noise={}, second={"gradients": worst, "loss": worst / 2})


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(device_calibration.DIR_ENV, str(tmp_path / "user"))
    monkeypatch.setattr(device_calibration, "SHIPPED", tmp_path / "shipped")  # none: only what a test stores
    return tmp_path / "user"


def test_a_stored_calibration_is_found_by_device_layout_and_precision(user_dir):
    path = device_calibration.store("cuda", [_row("single", "fp32", "gpt", 0.5), _row("single", "fp32", "llama", 0.9)],
                                    versions={"torch": "x"})
    assert path == user_dir / "cuda.json"
    stored = device_calibration.lookup("cuda", "single", "fp32")
    assert (stored.worst, stored.models, stored.factor) == (0.9, ("gpt", "llama"), 1.0)
    assert json.loads(path.read_text())["rows"]["single"]["fp32"]["gpt"]["torch"] == "x"
    assert device_calibration.lookup("cuda", "single", "bf16") is None
    assert device_calibration.lookup("cuda", "tp2", "fp32") is None
    assert device_calibration.lookup("cuda", None, "fp32") is None
    device_calibration.store("cuda", [_row("single", "fp32", "gpt", 0.4)])  # merged: llama's entry stays
    assert device_calibration.lookup("cuda", "single", "fp32").worst == 0.9


def test_limits_are_raised_only_where_a_legitimate_change_exceeded_them(user_dir):
    device_calibration.store("cuda", [_row("single", "bf16", "llama", 1.2)])
    stored = device_calibration.lookup("cuda", "single", "bf16")
    assert stored.factor == pytest.approx(1.2 / device_calibration.LEGITIMATE_SHARE)
    assert "limits x1.50 on this device" in stored.describe()


def test_without_a_stored_calibration_the_verdict_says_the_limits_are_the_cpu_ones(user_dir):
    line = device_calibration.describe_lookup("cuda", "single", "bf16", None)
    assert "none stored for cuda single bf16" in line and "mm-adaptor calibrate --layout single" in line


def test_a_file_written_on_this_machine_takes_precedence_over_the_shipped_one(user_dir, tmp_path_factory, monkeypatch):
    shipped = tmp_path_factory.mktemp("shipped")
    device_calibration.store("cuda", [_row("single", "fp32", "gpt", 0.3)], directory=shipped)
    monkeypatch.setattr(device_calibration, "SHIPPED", shipped)
    assert device_calibration.lookup("cuda", "single", "fp32").worst == 0.3
    assert "shipped" in device_calibration.lookup("cuda", "single", "fp32").describe()
    device_calibration.store("cuda", [_row("single", "fp32", "gpt", 0.6)])
    assert device_calibration.lookup("cuda", "single", "fp32").worst == 0.6


def test_check_raises_its_limits_by_the_stored_factor_and_says_so(user_dir):
    from mm_adaptor.harness.verdict import Limits

    device_calibration.store("cpu", [_row("single", "bf16", "llama", 1.2), _row("tp2", "bf16", "llama", 0.7)])
    limits = Limits("bf16", {}, factor=2.0)
    said = device_calibration.apply(limits, "single")
    assert limits.factor == pytest.approx(2.0 * 1.5) and "limits x1.50 on this device" in said
    limits = Limits("bf16", {}, factor=2.0)
    assert "reached 0.70 of the limits" in device_calibration.apply(limits, "tp2") and limits.factor == 2.0
    assert device_calibration.apply(limits, "tp2", applied=False).startswith("not applied")
    assert "none stored for cpu pp2 bf16" in device_calibration.apply(limits, "pp2") and limits.factor == 2.0
