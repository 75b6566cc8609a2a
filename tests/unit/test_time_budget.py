"""The test command's time guard (scripts/time_budget.py): past 45 minutes it warns and past 60 it fails on CI, each
naming the files that grew since the recorded breakdown; under 45, or off CI, it only reports."""

import json

from scripts_loaded import load_script


def _guard():
    return load_script("time_budget")


def _times(path, **files):
    path.write_text(json.dumps({"legs": {"newest": files}}))
    return str(path)


def _grown_run(guard, tmp_path, monkeypatch):
    monkeypatch.setattr(guard, "RECORDED", tmp_path / "recorded.json")
    guard.RECORDED.write_text(json.dumps({"legs": {"newest": {"tests/a.py": 100.0, "tests/b.py": 900.0}}}))
    return _times(tmp_path / "now.json", **{"tests/a.py": 1500.0, "tests/b.py": 950.0, "tests/c.py": 400.0})


def test_over_the_limit_on_ci_fails_naming_what_grew(tmp_path, monkeypatch, capsys):
    guard = _guard()
    now = _grown_run(guard, tmp_path, monkeypatch)
    monkeypatch.setenv("CI", "true")
    assert guard.main([str(guard.FAIL_S + 60), now]) == 1
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "over the 60-minute limit by 1.0 min" in last
    assert last.index("newest: tests/a.py (+1400 s)") < last.index("newest: tests/c.py (+400 s, new)"), last
    assert last.index("newest: tests/c.py") < last.index("newest: tests/b.py (+50 s)"), last


def test_between_the_lines_it_warns_and_passes(tmp_path, monkeypatch, capsys):
    # 47.7 min: the clean clone whose every test passed on a slower machine, which the old 45-minute line failed
    guard = _guard()
    now = _grown_run(guard, tmp_path, monkeypatch)
    monkeypatch.setenv("CI", "true")
    assert guard.main([str(47.7 * 60), now]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "warning, past 45 min by 2.7 min" in last and "newest: tests/a.py (+1400 s)" in last, last
    assert guard.main([str(guard.FAIL_S), now]) == 0


def test_within_budget_or_off_ci_it_only_reports(tmp_path, monkeypatch, capsys):
    guard = _guard()
    now = _times(tmp_path / "now.json", **{"tests/a.py": 10.0})
    monkeypatch.setenv("CI", "true")
    assert guard.main([str(guard.WARN_S), now]) == 0
    out = capsys.readouterr().out
    assert "(warns past 45, fails CI past 60); slowest files: newest: tests/a.py 10 s" in out
    assert "warning" not in out
    monkeypatch.delenv("CI")
    assert guard.main([str(guard.FAIL_S + 600), now]) == 0
