"""Videos in records: frames sampled, decoded and preprocessed as transformers' video processors do (Qwen2.5-VL's
Qwen2VLVideoProcessor, Qwen3-VL's Qwen3VLVideoProcessor, fps sampling), on three clips written with PyAV here; the
records' placeholders, the index and the batches. transformers' processors need torchvision: the newest leg has it
(scripts/setup.sh), a leg without it skips the comparisons."""

import fractions
import json

import numpy as np
import pytest
import torch

pytest.importorskip("av")

from mm_adaptor.data import images, video  # noqa: E402

# (frames per second, frames, width, height): a film rate, NTSC's fraction, a slow one; lengths under and over a
# second per sampled frame; sides a multiple of the patch or not
CLIPS = {"film": (24, 37, 96, 64), "ntsc": (fractions.Fraction(30000, 1001), 61, 130, 76), "slow": (10, 9, 200, 122)}
FAMILIES = {"qwen2_5_vl": images.QWEN2_5_VL, "qwen3_vl": images.QWEN3_VL}


@pytest.fixture(scope="module")
def clips(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clips")
    rng = np.random.default_rng(0)
    made = {}
    for name, (fps, count, width, height) in CLIPS.items():
        ramp = np.add.outer(np.arange(height), np.arange(width))
        frames = [np.stack([(ramp * 3 + 7 * i) % 256, (ramp * 5 - 11 * i) % 256, rng.integers(0, 256, ramp.shape)],
                           axis=-1).astype(np.uint8) for i in range(count)]
        made[name] = video.write_clip(str(folder / f"{name}.mp4"), frames, fps)
    return made


def processing(family):
    return images.with_video(FAMILIES[family], family).video


def transformers_processor(family, ours):
    pytest.importorskip("torchvision")
    if family == "qwen3_vl":
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor as Processor
    else:
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import Qwen2VLVideoProcessor as Processor
    f = ours.frames
    settings = dict(size={"shortest_edge": f.min_pixels, "longest_edge": f.max_pixels}, patch_size=f.patch_size,
                    temporal_patch_size=f.temporal_patch_size, merge_size=f.merge_size, image_mean=list(f.image_mean),
                    image_std=list(f.image_std), do_sample_frames=True, fps=ours.fps, min_frames=ours.min_frames,
                    max_frames=ours.max_frames)
    if "cap_pixels_per_frame" in Processor.valid_kwargs.__annotations__:  # 5.x: the current behaviour, said
        settings["cap_pixels_per_frame"] = False
    return Processor(**settings)


def theirs(family, ours, path):
    """transformers' result for the clip: its pyav reader's frames and metadata, its processor's sampling."""
    from transformers.video_utils import load_video

    frames, metadata = load_video(path, backend="pyav",
                                  sample_indices_fn=lambda metadata, **_: np.arange(metadata.total_num_frames))
    metadata.frames_indices = None
    out = transformers_processor(family, ours)(videos=[frames], video_metadata=[metadata], return_tensors="pt",
                                               return_metadata=True)
    sampled = out["video_metadata"][0]
    return out["pixel_values_videos"], tuple(out["video_grid_thw"][0].tolist()), sampled


def differences(family, ours, path) -> list[str]:
    """What differs between our clip and transformers' (empty: equal, bit for bit)."""
    pixels, grid, sampled = theirs(family, ours, path)
    clip = video.probe(path)
    found = []
    if ours.indices(clip) != [int(i) for i in sampled.frames_indices]:
        found.append(f"frames {ours.indices(clip)} != {[int(i) for i in sampled.frames_indices]}")
    if ours.grid(clip) != grid:
        found.append(f"grid {ours.grid(clip)} != {grid}")
    values, _ = ours.pixels(path, clip)
    if values.shape != tuple(pixels.shape) or not torch.equal(torch.from_numpy(values), pixels):
        found.append("pixel values differ")
    expected_seconds = ours.frames.temporal_patch_size / sampled.sampled_fps  # Qwen2.5-VL's processor
    if family == "qwen2_5_vl" and ours.seconds_per_grid(clip) != pytest.approx(expected_seconds, rel=1e-12):
        found.append(f"second_per_grid_ts {ours.seconds_per_grid(clip)} != {expected_seconds}")
    return found


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("name", CLIPS)
def test_sampled_frames_pixels_and_grids_equal_transformers(clips, family, name):
    assert differences(family, processing(family), clips[name]) == []


def test_frames_sampled_off_by_one_are_caught(clips, monkeypatch):
    ours = processing("qwen2_5_vl")
    sample = video.VideoProcessing.indices
    monkeypatch.setattr(video.VideoProcessing, "indices",
                        lambda self, clip: [min(i + 1, clip.frames - 1) for i in sample(self, clip)])
    found = differences("qwen2_5_vl", ours, clips["film"])
    assert any(line.startswith("frames") for line in found) and "pixel values differ" in found, found


@pytest.mark.parametrize("family", FAMILIES)
def test_the_sampling_rule_equals_transformers_over_many_clips(family):
    """Frame counts 4 to 400 at common rates, and the settings a data.json gives (fps 1, at most 32 frames)."""
    from transformers.video_utils import VideoMetadata

    for fps, max_frames in ((2.0, 768), (1.0, 32)):
        ours = processing(family).with_settings(fps=fps, max_frames=max_frames)
        processor = transformers_processor(family, ours)
        for rate in (1.0, 10.0, 24.0, 30000 / 1001, 60.0):
            for total in range(4, 400, 3):
                metadata = VideoMetadata(total_num_frames=total, fps=rate, duration=total / rate)
                expected = [int(i) for i in processor.sample_frames(metadata)]
                assert ours.indices(video.Clip(total, rate, 64, 64)) == expected, (family, fps, rate, total)


def test_placeholders_follow_each_family_s_processor():
    """Qwen2.5-VL: one block of t*h*w/4 pads; Qwen3-VL: per temporal patch its timestamp, then h*w/4 pads."""
    special = {"<|vision_start|>": 1, "<|video_pad|>": 2, "<|vision_end|>": 3}
    clip = video.Clip(frames=37, fps=24.0, height=64, width=96)
    qwen2_5 = processing("qwen2_5_vl")
    t, h, w = qwen2_5.grid(clip)
    assert qwen2_5.pieces(clip, special) == [[1] + [2] * (t * h * w // 4) + [3]]
    qwen3 = processing("qwen3_vl")
    t, h, w = qwen3.grid(clip)
    pieces = qwen3.pieces(clip, special)
    stamps = images.frame_timestamps(qwen3.indices(clip), 24.0)
    assert pieces[0::2] == [f"<{s:.1f} seconds>" for s in stamps] and len(pieces) == 2 * t
    assert all(block == [1] + [2] * (h * w // 4) + [3] for block in pieces[1::2])


def test_records_with_videos_index_and_batch(tmp_path, clips):
    """An image and a video in one record, a video alone; the bad ones named: a missing clip, an undecodable one,
    one too short to sample, a tag without its video."""
    from mm_adaptor.data import build, load_tokenizer
    from mm_adaptor.models import qwen2_5_vl, rope_index_for

    (tmp_path / "garbage.mp4").write_bytes(b"not a video" * 100)
    short = video.write_clip(str(tmp_path / "short.mp4"), [np.zeros((32, 32, 3), np.uint8)], 10)
    from PIL import Image

    Image.new("RGB", (60, 40), (200, 10, 10)).save(tmp_path / "red.png")

    def record(content, **media):
        return {"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "ok"}], **media}

    records = [record("<image>and<video>", images=["red.png"], videos=[clips["film"]]),
               record("<video>", videos=[clips["slow"]]), record("<video>", videos=["gone.mp4"]),
               record("<video>", videos=["garbage.mp4"]), record("<video>", videos=[short]),
               record("<video><video>", videos=[clips["slow"]])]
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = qwen2_5_vl.tiny_config()
    processing_ = images.with_video(images.QWEN2_5_VL, "qwen2_5_vl")
    batches = build(str(data), load_tokenizer(None, config), config, 4096, 1, 2, skip_bad_samples=True,
                    processing=processing_, cache_dir=tmp_path / "index")
    bad = batches.report.bad
    assert len(batches.report.samples) == 2 and len(bad) == 4, bad
    assert "gone.mp4 does not exist" in bad[0] and "garbage.mp4 is unreadable" in bad[1], bad
    assert "too short to sample 2 frames" in bad[2] and "1 videos for 2 <video> tags" in bad[3], bad
    sample = batches.report.samples[0]
    assert sample.clips == [video.probe(clips["film"])]
    first = batches.load(0)[0]
    pad = config.video_token_id
    assert first.ids.count(pad) == int(np.prod(first.video_grids[0])) // 4
    assert torch.equal(first.video_pixels, torch.from_numpy(processing_.video.pixels(clips["film"],
                                                                                       sample.clips[0])[0]))
    batch = next(batches)
    assert batch["video_grid_thw"] is not None and batch["pixel_values_videos"].shape[0] == int(
        batch["video_grid_thw"].prod(-1).sum())
    expected, _ = rope_index_for(config, batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                                 video_grid_thw=batch["video_grid_thw"],
                                 second_per_grid_ts=[processing_.video.seconds_per_grid(c) for c in
                                                     batches.report.samples[int(batch["sample_index"][0])].clips],
                                 attention_mask=batch["attention_mask"].long())
    assert torch.equal(batch["position_ids"], expected)


def test_video_flags_reach_the_processing_or_are_refused(tmp_path, clips, capsys):
    """--video-* over the family's defaults (the trainer's and `data check`/`prepare`'s, so both key one index);
    a model without video preprocessing, or impossible settings, refused in one line."""
    import argparse

    from mm_adaptor.data import DataError
    from mm_adaptor.data.cli import main, with_preprocessing_flags
    from mm_adaptor.models import internvl

    flags = argparse.Namespace(video_max_pixels=28 * 28 * 256, video_fps=1.0)
    found = with_preprocessing_flags(images.QWEN2_5_VL, flags).video
    assert (found.frames.max_pixels, found.fps, found.frames.min_pixels) == (28 * 28 * 256, 1.0, 28 * 28 * 128)
    with pytest.raises(DataError, match="--video-max-pixels: video pixels from 100352 to 12544: want 0 < min <= max"):
        with_preprocessing_flags(images.QWEN2_5_VL, argparse.Namespace(video_max_pixels=28 * 28 * 16))
    tiling = images.ImageProcessing.for_model(internvl.tiny_config())
    with pytest.raises(DataError, match="--video-fps: this model's preprocessing takes no video"):
        with_preprocessing_flags(tiling, argparse.Namespace(video_fps=2.0))
    with pytest.raises(DataError, match="--video-max-frames: video fps 2.0 and at most 1 frames"):
        with_preprocessing_flags(images.QWEN2_5_VL, argparse.Namespace(video_max_frames=1))
    data = tmp_path / "clip.jsonl"
    record = {"messages": [{"role": "user", "content": "<video>"}, {"role": "assistant", "content": "ok"}],
              "videos": [clips["slow"]]}
    data.write_text(json.dumps(record) + "\n")
    small = ["--video-min-pixels", str(28 * 28 * 4), "--video-max-pixels", str(28 * 28 * 16)]
    assert main(["check", str(data), "--seq-length", "128", *small]) == 0
    assert main(["check", str(data), "--seq-length", "128"]) == 1  # the default sizes: over 128 tokens
    assert "longer than seq_length 128" in capsys.readouterr().out
