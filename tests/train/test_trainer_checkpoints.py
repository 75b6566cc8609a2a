"""Checkpoints that change layout with their optimizer (Megatron's distributed checkpoints, the distributed
optimizer's state saved --dist-ckpt-optim-fully-reshardable): a run saved at one layout resumes at another with its
optimizer state and learning-rate schedule, and its losses continue the uninterrupted run's. 4 CPU ranks:
- the GPT saved at TP2 x PP2 resumes at TP1 x PP4 and at DP4; a resume that drops the optimizer state (Megatron's
  --no-load-optim) is rejected;
- each vision-language family saved at one layout resumes at another: Qwen2.5-VL TP2 x PP2 -> DP4, Qwen3-VL TP2 ->
  PP2 x DP2, InternVL DP4 -> TP2 x PP2, and Qwen3-VL-MoE EP2 x TP2 -> EP4 (-> EP1 is refused in one line:
  Megatron keeps the optimizer state of expert parallelism 1 and above in different shapes).

The limit: the largest relative difference of an iteration's loss from the uninterrupted run's. Resuming at the
same layout is bit for bit (test_trainer_runs.py); another layout reorders reductions, which moved the losses here
by at most 1e-6 (7e-8 for the GPT); dropping Adam's moments moves them by more than 1e-3."""

import json

import pytest

from trainer_runs import QUICK, relative_differences, scalars, train

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

LIMIT = 2e-5
# iterations and batch cost most of each run (a resume's weights, data position and optimizer state show from its
# first and second iterations on); 6 x 4 samples: Qwen2.5-VL's 24 records read once
ITERATIONS, SAVED = 6, 3
COMMON = ["--nproc-per-node", "4", *QUICK, "--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable",
          "--train-iters", str(ITERATIONS), "--global-batch-size", "4", "--micro-batch-size", "1",
          "--lr", "1e-3", "--lr-decay-style", "cosine"]


def _resumed(tmp_path, model, source, targets, extra=()):
    """{target name: relative differences from the uninterrupted run} for a run at `source` that saved after SAVED
    iterations (and went on: the uninterrupted run), resumed from that save (Megatron's --ckpt-step) at each
    target layout."""
    base = [*COMMON, *model]
    whole = train([*base, *source, "--tensorboard-dir", str(tmp_path / "whole"), "--save", str(tmp_path / "ckpt"),
                   "--save-interval", str(SAVED)])
    assert whole.status == 0, whole.err[-3000:]
    reference, found = scalars(tmp_path / "whole"), {}
    for name, layout in targets.items():
        run = train([*base, *layout, *extra, *_from_the_save(tmp_path), "--tensorboard-dir", str(tmp_path / name)])
        assert run.status == 0, run.err[-3000:]
        after = scalars(tmp_path / name)
        assert sorted(after) == list(range(SAVED + 1, ITERATIONS + 1)), after
        found[name] = relative_differences(reference, after)
    return found


def _from_the_save(tmp_path) -> list[str]:
    return ["--load", str(tmp_path / "ckpt"), "--ckpt-step", str(SAVED)]


def _assert_continues(found: dict) -> None:
    for name, differences in found.items():
        assert max(differences.values()) <= LIMIT, (name, differences)


TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


@pytest.fixture(scope="module")
def gpt(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpt")
    found = _resumed(tmp, [], TP2_PP2, {"tp1-pp4": ["--pipeline-model-parallel-size", "4"], "dp4": []})
    return tmp, found


def test_the_gpt_saved_at_tp2_pp2_resumes_at_tp1_pp4_and_dp4(gpt):
    _assert_continues(gpt[1])


def test_a_resume_without_the_optimizer_state_is_rejected(gpt):
    tmp, _ = gpt
    run = train([*COMMON, *_from_the_save(tmp), "--no-load-optim", "--tensorboard-dir", str(tmp / "no-optim")])
    assert run.status == 0, run.err[-3000:]
    differences = relative_differences(scalars(tmp / "whole"), scalars(tmp / "no-optim"))
    assert max(differences.values()) > 10 * LIMIT, differences
    with pytest.raises(AssertionError):
        _assert_continues({"dp4 --no-load-optim": differences})


RECORDS = "--data-path of generated records"  # the test makes them


@pytest.mark.parametrize("model, source, targets", [
    (["--model", "qwen2_5_vl-tiny", RECORDS], TP2_PP2, {"dp4": []}),
    (["--model", "qwen3_vl-tiny"], ["--tensor-model-parallel-size", "2"],
     {"pp2-dp2": ["--pipeline-model-parallel-size", "2"]}),
    (["--model", "internvl-tiny"], [], {"tp2-pp2": TP2_PP2}),
    (["--model", "qwen3_vl_moe-tiny"],
     ["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"],
     {"ep4": ["--expert-model-parallel-size", "4"]}),
], ids=["qwen2_5_vl", "qwen3_vl", "internvl", "qwen3_vl_moe"])
def test_each_family_resumes_at_another_layout(tmp_path, model, source, targets):
    """Qwen2.5-VL trains on records (TP2: one reader per tensor-parallel group; PP2: the second stage opens no
    image): the resumed run reads the records the uninterrupted run read next. --restart-data reads the data from
    its first sample again (samples repeated): the same comparison rejects it. Other data than the save was
    trained on is refused in one line before any rank starts."""
    if RECORDS in model:
        from mm_adaptor.data.shapes import make_shapes

        shapes = make_shapes(str(tmp_path), count=24, seed=0)
        model = [*model[:model.index(RECORDS)], "--data-path", shapes, "--split", "100,0,0", "--seq-length", "256"]
    _assert_continues(_resumed(tmp_path, model, source, targets))
    if "--data-path" in model:
        restarted = train([*COMMON, *model, *_from_the_save(tmp_path), "--restart-data",
                           "--tensorboard-dir", str(tmp_path / "restarted")])
        assert restarted.status == 0, restarted.err[-3000:]
        with pytest.raises(AssertionError):
            _assert_continues({"restarted": relative_differences(scalars(tmp_path / "whole"),
                                                                 scalars(tmp_path / "restarted"))})
        records = json.load(open(shapes))
        with open(shapes, "w") as f:
            json.dump(records[:-1], f)
        refused = train([*COMMON, *model, *_from_the_save(tmp_path)])
        assert refused.status == 2 and len(refused.err.strip().splitlines()) == 1, refused.err
        assert f"--load {tmp_path / 'ckpt'} was trained on other data or data settings" in refused.err
        assert "or --restart-data to read this data from its first sample" in refused.err
    if "qwen3_vl_moe-tiny" in model:  # Megatron cannot load EP2's optimizer state at EP1: one line, before the ranks
        run = train([*COMMON, *model, "--load", str(tmp_path / "ckpt")])
        assert run.status == 2 and len(run.err.strip().splitlines()) == 1, run.err
        assert "was saved at --expert-model-parallel-size 2, --expert-model-parallel-size 1 now" in run.err


def test_a_converted_hf_checkpoint_fine_tunes_and_converts_back(tmp_path):
    """An HF checkpoint converted by `mm-adaptor convert hf-to-mcore` trains in the trainer (started as --finetune,
    a line says so) with both towers frozen, on packs of its records (TP2: the first rank packs for both), and its
    save converts back to HF: every tensor is the HF original's but the projector's, which trained. Without --lr it
    is refused in one line (Megatron has no default)."""
    from safetensors.torch import load_file

    from mm_adaptor.cli import main
    from mm_adaptor.data.shapes import make_shapes
    from mm_adaptor.models.make_tiny_hf import make_tiny_hf

    make_tiny_hf(str(tmp_path / "hf"), "qwen2_5_vl", seed=3)
    shapes = make_shapes(str(tmp_path), count=8, seed=0)
    assert main(["convert", "hf-to-mcore", str(tmp_path / "hf"), str(tmp_path / "mcore")]) == 0
    command = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", "--load", str(tmp_path / "mcore"),
               "--data-path", shapes, "--split", "100,0,0", "--seq-length", "256", "--micro-batch-size", "1",
               "--global-batch-size", "2", "--train-iters", "2", *QUICK, "--freeze-vision", "--freeze-language",
               "--packing", "--calculate-per-token-loss"]  # packs made on TP rank 0, broadcast to its peer
    refused = train(command)
    assert refused.status == 2 and "--lr: missing, and Megatron-LM has no default" in refused.err, refused.err
    run = train([*command, "--lr", "1e-3", "--save", str(tmp_path / "saved"), "--save-interval", "2"])
    assert run.status == 0, run.err[-3000:]
    assert f"--load {tmp_path / 'mcore'} is a converted checkpoint (weights only): it starts the run as --finetune" \
        in run.out
    assert main(["convert", "mcore-to-hf", str(tmp_path / "saved"), str(tmp_path / "back")]) == 0
    original, back = (load_file(str(tmp_path / name / "model.safetensors")) for name in ("hf", "back"))
    assert sorted(original) == sorted(back)
    changed = {name for name in original if not original[name].equal(back[name])}
    assert changed and all(".merger." in name for name in changed), changed

