"""A batch means to transformers' Qwen2.5-VL what it means to ours: its 3-D positions are HF's get_rope_index
(with the attention mask), and our shifted labels with loss_mask give HF's own loss (HF shifts inside); with videos
too (their grids and seconds per temporal patch in HF's rope, their pixels in HF's forward)."""

import dataclasses

import pytest
import torch

pytest.importorskip("transformers")

from hf_compat import with_token_types  # noqa: E402
from mm_adaptor.data import build  # noqa: E402
from mm_adaptor.data.vlm import IGNORE_INDEX  # noqa: E402
from mm_adaptor.models.qwen2_5_vl import tiny_hf_config_dict  # noqa: E402


@pytest.fixture(scope="module")
def with_videos(tmp_path_factory):
    """Shapes records, every second one a clip, and the processing that keeps the clips small."""
    pytest.importorskip("av")
    from mm_adaptor.data import images
    from mm_adaptor.data.shapes import make_shapes

    path = make_shapes(str(tmp_path_factory.mktemp("clips")), count=6, seed=5, videos=2)
    processing = images.QWEN2_5_VL
    small = processing.video.with_settings(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    return path, dataclasses.replace(processing, video=small)


@pytest.mark.parametrize("videos", [False, True], ids=["images", "images-and-videos"])
def test_positions_and_loss_as_transformers(shapes, byte_setup, videos, request):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    tokenizer, config = byte_setup
    data, processing = request.getfixturevalue("with_videos") if videos else (shapes, None)
    batches = build(data, tokenizer, config, 320, micro_batch_size=3, global_batch_size=3, seed=11,
                    processing=processing)
    batch = next(batches)
    seen = {"video": batch["video_grid_thw"] is not None, "image": batch["image_grid_thw"] is not None}
    assert seen == {"video": videos, "image": True}, seen
    video = {}
    if videos:
        clips = [c for i in batch["sample_index"].tolist() for c in batches.report.samples[i].clips]
        video = {"video_grid_thw": batch["video_grid_thw"],
                 "second_per_grid_ts": torch.tensor([processing.video.seconds_per_grid(c) for c in clips])}
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**tiny_hf_config_dict(config))).eval()
    mask = batch["attention_mask"]
    types = with_token_types(config, batch["input_ids"])
    positions, _ = model.model.get_rope_index(batch["input_ids"], image_grid_thw=batch["image_grid_thw"],
                                              attention_mask=mask.long(), **video, **types)
    assert torch.equal(positions[:, mask], batch["position_ids"][:, mask])
    # HF's labels: the input ids themselves (HF shifts them) on the reply and its <|im_end|>, found from the ids
    hf_labels = torch.full_like(batch["input_ids"], IGNORE_INDEX)
    im_start, im_end = tokenizer.special_ids["<|im_start|>"], tokenizer.special_ids["<|im_end|>"]
    header = len(tokenizer.encode("assistant\n"))
    for row, ids in enumerate(batch["input_ids"].tolist()):
        first = max(i for i, token in enumerate(ids) if token == im_start) + 1 + header
        last = ids.index(im_end, first)
        hf_labels[row, first:last + 1] = batch["input_ids"][row, first:last + 1]
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=mask.long(), pixel_values=batch["pixel_values"],
                    image_grid_thw=batch["image_grid_thw"], labels=hf_labels, **video, **types,
                    **({"pixel_values_videos": batch["pixel_values_videos"]} if videos else {}))
    per_token = torch.nn.functional.cross_entropy(out.logits.float().flatten(0, 1),
                                                  batch["labels"].clamp(min=0).flatten(), reduction="none")
    ours = (per_token * batch["loss_mask"].flatten()).sum() / batch["loss_mask"].sum()
    torch.testing.assert_close(ours, out.loss.float(), rtol=1e-6, atol=1e-6)
