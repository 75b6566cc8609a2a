"""Qwen's chat template as token ids: a record's messages with its images' pad tokens, and which tokens are loss
targets (see mm_adaptor.data.vlm for the layout). No torch: the data index's workers encode every record."""

from __future__ import annotations

import re

from mm_adaptor.data import images as image_ops
from mm_adaptor.data.records import IMAGE_TAG, VIDEO_TAG, Record

_TAGS = re.compile(f"({re.escape(IMAGE_TAG)}|{re.escape(VIDEO_TAG)})")

DEFAULT_SYSTEM = "You are a helpful assistant."


def default_system(config) -> str | None:
    """The system prompt the config's family's chat template writes when the messages have none: its package's
    DEFAULT_SYSTEM_PROMPT (None: no system turn), Qwen2.5-VL's otherwise."""
    if config is None:
        return DEFAULT_SYSTEM
    from mm_adaptor.models import family_package

    return getattr(family_package(config), "DEFAULT_SYSTEM_PROMPT", DEFAULT_SYSTEM)


def encode(record: Record, grids, tokenizer, processing=None, clips=()) -> tuple[list[int], list[bool]]:
    """(token ids, is-target flag per token) of one record, images expanded to their pad tokens (processing's
    merge size; None: Qwen2.5-VL's), videos (`clips`, data.video.Clip each) to the family's placeholder
    (processing.video.pieces)."""
    processing = processing or image_ops.QWEN2_5_VL
    special = tokenizer.special_ids
    im_start, im_end = [special["<|im_start|>"]], [special["<|im_end|>"]]
    pieces = []  # (str or list of ids, target)
    messages = record.messages
    system = messages[0]["content"] if messages[0]["role"] == "system" else getattr(tokenizer, "default_system",
                                                                                      DEFAULT_SYSTEM)
    if system is not None:  # the family's template writes no system turn without a system message (Qwen3-VL)
        pieces += [(im_start, False), ("system\n" + system, False), (im_end, False), ("\n", False)]
    grid_iter, clip_iter = iter(grids), iter(clips)
    for message in messages[1:] if messages[0]["role"] == "system" else messages:
        target = message["role"] == "assistant"
        pieces += [(im_start, False), (message["role"] + "\n", False)]
        for text in _TAGS.split(message["content"]):
            if text == IMAGE_TAG:
                pads = processing.image_tokens(next(grid_iter))
                vision = [special["<|vision_start|>"]] + [special["<|image_pad|>"]] * pads + [special["<|vision_end|>"]]
                pieces.append((vision, target))
            elif text == VIDEO_TAG:
                pieces += [(piece, target) for piece in processing.video.pieces(next(clip_iter), special)]
            else:
                pieces.append((text, target))
        pieces += [(im_end, target), ("\n", False)]
    ids, flags = [], []
    run, run_target = "", False
    for piece, target in pieces + [([], False)]:
        if isinstance(piece, str) and (not run or target == run_target):
            run, run_target = run + piece, target
            continue
        if run:  # adjacent text of one kind is tokenized together, as a template string would be
            encoded = tokenizer.encode(run)
            ids, flags = ids + encoded, flags + [run_target] * len(encoded)
        run, run_target = (piece, target) if isinstance(piece, str) else ("", False)
        if not isinstance(piece, str):
            ids, flags = ids + piece, flags + [target] * len(piece)
    return ids, flags
