"""Local-rank launcher (failures and hangs surface clearly) and layout validation."""

import time

import pytest

from mm_adaptor.ranks.launcher import LaunchError, launch
from mm_adaptor.harness.runner import LayoutError, build_parser, finalize_args


def _fail_on_rank_one():
    import os

    if os.environ["RANK"] == "1":
        raise ValueError("boom on purpose")


def _hang():
    time.sleep(60)


def _ok():
    pass


def test_child_traceback_is_surfaced():
    with pytest.raises(LaunchError, match="rank 1 failed: ValueError: boom on purpose") as info:
        launch(_fail_on_rank_one, nproc=2, timeout=60)
    assert "_fail_on_rank_one" in str(info.value)


def test_hang_is_reported_with_ranks():
    start = time.monotonic()
    with pytest.raises(LaunchError, match=r"timed out after 3s: rank\(s\) 0, 1 still running"):
        launch(_hang, nproc=2, timeout=3)
    assert time.monotonic() - start < 30


def test_success():
    launch(_ok, nproc=2, timeout=60)


def _port_taken_on_first_try(marker):
    import os
    import pathlib

    if os.environ["RANK"] == "0" and not pathlib.Path(marker).exists():
        pathlib.Path(marker).write_text(os.environ["MASTER_PORT"])
        raise RuntimeError("The server socket has failed to listen: EADDRINUSE, address already in use")


def _always_port_taken():
    raise RuntimeError("address already in use")


def test_a_port_taken_by_another_process_is_retried_on_a_new_port(tmp_path):
    marker = tmp_path / "first-port"
    launch(_port_taken_on_first_try, (str(marker),), nproc=2, timeout=60)
    assert marker.exists()
    with pytest.raises(LaunchError, match="address already in use"):
        launch(_always_port_taken, nproc=1, timeout=60)


def _args(*argv):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("argv, world, message", [
    (["--tensor-model-parallel-size", "3"], 2, "not divisible by --tensor-model-parallel-size 3"),
    (["--sequence-parallel"], 2, "--sequence-parallel needs --tensor-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--num-layers", "3"], 2, "--num-layers 3 is not divisible"),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
      "--global-batch-size", "6"], 2,
     "multiple of --pipeline-model-parallel-size"),
    (["--expert-model-parallel-size", "2"], 2, "needs --num-experts"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2"], 2, "needs --disable-bias-linear"),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
     "MoE with --tensor-model-parallel-size > 1 needs --sequence-parallel"),
    (["--bf16", "--fp16"], 2, "exclusive"),
    (["--global-batch-size", "3"], 2, "not divisible by --micro-batch-size"),
    (["--overlap-param-gather"], 2, "needs --use-distributed-optimizer"),
])
def test_bad_layouts_are_named(argv, world, message):
    with pytest.raises(LayoutError, match=message.replace("(", r"\(").replace(")", r"\)")):
        finalize_args(_args(*argv), world)


def test_interleaved_schedule_sends_unbatched_as_megatron_lm_does():
    """Batched, the activation and the gradient a PP2 stage sends its one neighbour in the same step are matched by
    posting order, and megatron posts them in opposite orders on the two sides: gloo swapped them and the
    interleaved layout trained on swapped tensors. Megatron-LM forbids that combination; the driver now uses
    Megatron-LM's default for the interleaved schedule (overlapped, unbatched transfers)."""
    from mm_adaptor.harness.runner.model import transformer_config

    interleaved = finalize_args(_args("--pipeline-model-parallel-size", "2", "--num-layers", "4",
                                      "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "8"), 2)
    config = transformer_config(interleaved)
    assert config.overlap_p2p_comm and not config.batch_p2p_comm
    plain = transformer_config(finalize_args(_args("--pipeline-model-parallel-size", "2", "--num-layers", "4"), 2))
    assert plain.batch_p2p_comm and not plain.overlap_p2p_comm


def test_derived_layout():
    args = finalize_args(_args("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
                               "--global-batch-size", "8"), 2)
    assert args.virtual_pipeline_model_parallel_size == 2
    assert args.data_parallel_size == 1 and args.num_microbatches == 4


def test_a_layout_given_by_flags_is_named_by_its_sizes():
    from mm_adaptor.harness.compare import _described_layout, checked_args

    args = checked_args(["--num-experts", "4", "--expert-model-parallel-size", "2", "--nproc-per-node", "2"],
                        check_devices=False)
    assert _described_layout(args) == "TP1+PP1+DP2+EP2(4 experts) (from the flags)"
