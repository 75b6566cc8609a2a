"""The trainer's command line (mm-adaptor train, python -m mm_adaptor.train) is Megatron-LM's parser with the
adaptor's flags and the trainer's: --help prints (megatron-core 0.19.2's own help raises), ours apart from
Megatron's; a bad command is one line and exit status 2 before any rank starts, Megatron's own validation
included; the launch flags; a converted checkpoint starts a run as --finetune."""

import argparse
import json

import pytest

from trainer_runs import train

pytest.importorskip("megatron.training")


def test_help_prints_megatron_s_arguments_and_the_trainer_s_apart():
    from megatron.training.arguments import add_megatron_arguments

    run = train(["--help"])
    assert run.status == 0, run.err
    assert run.out.startswith("usage: mm-adaptor train"), run.out[:200]
    sections = [line for line in run.out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    ours = [s for s in sections if s.startswith(("mm_adaptor", "MindSpeed-MM"))]
    assert ours == sections[-len(ours):] and len(ours) >= 3, sections  # after every group of Megatron's
    assert "--log-throughput" in run.out and "--model MODEL" in run.out.replace("{", "MODEL {")
    megatron_s_own = add_megatron_arguments(argparse.ArgumentParser())
    try:
        megatron_s_own.format_help()
    except ValueError as exc:  # 0.19.2: an unescaped '%' in a help string
        assert "unsupported format character" in str(exc)


@pytest.mark.parametrize("argv, expected", [
    (["--transformer-impl", "transformer_engine"], "--transformer-impl transformer_engine: the trainer builds"),
    (["--dataloader-type", "single"], "--dataloader-type single: the trainer's data sets bring their own loaders"),
    (["--hidden-size", "63"], "Megatron-LM refuses the arguments: assert args.hidden_size % args.num_attention_heads"),
    (["--tensor-model-parallel-size", "2", "--nproc-per-node", "3"],
     "Megatron-LM refuses the arguments: world size (3) is not divisible"),
    (["--tensor-model-paralel-size", "2"], "did you mean --tensor-model-parallel-size?"),
    (["--train-iters", "ten"], "--train-iters: invalid int value: 'ten'"),
    (["--nnodes", "2"], "--nnodes 2 needs --master-addr and --master-port"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "127.0.0.1", "--master-port", "1234"],
     "--node-rank 2: must be 0 to --nnodes - 1 (1)"),
    (["--moe-aux-loss-coeff", "0.1", "--moe-grouped-gemm"],
     "--moe-aux-loss-coeff, --moe-grouped-gemm: the model has no experts"),
    (["--packing", "--micro-batch-size", "1", "--attention-dropout", "0"], "add --calculate-per-token-loss"),
    (["--model", "qwen2_5_vl"], "--model qwen2_5_vl needs --load MCORE_DIR"),
    (["--model", "qwen2_5_vl-tiny", "--make-vocab-size-divisible-by", "128"],
     "--make-vocab-size-divisible-by 128 pads the vocabulary, but qwen2_5_vl's output layer"),
    (["--model", "qwen2_5_vl-tiny", "--data-path", "0.7", "a.json", "0.3"],
     "--data-path 0.7 a.json 0.3: weights and paths come in pairs (W1 P1 W2 P2 ...)"),
    (["--use-fused-rmsnorm"], "--use-fused-rmsnorm needs --normalization RMSNorm"),
], ids=lambda value: " ".join(value) if isinstance(value, list) else None)
def test_a_bad_command_is_one_line_before_any_rank(argv, expected):
    run = train(argv)
    assert run.status == 2, run.err
    lines = run.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mm-adaptor train: error: "), lines
    assert expected in lines[0], lines[0]
    assert "iteration" not in run.out


def test_save_onto_a_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_text("")
    run = train(["--save", str(target), "--save-interval", "5"])
    assert run.status == 2 and f"--save {target} is a file, not a directory" in run.err, run.err


def test_under_torchrun_the_ranks_and_nodes_are_torchrun_s(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    run = train(["--nproc-per-node", "2", "--nnodes", "2"])
    assert run.status == 2, run.err
    assert "--nproc-per-node, --nnodes: under torchrun the ranks and nodes are torchrun's" in run.err


def test_a_converted_checkpoint_starts_the_run_as_finetune(tmp_path):
    from mm_adaptor.convert.mcore_io import INFO
    from mm_adaptor.train import arguments

    (tmp_path / INFO).write_text(json.dumps({"family": "qwen2_5_vl"}))
    args = argparse.Namespace(load=str(tmp_path), finetune=False)
    notes = arguments._converted_load(args)
    assert args.finetune and len(notes) == 1 and "converted checkpoint (weights only)" in notes[0]
    resumed = argparse.Namespace(load=str(tmp_path.parent), finetune=False)  # a training save: Megatron's resume
    assert not arguments._converted_load(resumed) and not resumed.finetune


def test_an_unset_eval_interval_means_no_evaluation_during_training():
    """Megatron's documented meaning; megatron-core 0.19's loop divides by the value, so the trainer sets one
    beyond any iteration."""
    from mm_adaptor.train import check

    args, _ = check(["--train-iters", "5"], under_torchrun=False)
    assert args.eval_interval > 10**12
    args, _ = check(["--train-iters", "5", "--eval-interval", "2"], under_torchrun=False)
    assert args.eval_interval == 2
