"""The one-line import's hooks on Megatron-LM's argument handling, exercised against a stand-in
`megatron.training.arguments` with the same two entry points (Megatron-LM itself is not a pip package)."""

import os
import subprocess
import sys
import textwrap

import warm_python
from stderr_lines import without_torch_notes

STUB_ARGUMENTS = '''
import argparse

import torch


def add_megatron_arguments(parser):
    parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
    parser.add_argument("--use-flash-attn", action="store_true")  # Megatron-LM owns this flag
    parser.add_argument("--num-experts", type=int, default=None)
    parser.add_argument("--moe-grouped-gemm", action="store_true")
    parser.add_argument("--disable-bias-linear", action="store_false", dest="add_bias_linear")
    return parser


def parse_args(argv):
    return add_megatron_arguments(argparse.ArgumentParser()).parse_args(argv)


def validate_args(args, defaults={}):
    if args.moe_grouped_gemm:  # as Megatron-LM does, for the grouped_gemm package's CUTLASS kernels
        assert torch.cuda.get_device_capability()[0] >= 8, "Unsupported compute capability for GroupedGEMM kernels."
    args.validated = True
    _print_args("arguments", args)
    return args


def _print_args(title, args):
    print(f"{title}: moe_grouped_gemm={args.moe_grouped_gemm}")
'''

PRELUDE = '''
import gc
import sys
COLLECTIONS = []                 # the collector's passes (core.imports: none while torch and megatron-core import)
gc.callbacks.append(lambda phase, info: phase == "start" and COLLECTIONS.append(info["generation"]))
import mm_adaptor.megatron_adaptor          # the one line, imported BEFORE megatron.training
COLLECTIONS_WHILE_IMPORTING = list(COLLECTIONS)
sys.path.insert(0, {stub!r})   # megatron is a namespace package: the stub joins it, ahead of the megatron.training
                                  # that megatron-core wheels ship from 0.17 on
from megatron.training.arguments import parse_args, validate_args
import mm_adaptor
'''


def run_against_stub(tmp_path, body: str, *, arguments: str = STUB_ARGUMENTS, env: dict | None = None,
                     check: bool = True, fresh: bool = False) -> subprocess.CompletedProcess:
    """fresh: in a new interpreter, where the one-line import is what imports megatron-core (else warm_python's
    child of an interpreter that imported it)."""
    training = tmp_path / "stub" / "megatron" / "training"
    training.mkdir(parents=True, exist_ok=True)
    (training / "__init__.py").write_text("")
    (training / "arguments.py").write_text(arguments)
    script = PRELUDE.format(stub=str(tmp_path / "stub")) + textwrap.dedent(body)
    environ = {k: v for k, v in os.environ.items() if k not in ("RANK", "MM_ADAPTOR_DEVICE")}
    if fresh:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                                env={**environ, **(env or {})})
    else:
        result = warm_python.run(["-c", script], timeout=300, env={**environ, **(env or {})})
    if check:
        assert result.returncode == 0, result.stderr[-3000:]
    return result


def test_flags_reach_megatron_parser_and_features_apply_after_validation(tmp_path):
    result = run_against_stub(tmp_path, fresh=True, body='''
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
        original = V.__dict__["calculate_predicted_logits"]

        # (hundreds of passes, seven of them full, with the collector on; a few young ones before it goes off)
        assert "megatron.core" in sys.modules and 2 not in COLLECTIONS_WHILE_IMPORTING, COLLECTIONS_WHILE_IMPORTING
        assert len(COLLECTIONS_WHILE_IMPORTING) < 5, COLLECTIONS_WHILE_IMPORTING
        kept = [[] for _ in range(20_000)]  # ... and the collector runs again after the import
        assert len(COLLECTIONS) > len(COLLECTIONS_WHILE_IMPORTING), "the one-line import left the collector off"

        args = parse_args(["--tensor-model-parallel-size", "2"])
        assert args.optimize_vocab_parallel_ce is False
        assert mm_adaptor.applied_features() == {}, "nothing may be applied before Megatron validates its arguments"
        validate_args(args)
        assert mm_adaptor.applied_features() == {}, "a flag that is off applies nothing"

        mm_adaptor.disable(keep_device=True)
        args = parse_args(["--optimize-vocab-parallel-ce", "--use-flash-attn"])  # the second is Megatron's own flag
        validate_args(args)
        assert sorted(mm_adaptor.applied_features()) == ["flash-attn", "optimize-vocab-parallel-ce"]
        assert V.__dict__["calculate_predicted_logits"] is not original
        mm_adaptor.disable()
        assert V.__dict__["calculate_predicted_logits"] is original
        print("HOOKS-OK")
    ''')
    assert "HOOKS-OK" in result.stdout
    assert "features applied: flash-attn (1 patches); optimize-vocab-parallel-ce (1 patches)" in result.stdout


def test_fused_gmm_lifts_the_grouped_gemm_device_check_only_while_validating(tmp_path):
    result = run_against_stub(tmp_path, '''
        from megatron.core.transformer.moe.experts import SequentialMLP
        SEQUENTIAL_FORWARD = SequentialMLP.__dict__["forward"]
        flags = ["--num-experts", "4", "--moe-grouped-gemm", "--disable-bias-linear"]
        try:
            validate_args(parse_args(flags))
        except AssertionError as exc:
            assert "GroupedGEMM" in str(exc), exc
        else:
            raise SystemExit("without --use-fused-gmm, Megatron-LM's own check must still fire")
        mm_adaptor.disable(keep_device=True)

        args = parse_args([*flags, "--use-fused-gmm"])
        validate_args(args)
        assert args.validated and args.moe_grouped_gemm is True, "the user's value is back after validation"
        assert list(mm_adaptor.applied_features()) == ["fused-gmm"], mm_adaptor.applied()
        import importlib.util
        if importlib.util.find_spec("megatron.core.transformer.moe.grouped_gemm_util"):  # gone in 0.17+
            from megatron.core.transformer.moe import grouped_gemm_util as gg
            assert gg.grouped_gemm_is_available() and callable(gg.ops.gmm)
            mm_adaptor.disable()
            assert gg.ops is None and not gg.grouped_gemm_is_available()
        else:
            from megatron.core.transformer.moe.experts import SequentialMLP
            assert SequentialMLP.__dict__["forward"] is not SEQUENTIAL_FORWARD, "fused-gmm wraps SequentialMLP"
            mm_adaptor.disable()
            assert SequentialMLP.__dict__["forward"] is SEQUENTIAL_FORWARD
        print("GMM-OK")
    ''')
    assert "GMM-OK" in result.stdout
    assert "arguments: moe_grouped_gemm=True" in result.stdout, "Megatron-LM's printout shows the user's value"


STUB_WITH_DISTRIBUTED_BACKEND = STUB_ARGUMENTS.replace(
    '    parser.add_argument("--num-experts"',
    '    parser.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"])\n'
    '    parser.add_argument("--num-experts"')


def test_nccl_without_a_gpu_stops_right_after_validation_with_one_line(tmp_path):
    def body(flags=()):
        return f'''
            args = parse_args({list(flags)!r})
            validate_args(args)
            print("TRAINING-WOULD-START", args.distributed_backend)
        '''

    stopped = run_against_stub(tmp_path, body(), arguments=STUB_WITH_DISTRIBUTED_BACKEND, check=False)
    assert stopped.returncode == 1 and "TRAINING-WOULD-START" not in stopped.stdout
    stderr = without_torch_notes(stopped.stderr)
    assert stderr.count("\n") == 1 and stderr.startswith(
        "mm_adaptor: error: --distributed-backend nccl (Megatron-LM's default) asks for NVIDIA GPUs"), stderr
    assert "--distributed-backend gloo or set MM_ADAPTOR_DEVICE=cpu" in stderr
    other_rank = run_against_stub(tmp_path, body(), arguments=STUB_WITH_DISTRIBUTED_BACKEND, env={"RANK": "1"},
                                  check=False)
    assert other_rank.returncode == 1 and without_torch_notes(other_rank.stderr) == ""

    gloo = run_against_stub(tmp_path, body(["--distributed-backend", "gloo"]), arguments=STUB_WITH_DISTRIBUTED_BACKEND)
    assert "TRAINING-WOULD-START gloo" in gloo.stdout
    forced = run_against_stub(tmp_path, body(), arguments=STUB_WITH_DISTRIBUTED_BACKEND,
                              env={"MM_ADAPTOR_DEVICE": "cpu"})
    assert "TRAINING-WOULD-START nccl" in forced.stdout  # the CPU on purpose: NCCL groups become gloo, as before
