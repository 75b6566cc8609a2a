"""scripts/setup.sh installs with uv, which reads none of pip's configuration: scripts/uv_options.py passes on the
indexes, find-links and constraints pip is configured with, a PIP_* variable over a file's value, and asks for pip's
best match across every index (uv's default takes the first index that has the package)."""

import subprocess
import sys

from scripts_loaded import SCRIPTS, load_script


def _script():
    return load_script("uv_options")


LISTED = """\
:env:.default-timeout='180'
:env:.find-links='/opt/wheels'
global.cert='/etc/ssl/certs/ca-certificates.crt'
global.constraint='/etc/xdg/pip/constraints.txt'
global.extra-index-url='file:///opt/pypi/simple file:///opt/pypi-more/simple'
global.find-links='/srv/older-wheels'
global.index-url='https://mirror.example/simple'
"""


def test_pips_indexes_find_links_and_constraints_become_uvs_options():
    options = _script().uv_options(LISTED)
    pairs = list(zip(options[::2], options[1::2]))
    assert pairs[0] == ("--index-strategy", "unsafe-best-match")
    assert sorted(pairs[1:]) == sorted([
        ("--find-links", "/opt/wheels"),  # the variable's, not the file's
        ("--constraint", "/etc/xdg/pip/constraints.txt"),
        ("--extra-index-url", "file:///opt/pypi/simple"), ("--extra-index-url", "file:///opt/pypi-more/simple"),
        ("--index-url", "https://mirror.example/simple"),
    ])


def test_the_install_section_wins_over_global_and_an_unconfigured_pip_adds_nothing():
    script = _script()
    listed = "install.find-links='/b'\nglobal.find-links='/a'\n"
    assert script.uv_options(listed)[2:] == ["--find-links", "/b"]
    assert script.uv_options("") == ["--index-strategy", "unsafe-best-match"]


def test_it_reads_this_pip_configuration(monkeypatch):
    monkeypatch.setenv("PIP_FIND_LINKS", "/somewhere/wheels")
    out = subprocess.run([sys.executable, str(SCRIPTS / "uv_options.py")], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert lines[lines.index("--find-links") + 1] == "/somewhere/wheels", out
