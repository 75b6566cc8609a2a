"""The packer (mm_adaptor.data.packing) and --packing's refusals, without ranks."""

import argparse

import pytest
import torch

from mm_adaptor.data.packing import (PackedBatches, SampleTooLong, first_fit_decreasing, pack, packed_seq_params,
                                     text_sample)
from mm_adaptor.train.data import MockBatches


def test_first_fit_decreasing_places_longest_first_into_the_first_bin_with_room():
    lengths = [3, 9, 4, 5, 2, 6, 1]
    bins = first_fit_decreasing(lengths, 10)
    assert bins == [[1, 6], [5, 2], [3, 0, 4]]
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in b) <= 10 for b in bins)


def test_a_sample_longer_than_a_pack_is_named():
    with pytest.raises(SampleTooLong, match="sample 1 has 11 tokens, more than the 10"):
        first_fit_decreasing([3, 11], 10)


def test_a_pack_restarts_positions_bounds_samples_and_masks_the_padding():
    samples = [text_sample(torch.arange(10, 15)), text_sample(torch.arange(20, 23))]  # 4 and 2 tokens
    batch = pack(samples, 8)
    assert batch["tokens"].tolist() == [[10, 11, 12, 13, 20, 21, 0, 0]]
    assert batch["labels"].tolist() == [[11, 12, 13, 14, 21, 22, 0, 0]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 0, 1]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 1, 0, 0]]
    assert batch["segments"] == [4, 2, 2] and batch["tokens_real"] == 6
    params = packed_seq_params(batch["segments"])
    assert params.qkv_format == "thd" and params.cu_seqlens_q.dtype == torch.int32
    assert params.cu_seqlens_q.tolist() == [0, 4, 6, 8]
    # the longest segment, not the pack: megatron's THD rope restarts positions only then
    assert params.max_seqlen_q == params.max_seqlen_kv == 4


def test_3d_positions_are_concatenated_per_sample():
    sample = text_sample(torch.arange(4))
    sample["position_ids"] = torch.arange(3).view(3, 1).expand(3, 3) + torch.arange(3)
    text_only = dict(sample, pixel_values=None, image_grid_thw=None)
    with_image = dict(sample, pixel_values=torch.ones(4, 6), image_grid_thw=torch.tensor([[1, 2, 2]]))
    batch = pack([with_image, text_only, with_image], 10)
    assert batch["position_ids"].shape == (3, 1, 10)
    assert batch["position_ids"][0, 0].tolist() == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0]
    # the images in the order of their samples in the pack
    assert batch["pixel_values"].shape == (8, 6) and batch["image_grid_thw"].tolist() == [[1, 2, 2], [1, 2, 2]]


def _args(**over):
    values = dict(seed=7, vocab_size=1024, seq_length=64, global_batch_size=8, data_parallel_size=2,
                  micro_batch_size=1, num_microbatches=4, mock_lengths="skewed")
    values.update(over)
    return argparse.Namespace(**values)


def _packed(args, dp_rank, start=0):
    mock = MockBatches(args, dp_rank, start)
    return PackedBatches(args, dp_rank, start, torch.device("cpu"), lambda g: text_sample(mock.sample(g)))


def _steps(batches, count):
    steps = []
    for _ in range(count):
        batches.start_step()
        steps.append([next(batches) for _ in range(batches.microbatches_this_step)])
    return steps


def test_a_step_packs_the_samples_the_padded_run_gives_the_rank():
    args = _args()
    padded = MockBatches(args, 1)
    padded_tokens = sum(int(next(padded)["loss_mask"].sum()) for _ in range(args.num_microbatches))
    packed = _packed(args, 1)
    packed.start_step()
    assert packed.step_indices(0) == [1, 3, 5, 7]
    assert packed.tokens_this_step == padded_tokens  # the loss covers the same tokens
    assert packed.microbatches_this_step < args.num_microbatches  # skewed lengths: fewer rows


def test_packing_is_deterministic_and_resumes_exactly():
    args = _args()
    first = _steps(_packed(args, 0), 3)
    again = _steps(_packed(args, 0), 3)
    resumed = _steps(_packed(args, 0, start=2), 1)
    for a, b in zip(first[2] + first[0], resumed[0] + again[0]):
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["position_ids"], b["position_ids"])
        assert a["packed_seq_params"].cu_seqlens_q.tolist() == b["packed_seq_params"].cu_seqlens_q.tolist()
    assert all(torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first[0], again[0]))


def test_full_length_mock_data_is_unchanged_by_the_length_draw():
    args = _args(mock_lengths="full")
    batch = next(MockBatches(args, 0))
    assert batch["loss_mask"].all() and batch["tokens"].shape == (1, 64)


def test_at_context_parallel_2_each_sample_is_padded_to_split_and_each_rank_takes_its_chunks_of_every_segment():
    from mm_adaptor.core.sequence_split import local_segments
    from mm_adaptor.train.data import ContextParallelSlices

    args = _args(context_parallel_size=2, data_parallel_size=1, num_microbatches=8)
    plain, split = _packed(_args(data_parallel_size=1, num_microbatches=8), 0), _packed(args, 0)
    plain.start_step()
    split.start_step()
    assert split.tokens_this_step == plain.tokens_this_step  # the loss covers the samples' own tokens only
    batches = [next(split) for _ in range(split.microbatches_this_step)]
    for batch in batches:
        params = batch["packed_seq_params"]
        padded, own = params.cu_seqlens_q_padded.tolist(), params.cu_seqlens_q.tolist()
        assert padded[-1] == 64 and all((b - a) % 4 == 0 for a, b in zip(padded, padded[1:]))
        assert all(b - a <= d - c for a, b, c, d in zip(own, own[1:], padded, padded[1:]))
    assert sum(int(b["loss_mask"].sum()) for b in batches) == split.tokens_this_step
    # rank r holds chunks r and 3 - r of every segment: together the ranks hold each segment once
    batch = batches[0]
    segments = [b - a for a, b in zip(batch["packed_seq_params"].cu_seqlens_q_padded.tolist(),
                                      batch["packed_seq_params"].cu_seqlens_q_padded.tolist()[1:])]
    parts = [next(ContextParallelSlices(iter([batch]), r, 2, ("tokens", "position_ids")))["position_ids"]
             for r in (0, 1)]
    assert all(p.shape == (1, 32) for p in parts)
    assert torch.equal(parts[0], local_segments(batch["position_ids"], 0, 2, segments, dim=1))
    first = segments[0] // 4
    assert parts[0][0, :2 * first].tolist() == list(range(first)) + list(range(3 * first, 4 * first))


REFUSED = [
    (["--packing", "--micro-batch-size", "2", "--attention-dropout", "0"], "give --micro-batch-size 1, not 2"),
    (["--packing", "--micro-batch-size", "1", "--attention-dropout", "0", "--pipeline-model-parallel-size", "2",
      "--num-layers-per-virtual-pipeline-stage", "1", "--num-layers", "4"], "drop --num-layers-per-virtual-pipeline"),
    (["--packing", "--micro-batch-size", "1", "--attention-dropout", "0.1"], "give --attention-dropout 0"),
    (["--mock-lengths", "skewed", "--model", "qwen2_5_vl-tiny", "--data-path", "pyproject.toml"],
     "drop it for --model qwen2_5_vl-tiny with --data-path"),
    (["--reset-attention-mask", "--packing", "--micro-batch-size", "1", "--attention-dropout", "0"],
     "--packing and --reset-attention-mask both split rows into samples"),
    (["--reset-position-ids", "--model", "qwen2_5_vl-tiny"],
     "fills the GPT's mock data rows with documents: drop --reset-position-ids"),
    (["--reset-attention-mask", "--reset-position-ids", "--mock-lengths", "skewed"],
     "--reset-attention-mask and --reset-position-ids give every row documents of skewed lengths already"),
    (["--reset-attention-mask", "--context-parallel-size", "2", "--seq-length", "64", "--attention-dropout", "0"],
     "--reset-attention-mask's document masks are not served"),
]


@pytest.mark.parametrize("argv, expected", REFUSED, ids=["micro-batch", "vpp", "dropout", "mock-lengths-data-set",
                                                         "documents-packing", "documents-vlm", "documents-lengths",
                                                         "documents-context-parallel"])
def test_refusals_are_one_line_and_exit_2_before_any_rank(argv, expected):
    pytest.importorskip("megatron.training")
    from trainer_runs import train

    run = train([*argv, "--nproc-per-node", "2", "--train-iters", "1", "--calculate-per-token-loss"])
    assert run.status == 2, run.err
    err = run.err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
