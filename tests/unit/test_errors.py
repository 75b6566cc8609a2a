"""An uncaught configuration error under the one-line import: one line on rank 0, nothing elsewhere, exit 1;
programmatic callers still catch it."""

import os
import subprocess

import pytest
import warm_python
from stderr_lines import without_torch_notes

from mm_adaptor.devices import NoAcceleratorError
from mm_adaptor.core.errors import ConfigurationError
from mm_adaptor.core.features import FeatureConfigError
from mm_adaptor.core.patching import PatchContractError

SCRIPT = '''
import mm_adaptor.megatron_adaptor  # noqa: F401
{body}
'''


def run_script(body: str, rank: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "MM_ADAPTOR_DEVICE", "TORCHELASTIC_RUN_ID")}
    if rank is not None:
        env["RANK"] = rank
    return warm_python.run(["-c", SCRIPT.format(body=body)], timeout=300, env=env)


RAISE_CONFIG_ERROR = '''
from mm_adaptor.core.features import FeatureConfigError
raise FeatureConfigError("--use-fused-swiglu needs --swiglu:\\nadd --swiglu or drop --use-fused-swiglu")
'''


@pytest.mark.parametrize("rank, expected", [
    ("0", "mm_adaptor: error: --use-fused-swiglu needs --swiglu: add --swiglu or drop --use-fused-swiglu\n"),
    (None, "mm_adaptor: error: --use-fused-swiglu needs --swiglu: add --swiglu or drop --use-fused-swiglu\n"),
    ("1", ""),
])
def test_uncaught_configuration_error_prints_one_line_on_rank_zero_only(rank, expected):
    result = run_script(RAISE_CONFIG_ERROR, rank)
    assert result.returncode == 1
    assert without_torch_notes(result.stderr) == expected and result.stdout == ""


def test_under_torchrun_other_ranks_let_rank_zero_print_first(monkeypatch, capsys):
    """torchrun stops every rank as soon as one exits: rank 0, which prints Megatron-LM's arguments table before
    failing the same way, must not be stopped before its line is out."""
    from mm_adaptor.core import errors
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    errors._excepthook(FeatureConfigError, FeatureConfigError("x"), None)
    assert slept == [errors.OTHER_RANKS_GRACE_S] and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    errors._excepthook(FeatureConfigError, FeatureConfigError("x"), None)
    assert slept == [errors.OTHER_RANKS_GRACE_S] and capsys.readouterr().err == "mm_adaptor: error: x\n"


def test_other_errors_keep_their_traceback():
    result = run_script("raise KeyError('not ours')", "1")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "KeyError: 'not ours'" in result.stderr


def test_configuration_errors_share_a_catchable_base():
    for error in (FeatureConfigError, PatchContractError, NoAcceleratorError):
        assert issubclass(error, ConfigurationError)
    assert issubclass(FeatureConfigError, ValueError) and issubclass(NoAcceleratorError, RuntimeError)
    with pytest.raises(ConfigurationError):
        raise FeatureConfigError("caught like any exception")
