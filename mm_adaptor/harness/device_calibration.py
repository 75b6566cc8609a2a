"""Calibrations stored per device type, layout and precision: how close a legitimate rounding change (the fifths
perturbation, calibration.py) came to the harness's limits on that device. `mm-adaptor calibrate` writes the
device's own file; the package ships the ones measured for it (calibrations/<device>.json), and a file written on
this machine takes precedence.

`check` reads the entry of its device, layout and precision. Where a legitimate change reached more than the limits
(a device whose own rounding differs from the CPU's in ways the noise draws do not cover), that device's limits are
raised so that the worst legitimate change sits at LEGITIMATE_SHARE of them, and the verdict says so; where none is
stored, the verdict says the limits are the ones calibrated on the CPU."""

from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass
from pathlib import Path

DIR_ENV = "MM_ADAPTOR_CALIBRATION_DIR"
SHIPPED = Path(__file__).with_name("calibrations")
LEGITIMATE_SHARE = 0.8


def user_dir() -> Path:
    setting = os.environ.get(DIR_ENV, "").strip()
    return Path(setting) if setting else Path.home() / ".cache" / "mm_adaptor" / "calibrations"


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


@dataclass(frozen=True)
class Stored:
    device: str
    layout: str
    precision: str
    worst: float  # the worst legitimate ratio over the models calibrated
    models: tuple[str, ...]
    date: str
    source: Path

    @property
    def factor(self) -> float:
        return 1.0 if self.worst <= 1.0 else self.worst / LEGITIMATE_SHARE

    def describe(self) -> str:
        raised = (f"; limits x{self.factor:.2f} on this device, so that it sits at {LEGITIMATE_SHARE:g} of them"
                  if self.factor != 1.0 else "")
        where = "shipped" if self.source.parent == SHIPPED else str(self.source)
        return (f"{self.device} {self.layout} {self.precision} ({', '.join(self.models)}; {self.date}, {where}): a "
                f"legitimate rounding change reached {self.worst:.2f} of the limits{raised}")


def lookup(device: str, layout: str | None, precision: str) -> Stored | None:
    if layout is None:
        return None
    for path in (user_dir() / f"{device}.json", SHIPPED / f"{device}.json"):
        models = _read(path).get("rows", {}).get(layout, {}).get(precision, {})
        if models:
            return Stored(device, layout, precision, max(m["second"] for m in models.values()), tuple(sorted(models)),
                          max(m["date"] for m in models.values()), path)
    return None


def describe_lookup(device: str, layout: str | None, precision: str, stored: Stored | None) -> str:
    if stored is not None:
        return stored.describe()
    if layout is None:
        return "none for a layout given by parallel-size flags; the limits are the ones calibrated on the CPU"
    return (f"none stored for {device} {layout} {precision}; the limits are the ones calibrated on the CPU "
            f"(`mm-adaptor calibrate --layout {layout} --precision {precision}` on this device stores its own)")


def store(device: str, rows, *, directory: Path | None = None, versions: dict | None = None) -> Path:
    """Merge calibration.NoiseRow results into the device's file (one entry per layout, precision and model)."""
    directory = directory or user_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{device}.json"
    data = _read(path) or {"device": device, "rows": {}}
    today = datetime.date.today().isoformat()
    for row in rows:
        entry = {"second": round(max(row.second.values(), default=0.0), 4), "date": today, **(versions or {})}
        data["rows"].setdefault(row.layout, {}).setdefault(row.precision, {})[row.model] = entry
    path.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    return path


def apply(limits, layout: str | None, applied: bool = True) -> str:
    """Raise `limits` (verdict.Limits) by this device's stored calibration, where it asks; what the verdict says."""
    from mm_adaptor import devices

    if not applied:
        return "not applied (measuring against the base limits)"
    device = devices.current_or_chosen().name
    stored = lookup(device, layout, limits.precision)
    if stored is not None:
        limits.factor *= stored.factor
    return describe_lookup(device, layout, limits.precision, stored)
