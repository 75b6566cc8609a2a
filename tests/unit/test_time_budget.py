"""The test command's time guard (scripts/time_budget.py): over 45 minutes on CI it fails, naming the files that
grew since the recorded breakdown; under it, or off CI, it only reports."""

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "time_budget.py"


def _guard():
    spec = importlib.util.spec_from_file_location("time_budget", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _times(path, **files):
    path.write_text(json.dumps({"legs": {"newest": files}}))
    return str(path)


def test_over_budget_on_ci_fails_naming_what_grew(tmp_path, monkeypatch, capsys):
    guard = _guard()
    monkeypatch.setattr(guard, "RECORDED", tmp_path / "recorded.json")
    guard.RECORDED.write_text(json.dumps({"legs": {"newest": {"tests/a.py": 100.0, "tests/b.py": 900.0}}}))
    now = _times(tmp_path / "now.json", **{"tests/a.py": 1500.0, "tests/b.py": 950.0, "tests/c.py": 400.0})
    monkeypatch.setenv("CI", "true")
    assert guard.main([str(guard.BUDGET_S + 60), now]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "over budget by 1.0 min" in last
    assert last.index("newest: tests/a.py (+1400 s)") < last.index("newest: tests/c.py (+400 s, new)"), last
    assert last.index("newest: tests/c.py") < last.index("newest: tests/b.py (+50 s)"), last


def test_within_budget_or_off_ci_it_only_reports(tmp_path, monkeypatch, capsys):
    guard = _guard()
    now = _times(tmp_path / "now.json", **{"tests/a.py": 10.0})
    monkeypatch.setenv("CI", "true")
    assert guard.main([str(guard.BUDGET_S), now]) == 0
    assert "of its 45-minute budget; slowest files: newest: tests/a.py 10 s" in capsys.readouterr().out
    monkeypatch.delenv("CI")
    assert guard.main([str(guard.BUDGET_S + 600), now]) == 0
