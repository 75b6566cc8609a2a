"""The trainer on Megatron-LM's loop, tiny GPT on 2 CPU ranks (TP2):
- evaluation reads the validation split: its loss equals the training loss of the same weights on the stream the
  validation split draws from; a trainer that evaluates on the training split is rejected;
- SIGTERM to the command in the middle of a run: the ranks finish their iteration, save, and it exits 0; the
  resumed run continues the uninterrupted run's losses exactly; a stop that does not save is rejected;
- Megatron's exit conditions (--exit-interval) save and stop;
- the iteration line: Megatron's, plus --log-tps' fields and --log-throughput's MFU against the named peak, and
  TensorBoard gets Megatron's scalars."""

import json
import os
import re
import signal
import threading
import time
from pathlib import Path

import pytest

from mm_adaptor.harness.compare import extra_feature_module
from trainer_runs import QUICK, scalars, train

pytestmark = pytest.mark.distributed
pytest.importorskip("megatron.training")
pytest.importorskip("tensorboard")

TP2 = ["--nproc-per-node", "2", "--tensor-model-parallel-size", "2", *QUICK]
BROKEN = "broken_trainer_features"
MARKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def evaluated(tmp_path_factory):
    """(the validation loss after step 1, the same with evaluation on the training split (broken), the training loss
    of those weights on the validation split's stream): learning rate 0, so the step leaves the weights as they
    were (the broken run's too: one run from the first's save, --finetune, with the seed the validation split draws
    with, serves both)."""
    from mm_adaptor.train.providers import SPLIT_SEED_STRIDE

    tmp_path = tmp_path_factory.mktemp("evaluated")
    run = [*TP2, "--lr", "0", "--train-iters", "1", "--seed", "1234", "--eval-iters", "1"]  # evaluated after training
    first = train([*run, "--save", str(tmp_path / "ckpt"), "--save-interval", "1"])
    assert first.status == 0, first.err[-3000:]
    with extra_feature_module(BROKEN):
        broken = train([*run, "--test-eval-on-train-split"])
    assert broken.status == 0, broken.err[-3000:]
    again = train([*TP2, "--lr", "0", "--train-iters", "1", "--seed", str(1234 + SPLIT_SEED_STRIDE),
                   "--load", str(tmp_path / "ckpt"), "--finetune", "--tensorboard-dir", str(tmp_path / "tb-train")])
    assert again.status == 0, again.err[-3000:]
    return _validation(first), _validation(broken), scalars(tmp_path / "tb-train")[1]


def _validation(run) -> float:
    # Megatron prints the validation set's loss apart from the test set's (its TensorBoard tag is the same for both)
    return float(re.search(r"validation loss at iteration 1 on validation set \| lm loss value: (\S+) \|",
                           run.out).group(1))


def _assert_same(validation: float, training: float) -> None:
    assert abs(validation - training) <= 1e-6 * abs(training), (validation, training)  # 7 printed digits


def test_evaluation_reads_the_validation_split(evaluated):
    validation, _, training = evaluated
    _assert_same(validation, training)


def test_evaluation_on_the_training_split_is_rejected(evaluated):
    _, broken, training = evaluated
    with pytest.raises(AssertionError):
        _assert_same(broken, training)


ITERATIONS = 12


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Also serves the MFU without a peak (--log-throughput leaves the losses alone)."""
    tb = tmp_path_factory.mktemp("tb-whole")
    run = train([*TP2, "--train-iters", str(ITERATIONS), "--log-throughput", "--tensorboard-dir", str(tb)])
    assert run.status == 0, run.err[-3000:]
    return run, scalars(tb)


def _stopped_by_sigterm(tmp_path, *extra):
    """The command, sent SIGTERM once 4 iterations were logged (a thread of this process, which is the command)."""
    tb, save = tmp_path / "tb-stopped", tmp_path / "ckpt"

    def stop():
        while len(scalars(tb)) < 4:
            time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=stop, daemon=True).start()
    run = train([*TP2, "--train-iters", str(ITERATIONS), "--save", str(save), "--save-interval", "1000",
                 "--tensorboard-dir", str(tb), *extra])
    return run, scalars(tb), save


def _assert_stopped_and_saved(run, logged: dict, save: Path) -> int:
    assert run.status == 0, run.err[-3000:]
    reached = max(logged)
    assert 4 <= reached < ITERATIONS, logged
    assert "stopped on SIGTERM: the ranks finished their iteration; the checkpoint is in" in run.err, run.err
    assert (save / MARKER).is_file() and int((save / MARKER).read_text()) == reached, list(save.iterdir())
    return reached


def test_sigterm_saves_exits_0_and_the_resumed_run_continues_the_losses(tmp_path, uninterrupted):
    run, logged, save = _stopped_by_sigterm(tmp_path)
    reached = _assert_stopped_and_saved(run, logged, save)
    resumed = train([*TP2, "--train-iters", str(ITERATIONS), "--load", str(save),
                     "--tensorboard-dir", str(tmp_path / "tb-resumed")])
    assert resumed.status == 0, resumed.err[-3000:]
    after = scalars(tmp_path / "tb-resumed")
    assert sorted(after) == list(range(reached + 1, ITERATIONS + 1))
    assert {**logged, **after} == uninterrupted[1]  # every loss, bit for bit


def test_a_stop_that_does_not_save_is_rejected(tmp_path):
    with extra_feature_module(BROKEN):
        run, logged, save = _stopped_by_sigterm(tmp_path, "--test-stop-without-saving")
    with pytest.raises(AssertionError):
        _assert_stopped_and_saved(run, logged, save)


def test_exit_interval_saves_and_stops_and_the_iteration_line_is_megatron_s(tmp_path, uninterrupted):
    """One run: --exit-interval 3 saves and stops it; its 3 iteration lines carry the trainer's fields."""
    run = train([*TP2, "--train-iters", str(ITERATIONS), "--exit-interval", "3", "--save", str(tmp_path / "ckpt"),
                 "--save-interval", "1000", "--log-tps", "--log-throughput", "--mfu-peak-tflops", "0.5",
                 "--tensorboard-dir", str(tmp_path / "tb")])
    assert run.status == 0, run.err[-3000:]
    assert "exiting program at iteration 3" in run.out and int((tmp_path / "ckpt" / MARKER).read_text()) == 3
    lines = run.iteration_lines()
    assert len(lines) == 3, run.out[-3000:]
    for field in ("consumed samples", "elapsed time per iteration (ms)", "throughput per GPU (TFLOP/s/GPU)",
                  "learning rate", "lm loss", "grad norm", "tokens per sample", "tokens per second (padded)",
                  "samples per second", "peak memory (GiB, most loaded rank)"):
        assert len(run.field(field)) == 3, (field, lines[0])
    peaks = [float(value) for value in run.field("peak memory (GiB, most loaded rank)")]
    assert 0.1 < peaks[0] <= peaks[1] <= peaks[2] < 16, peaks  # a peak never falls; a CPU rank's RSS holds torch
    throughput = [float(value) for value in run.field("throughput per GPU (TFLOP/s/GPU)")]
    mfu = [value for value in run.field("MFU")]
    for tflops, text in zip(throughput, mfu):
        percent = float(text.split("%")[0])
        assert text.endswith("of 0.5 TFLOP/s (--mfu-peak-tflops, fp32 dense peak)"), text
        assert abs(percent - 100 * tflops / 0.5) <= 0.1 + 0.05 * percent, (tflops, text)
    assert [float(v) for v in run.field("tokens per sample")] == [64.0] * 3  # the GPT's mock rows: --seq-length
    assert sorted(scalars(tmp_path / "tb")) == [1, 2, 3]
    without_peak = uninterrupted[0].field("MFU")
    assert without_peak == ["n/a (no peak for the CPU; give --mfu-peak-tflops)"] * ITERATIONS, without_peak


def test_no_evaluation_where_the_split_has_no_samples_and_a_damaged_sample_is_skipped(tmp_path):
    """Besides: the data's index goes where --data-cache says; an image that decodes no more (its checksums still
    pass validation) is skipped by the loader worker, said and counted on the iteration line; two of the records are
    videos (decoded in the loader worker)."""
    pytest.importorskip("PIL")
    from mm_adaptor.data.shapes import make_shapes
    from tests.data.damaged import undecodable_png

    shapes = make_shapes(str(tmp_path), count=8, seed=0, videos=4)
    undecodable_png(Path(shapes).parent / json.load(open(shapes))[5]["images"][0])
    run = train(["--nproc-per-node", "1", "--model", "qwen2_5_vl-tiny", "--data-path", shapes, "--split", "100,0,0",
                 "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
                 *QUICK[:-2], "--eval-iters", "2", "--data-cache", str(tmp_path / "index"), "--num-workers", "1",
                 "--skip-bad-samples", "1", "--video-min-pixels", "3136", "--video-max-pixels", "12544"])
    assert run.status == 0, run.err[-3000:]
    assert "the validation split has no samples (--split 100,0,0): it is not evaluated" in run.out
    assert "validation loss" not in run.out
    built = list((tmp_path / "index").glob("*/index.json"))
    assert len(built) == 1 and json.loads(built[0].read_text())["samples"] == 8
    assert "broken data stream when reading image file (1 of at most 1)\n" in run.out
    waits = [float(v) for v in run.field("data wait (ms, slowest rank)")]
    assert len(waits) == 4 and all(w >= 0 for w in waits) and max(waits) > 0, waits
    skipped = run.field("samples skipped (failed to load)")
    assert skipped[-1] == "1" and len(skipped) >= 1, skipped  # the epoch of 8 read once: one skip
