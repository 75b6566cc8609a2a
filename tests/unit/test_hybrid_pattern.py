"""--hybrid-layer-pattern without the megatron-core that has HybridModel (0.16, 0.17): one line, exit status 2, before
any rank starts, from train and from check; and the pattern rules, which need no megatron. (Training a HybridModel:
tests/latest/test_hybrid_model.py, on the newest megatron-core.)"""

import subprocess
import sys

import pytest

from mm_adaptor.train import hybrid

needs_no_hybrid_model = pytest.mark.skipif(hybrid.available(), reason="this megatron-core has HybridModel")


@needs_no_hybrid_model
@pytest.mark.parametrize("command", [["train"], ["check", "--use-flash-attn"]])
def test_the_flag_refuses_in_one_line_where_megatron_core_has_no_hybrid_model(command):
    done = subprocess.run([sys.executable, "-m", "mm_adaptor.cli", *command, "--hybrid-layer-pattern=*-*-"],
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    from mm_adaptor.train import megatron_training

    if command == ["train"] and megatron_training.missing():  # 0.16's wheel: no trainer at all, said first
        assert "(megatron.training), which megatron-core" in lines[0] and "does not ship" in lines[0], lines[0]
        return
    assert lines[0].startswith(f"mm-adaptor {command[0]}: error: --hybrid-layer-pattern needs megatron-core 0.18 "
                               "or newer"), lines[0]
    assert "is installed: drop --hybrid-layer-pattern or upgrade megatron-core" in lines[0]
    assert "iteration" not in done.stdout  # nothing trained


@pytest.mark.parametrize("pattern, words", [
    ("", "has no layer"),
    ("||", "has no layer"),
    ("*-/*-", "multi-token prediction"),
    ("*-x", "'x' is not a layer symbol"),
    ("*-|", "empty pipeline segment"),
    ("+-", "multi-latent attention"),
    ("D-", "DeepSeek sparse attention"),
])
def test_patterns_the_driver_cannot_build(pattern, words):
    problem = hybrid.pattern_problem(pattern)
    assert problem is not None and words in problem and "\n" not in problem, problem


def test_mamba_names_the_missing_package_or_what_the_driver_builds():
    problem = hybrid.pattern_problem("M*M-")
    if hybrid._has_package("mamba_ssm"):
        assert "not built by the driver" in problem
    else:
        assert "mamba-ssm package" in problem and "not installed" in problem


@pytest.mark.parametrize("pattern", ["*-*-", "*E*E", "*-|*-", "-*", "*"])
def test_patterns_it_builds(pattern):
    assert hybrid.pattern_problem(pattern) is None
