"""The one-line import's hooks on Megatron-LM's argument handling, exercised against a stand-in
`megatron.training.arguments` with the same two entry points (Megatron-LM itself is not a pip package)."""

import subprocess
import sys
import textwrap


def test_flags_reach_megatron_parser_and_features_apply_after_validation(tmp_path):
    training = tmp_path / "stub" / "megatron" / "training"
    training.mkdir(parents=True)
    (training / "__init__.py").write_text("")
    (training / "arguments.py").write_text(textwrap.dedent('''
        import argparse

        def add_megatron_arguments(parser):
            parser.add_argument("--tensor-model-parallel-size", type=int, default=1)
            parser.add_argument("--use-flash-attn", action="store_true")  # Megatron-LM owns this flag
            return parser

        def parse_args(argv):
            return add_megatron_arguments(argparse.ArgumentParser()).parse_args(argv)

        def validate_args(args, defaults={}):
            args.validated = True
            return args
    '''))
    script = textwrap.dedent(f'''
        import sys
        import mm_adaptor.megatron_adaptor          # the one line, imported BEFORE megatron.training
        sys.path.append({str(tmp_path / "stub")!r})   # megatron is a namespace package: the stub joins it
        from megatron.training.arguments import parse_args, validate_args
        import mm_adaptor
        from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as V
        original = V.__dict__["calculate_predicted_logits"]

        args = parse_args(["--tensor-model-parallel-size", "2"])
        assert args.optimize_vocab_parallel_ce is False
        assert mm_adaptor.applied() == {{}}, "nothing may be applied before Megatron validates its arguments"
        validate_args(args)
        assert mm_adaptor.applied() == {{}}, "a flag that is off applies nothing"

        mm_adaptor.disable(keep_device=True)
        args = parse_args(["--optimize-vocab-parallel-ce", "--use-flash-attn"])  # the second is Megatron's own flag
        validate_args(args)
        assert sorted(mm_adaptor.applied()) == ["flash-attn", "optimize-vocab-parallel-ce"], mm_adaptor.applied()
        assert V.__dict__["calculate_predicted_logits"] is not original
        mm_adaptor.disable()
        assert V.__dict__["calculate_predicted_logits"] is original
        print("HOOKS-OK")
    ''')
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "HOOKS-OK" in result.stdout
    assert "features applied: flash-attn (1 patches); optimize-vocab-parallel-ce (1 patches)" in result.stdout
