"""Bad input to every command fails before any work: one line on stderr naming the flag and the fix, exit status 2,
no usage block, no traceback, and torch never imported (so no rank started and nothing trained). The trainer's
command line (Megatron-LM's parser, which imports torch) has its own: tests/train/test_trainer_command_line.py."""

import subprocess
import sys

import pytest

# Runs the CLI in a fresh interpreter and reports on stdout whether torch got imported.
# the harness's runner checks its arguments as the old driver did (a feature that serves any configuration)
CHECK = ["check", "--optimize-vocab-parallel-ce"]
_RUNNER = """
import sys
from mm_adaptor.cli import main
try:
    status = main(sys.argv[1:])
except SystemExit as exc:
    status = exc.code
print(f"status={status} torch_imported={'torch' in sys.modules}")
"""


def _run(*argv: str, cwd=None) -> tuple[str, list[str]]:
    done = subprocess.run([sys.executable, "-c", _RUNNER, *argv], capture_output=True, text=True, timeout=120,
                          cwd=cwd)
    return done.stdout.strip(), done.stderr.splitlines()


def _assert_one_line_refusal(argv, expected, cwd=None):
    stdout, stderr = _run(*argv, cwd=cwd)
    assert stdout == "status=2 torch_imported=False", (stdout, stderr)
    assert len(stderr) == 1, stderr
    assert stderr[0].startswith(f"mm-adaptor {argv[0]}: error: ") or stderr[0].startswith("mm-adaptor: error: ")
    for text in expected:
        assert text in stderr[0], stderr[0]


@pytest.mark.parametrize("argv, expected", [
    ([*CHECK, "--hidden-size", "63", "--num-attention-heads", "4"],
     ["--hidden-size 63 is not divisible by --num-attention-heads 4", "e.g. 64"]),
    ([*CHECK, "--num-attention-heads", "2", "--tensor-model-parallel-size", "4", "--nproc-per-node", "4"],
     ["--num-attention-heads 2 is not divisible by --tensor-model-parallel-size 4"]),
    ([*CHECK, "--layout", "single", "--num-attention-heads", "4",
      "--num-query-groups", "3"],
     ["--num-attention-heads 4 is not divisible by --num-query-groups 3"]),
    ([*CHECK, "--vocab-size", "129", "--tensor-model-parallel-size", "2"],
     ["--vocab-size 129 is not divisible by --tensor-model-parallel-size 2"]),
    ([*CHECK, "--seq-length", "33", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     ["--seq-length 33 is not divisible by --tensor-model-parallel-size 2", "--sequence-parallel"]),
    ([*CHECK, "--micro-batch-size", "0"], ["--micro-batch-size 0: must be at least 1"]),
    ([*CHECK, "--lr", "nan"], ["--lr nan: must be 0 or more"]),
    ([*CHECK, "--nproc-per-node", "2", "--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
      "--context-parallel-algo", "ulysses_cp_algo", "--num-attention-heads", "3", "--hidden-size", "48"],
     ["--context-parallel-algo ulysses_cp_algo splits", "--num-attention-heads 3", "not divisible by 2"]),
    ([*CHECK, "--nproc-per-node", "2", "--tensor-model-parallel-size", "1", "--context-parallel-size", "2",
      "--use-flash-attn"], ["--use-flash-attn and --context-parallel-size 2 both replace", "keep one"]),
    ([*CHECK, "--nproc-per-node", "4", "--tensor-model-parallel-size", "1", "--context-parallel-size", "4",
      "--context-parallel-algo", "hybrid_cp_algo"], ["hybrid_cp_algo needs --ulysses-degree-in-cp"]),
    ([*CHECK, "--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--context-parallel-size", "2"],
     ["world size 2 is not divisible by --tensor-model-parallel-size 2 x --pipeline-model-parallel-size 1 x "
      "--context-parallel-size 2"]),
    ([*CHECK, "--attention-dropout", "1.5"], ["--attention-dropout 1.5: must be in [0, 1)"]),
    ([*CHECK, "--save", "/proc/x"], ["--save /proc/x cannot be written", "writable directory"]),
    ([*CHECK, "--load", "/nonexistent"], ["--load /nonexistent: no such directory"]),
    ([*CHECK, "--use-fused-rmsnrom"], ["unrecognized argument --use-fused-rmsnrom",
                                        "did you mean --use-fused-rmsnorm?",
                                        "--help"]),
    ([*CHECK, "--train-iters"], ["--train-iters: expected one argument"]),
    ([*CHECK, "--train-iters", "ten"], ["--train-iters: invalid int value: 'ten'"]),
    ([*CHECK, "--use-fused-rmsnorm"], ["--use-fused-rmsnorm needs --normalization RMSNorm"]),
    (["check", "--use-fused-rmsnorm", "--layout", "tp2"],
     ["--use-fused-rmsnorm needs --normalization RMSNorm", "add --normalization RMSNorm"]),
    (["check", "--use-fused-rmsnrom", "--layout", "tp2"], ["did you mean --use-fused-rmsnorm?"]),
    (["check", "--use-fused-rmsnorm", "--layout", "tp3"], ["--layout tp3: not a layout", "did you mean tp2?"]),
    (["check", "--use-fused-rmsnorm", "--iters", "0"], ["--iters 0: must be at least 1"]),
    (["check", "--use-fused-rmsnorm", "--normalization", "RMSNorm", "--hidden-size", "63"],
     ["--hidden-size 63 is not divisible by --num-attention-heads"]),
    (["check", "--use-fused-rmsnorm", "--normalization", "RMSNorm", "--num-experts", "4",
      "--expert-model-parallel-size", "2", "--layout", "tp2-sp", "--disable-bias-linear"],
     ["world size 2 is not divisible by expert tensor-parallel size 2", "use a multiple of 4 ranks"]),
    (["check", "--use-fused-rmsnorm", "--normalization", "RMSNorm", "--tensor-model-parallel-size", "2",
      "--sequence-parallel", "--num-experts", "4", "--expert-model-parallel-size", "2", "--disable-bias-linear",
      "--nproc-per-node", "2"],
     ["world size 2 is not divisible by expert tensor-parallel size 2", "use a multiple of 4 ranks"]),
    (["calibrate", "--precision", "fp64"], ["--precision: invalid choice: 'fp64'"]),
    (["build-ops", "--device", "tpu"], ["--device: invalid choice: 'tpu'"]),
    (["fingerprint", "no.such.thing"], ["cannot resolve 'no.such.thing'"]),
    (["fingerprint", "json.no_such_function"], ["cannot resolve 'json.no_such_function'", "no_such_function"]),
    (["report", "--verbos"], ["unrecognized argument --verbos", "did you mean --verbose?"]),
    (["trian"], ["unknown command trian", "did you mean train?"]),
], ids=lambda value: " ".join(value) if isinstance(value, list) and value and value[0][:1] != "-" else None)
def test_bad_input_is_refused_in_one_line_before_any_work(argv, expected):
    _assert_one_line_refusal(argv, expected)


def test_load_of_a_directory_without_a_checkpoint_is_refused(tmp_path):
    _assert_one_line_refusal([*CHECK, "--load", str(tmp_path)], [f"--load {tmp_path} holds no checkpoint"])


def test_load_whose_marker_names_a_missing_iteration_is_refused(tmp_path):
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("20")
    _assert_one_line_refusal([*CHECK, "--load", str(tmp_path)], ["names iteration 20 but iter_0000020 is missing"])


def test_save_onto_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    _assert_one_line_refusal([*CHECK, "--save", str(target)], [f"--save {target} is a file"])


def test_every_problem_is_named_at_once():
    stdout, stderr = _run(*CHECK, "--hidden-size", "63", "--vocab-size", "129", "--tensor-model-parallel-size", "2")
    assert stdout == "status=2 torch_imported=False"
    assert len(stderr) >= 2 and all(line.startswith("mm-adaptor check: error: ") for line in stderr), stderr
    assert any("--hidden-size 63" in line for line in stderr) and any("--vocab-size 129" in line for line in stderr)


@pytest.mark.parametrize("argv", [["--help"], ["check", "--help"]])  # train's help is Megatron-LM's parser's
def test_help_does_not_import_torch(argv):
    stdout, stderr = _run(*argv)
    assert stdout.endswith("status=0 torch_imported=False"), stdout[-200:]
    assert "usage: mm-adaptor" in stdout and not stderr


@pytest.mark.parametrize("layout_flags", [
    ["--pipeline-model-parallel-size", "2"],
    ["--expert-model-parallel-size", "2", "--num-experts", "4"],
    ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],  # 4 ranks by default
    ["--pipeline-model-parallel-size=2", "--num-layers-per-virtual-pipeline-stage", "1"],
    ["--context-parallel-size", "2", "--nproc-per-node", "2"],  # CP2 on 2 ranks: no TP2 added to it
], ids=" ".join)
def test_check_without_layout_takes_the_parallel_flags_as_the_layout(layout_flags):
    """No default layout (tp2-sp) is added to them: the one problem named is the planted one."""
    stdout, stderr = _run("check", "--use-fused-rmsnorm", "--normalization", "RMSNorm", *layout_flags,
                          "--hidden-size", "63")
    assert stdout == "status=2 torch_imported=False", (stdout, stderr)
    assert len(stderr) == 1 and "--hidden-size 63 is not divisible" in stderr[0], stderr


def test_a_family_whose_config_has_no_context_parallel_size_refuses_it(monkeypatch):
    """Every family built today takes CP; one whose model config lacks the field is refused in one line."""
    from mm_adaptor.harness.runner import finalize_args, parse_args
    from mm_adaptor.train import families, vlm

    args = parse_args(["--model", "internvl-tiny", "--nproc-per-node", "2", "--context-parallel-size", "2"])
    finalize_args(args, 2)
    family = families.of(args)
    assert not [p for p in family.problems(args) if "context-parallel-size" in p]
    monkeypatch.setattr(vlm, "_has_field", lambda spec, name: name != "context_parallel_size")
    assert any("--context-parallel-size above 1 is not built for this family" in p for p in family.problems(args))


def test_hf_config_refusals(tmp_path):
    """--hf-config (a randomly initialised model from an HF config.json): unreadable, of another family than
    --model, or beside --load or --mm-model."""
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "qwen2_5_vl", "vision_config": {}}))
    _assert_one_line_refusal([*CHECK, "--hf-config", str(tmp_path / "missing.json")],
                             [f"--hf-config {tmp_path / 'missing.json'}: ", "No such file"])
    _assert_one_line_refusal([*CHECK, "--hf-config", "pyproject.toml"], ["--hf-config pyproject.toml: "])
    _assert_one_line_refusal([*CHECK, "--hf-config", str(config), "--model", "internvl-tiny"],
                             ["holds a qwen2_5_vl config: give --model qwen2_5_vl"])
    _assert_one_line_refusal([*CHECK, "--hf-config", str(config), "--load", str(tmp_path)],
                             ["--hf-config builds a new, randomly initialised model and --load", "drop one"])
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"model_type": "llama"}))
    _assert_one_line_refusal([*CHECK, "--hf-config", str(other)], ["model_type 'llama' is not a family"])
