"""Blending (`--data-path W1 P1 W2 P2 ...`): the mix follows the weights within 1% over 10,000 samples (a blend that
ignores its weights is rejected by the same check), each data set's draws are its own epochs, a position's sample
depends on nothing else (any DP size, any resume), and the trainer reads Megatron's spelling."""

import json
import os
import shutil
from types import SimpleNamespace

import pytest

from mm_adaptor.data import DataError
from mm_adaptor.data.blend import BlendedSamples, parse_blend

WEIGHTS = [0.5, 0.3, 0.2]
SIZES = [700, 40, 1500]


def _mix(blend, count=10_000) -> list[float]:
    drawn = [0] * len(blend.components)
    for position in range(count):
        drawn[blend.assignment(position)[0]] += 1
    return [n / count for n in drawn]


def _assert_follows(blend, weights) -> None:
    total = sum(weights)
    for got, want in zip(_mix(blend), weights):
        assert abs(got - want / total) <= 0.01, (_mix(blend), weights)


class _WeightsIgnored(BlendedSamples):
    """The broken variant: every data set drawn alike, whatever its weight."""

    def __init__(self, components, weights=None):
        super().__init__(components, [1.0] * len(components))


def test_the_mix_follows_the_weights_within_one_percent():
    _assert_follows(BlendedSamples([range(n) for n in SIZES], WEIGHTS), WEIGHTS)
    _assert_follows(BlendedSamples([range(n) for n in SIZES]), SIZES)  # no weights: the sizes
    with pytest.raises(AssertionError):
        _assert_follows(_WeightsIgnored([range(n) for n in SIZES], WEIGHTS), WEIGHTS)


def test_each_data_set_is_read_epoch_by_epoch_and_a_position_depends_on_nothing_else():
    blend = BlendedSamples([range(n) for n in SIZES], WEIGHTS)
    seen = [[] for _ in SIZES]
    for position in range(4000):
        index = blend.stream_index(position, seed=7)
        d = int(sum(index >= offset for offset in blend.offsets[1:]))
        seen[d].append(index - int(blend.offsets[d]))
    small = seen[1]  # 40 samples, drawn 1200 times: 30 whole epochs, each a permutation
    assert all(sorted(small[e * 40:(e + 1) * 40]) == list(range(40)) for e in range(len(small) // 40))
    assert small[:40] != small[40:80]
    fresh = BlendedSamples([range(n) for n in SIZES], WEIGHTS)  # a resumed run's blend: straight to position 3999
    assert fresh.stream_index(3999, seed=7) == blend.stream_index(3999, seed=7)


def test_megatrons_data_path_spellings():
    assert parse_blend(["0.7", "a.json", "0.3", "b.json"]) == [(0.7, "a.json"), (0.3, "b.json")]
    assert parse_blend(["a.json", "b.json"]) == [(None, "a.json"), (None, "b.json")]
    assert parse_blend(["a.json"]) == [(None, "a.json")]
    with pytest.raises(DataError, match="weights and paths come in pairs"):
        parse_blend(["0.7", "a.json", "0.3"])
    with pytest.raises(DataError, match="must be 0 or more"):
        parse_blend(["-1", "a.json", "2", "b.json"])


def test_the_trainer_blends_its_data_path(tmp_path, shapes, byte_setup):
    """Two files at 3:1 through the trainer's validation (each file indexed, split by --split, blended); the
    batches draw from both in that mix; the data's fingerprint names both."""
    from mm_adaptor.data.vlm import BatchIterator
    from mm_adaptor.train import vlm_data

    tokenizer, config = byte_setup
    records = json.load(open(shapes))
    for name, part in (("a", records[:10]), ("b", records[10:])):
        folder = tmp_path / name
        shutil.copytree(os.path.join(os.path.dirname(shapes), "images"), folder / "images")
        (folder / "data.json").write_text(json.dumps(part))
    args = SimpleNamespace(data_path=["3", str(tmp_path / "a" / "data.json"), "1", str(tmp_path / "b" / "data.json")],
                           split="100,0,0", tokenizer_model=None, load=None, seq_length=320, skip_bad_samples=False,
                           data_cache=str(tmp_path / "index"), image_min_pixels=None, image_max_pixels=None,
                           train_data_path=None, valid_data_path=None, test_data_path=None)
    assert vlm_data.validate(args, config) == []
    train = args.validated_data["train"]
    assert isinstance(train.samples, BlendedSamples) and list(train.samples.weights) == [0.75, 0.25]
    assert not args.validated_data["valid"].samples
    batches = BatchIterator(train, tokenizer, config, 320, 4, 4, 0, 1, 0, None, None, seed=1)
    files = [train.samples[int(i)].record.file for _ in range(25) for i in next(batches)["sample_index"]]
    assert files.count(str(tmp_path / "a" / "data.json")) == 75 and len(files) == 100
    fingerprint = vlm_data.fingerprint(args.validated_data)
    assert fingerprint.startswith("train:0.75x") and "+0.25x" in fingerprint
    args.data_path = ["3", str(tmp_path / "a" / "data.json"), "1"]
    assert "weights and paths come in pairs" in vlm_data.validate(args, config)[0]
