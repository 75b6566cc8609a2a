"""The trainer runs on megatron.training, which the megatron-core wheel ships from 0.17: where it cannot be
imported (0.16's wheel), `mm-adaptor train` refuses in one line naming the fix (a Megatron-LM checkout on
PYTHONPATH, or megatron-core 0.17+), before importing torch. On the 0.16.1 leg this is the real wheel."""

import importlib.util
import subprocess
import sys

_RUNNER = """
import importlib.util, sys
if sys.argv[1] == "hide":  # as on megatron-core 0.16: no megatron.training
    find_spec = importlib.util.find_spec
    importlib.util.find_spec = lambda name, *a: None if name == "megatron.training" else find_spec(name, *a)
from mm_adaptor.cli import main
status = main(["train", "--train-iters", "2"])
print(f"status={status} torch_imported={'torch' in sys.modules}")
"""


def test_without_megatron_training_train_refuses_naming_the_fix():
    present = importlib.util.find_spec("megatron.training") is not None
    done = subprocess.run([sys.executable, "-c", _RUNNER, "hide" if present else "as-installed"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "status=2 torch_imported=False", (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm-adaptor train: error: "), lines
    assert "megatron.training" in lines[0] and "PYTHONPATH" in lines[0] and "0.17 or newer" in lines[0], lines[0]
