"""What report says has run where: every feature declares a record per device, and nothing claims a device on which
no run was recorded (a CUDA "verified" names the GPU session's results; the fake npu is a stand-in, never
"verified")."""

import re

from mm_adaptor import devices

from mm_adaptor.core import features

from mm_adaptor.core import verification
def test_every_feature_has_a_record_for_every_device():
    """The built-in features (test and calibration features registered by other tests are not the product's)."""
    for feature in features.built_in_features():
        assert set(feature.devices) == set(verification.DEVICES), f"{feature.name}: declare a record per device"


def test_no_feature_and_no_backend_claims_a_device_without_a_recorded_run():
    for feature in features.built_in_features():
        name, records = feature.name, feature.devices
        if records["cuda"].state in ("verified", "failed"):  # only what a GPU session ran, with its results
            sessions = (verification.H100_SESSION, verification.H100_SECOND_SESSION)
            assert any(session in records["cuda"].evidence for session in sessions), name
        else:
            assert records["cuda"].state == "not run", name
        assert records["npu"].state in ("not run", "stand-in"), name
        if records["npu"].state == "stand-in":
            assert "FAKE npu" in records["npu"].evidence and "only Ascend hardware can show" in records["npu"].evidence
    for name in ("reuse-fp32-param", "swap-attention", "fused-rotary-pos-emb"):  # changed since their GPU run
        assert features.get(name).devices["cuda"].evidence.startswith("today's code has not run on a GPU"), name
    assert not devices.make("cuda").verified_on_hardware
    assert not devices.make("npu").verified_on_hardware
    assert devices.make("cpu").verified_on_hardware


def test_the_summary_names_each_device():
    assert verification.summary("swap-optimizer") == "cpu verified, cuda verified, npu stand-in"
    assert verification.summary("swap-attention") == "cpu verified, cuda not run, npu stand-in"
    assert verification.summary("virtual-optimizer") == "cpu verified, cuda not run, npu not run"
    assert verification.summary("some-plugin") == "cpu not run, cuda not run, npu not run"


def test_report_shows_each_feature_on_each_device(monkeypatch):
    from mm_adaptor.cli.report import report_lines

    monkeypatch.setenv(devices.DEVICE_ENV, "cpu")
    text = "\n".join(report_lines())
    assert "verified here        verified" in text
    for feature in features.all_features():
        section = re.split(r"\n  (?=\S)", text.split(f"\n  {feature.name}: ", 1)[1], maxsplit=1)[0]
        for device in verification.DEVICES:
            assert f"    {device:<10} {verification.record(feature.name, device).state}:" in section, feature.name
