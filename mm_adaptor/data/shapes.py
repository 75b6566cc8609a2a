"""A generated image-caption dataset whose captions follow from what is drawn: "2 red circles." and so on.

Each image (non-square, sides from 112 to 308 px, multiples of 28 or not) shows 1..3 shapes of one kind and colour
on a light background, in cells of a grid so they never overlap. The caption comes from a vocabulary of a dozen
words, so a small model can learn it. Written as messages-format JSON beside the PNG files. With `videos`, every
that-many-th record is instead a short MPEG-4 clip (PyAV) of its shapes drifting across the frame."""

from __future__ import annotations

import json
import os
import random

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 70, 220), "yellow": (230, 200, 20)}
SHAPES = ("circle", "square", "triangle")
NUMBERS = {1: "1", 2: "2", 3: "3"}
QUESTION = "<image>What is in the picture?"
VIDEO_QUESTION = "<video>What is in the video?"
SIDES = (112, 140, 150, 168, 196, 224, 250, 280, 308)


def caption(count: int, colour: str, shape: str) -> str:
    return f"{NUMBERS[count]} {colour} {shape}{'s' if count > 1 else ''}."


def draw(width: int, height: int, count: int, colour: str, shape: str, rng: random.Random):
    """A PIL image of `count` shapes, each in its own cell of a row (wide images) or column (tall ones)."""
    from PIL import Image, ImageDraw

    background = tuple(rng.randint(225, 255) for _ in range(3))
    image = Image.new("RGB", (width, height), background)
    pen = ImageDraw.Draw(image)
    across = width >= height
    cell = (width // count, height) if across else (width, height // count)
    for i in range(count):
        left, top = (i * cell[0], 0) if across else (0, i * cell[1])
        extent = min(cell) * rng.uniform(0.5, 0.8)
        x = left + rng.uniform(0, cell[0] - extent)
        y = top + rng.uniform(0, cell[1] - extent)
        box = (x, y, x + extent, y + extent)
        fill = COLOURS[colour]
        if shape == "circle":
            pen.ellipse(box, fill=fill)
        elif shape == "square":
            pen.rectangle(box, fill=fill)
        else:
            pen.polygon([(x + extent / 2, y), (x, y + extent), (x + extent, y + extent)], fill=fill)
    return image


def make_shapes(out_dir: str, count: int = 64, seed: int = 0, name: str = "shapes.json", videos: int = 0) -> str:
    """Write `count` PNG images (with `videos` > 0, every videos-th record a clip instead: sides a quarter of an
    image's, 6 to 12 frames at 4 to 12 frames per second) and out_dir/name (messages format, paths relative to
    it); returns the JSON path."""
    rng = random.Random(seed)
    os.makedirs(os.path.join(out_dir, "images"), exist_ok=True)
    records = []
    for i in range(count):
        width, height = rng.choice(SIDES), rng.choice(SIDES)
        while width == height:
            height = rng.choice(SIDES)
        number, colour, shape = rng.randint(1, 3), rng.choice(list(COLOURS)), rng.choice(SHAPES)
        answer = [{"role": "assistant", "content": caption(number, colour, shape)}]
        if videos and i % videos == videos - 1:
            from mm_adaptor.data.video import write_clip

            frames, fps = rng.randint(6, 12), rng.choice((4, 6, 12))
            image = draw(width, height, number, colour, shape, rng)
            small = image.resize((width // 4 * 2, height // 4 * 2))  # even sides: the codec's 4:2:0 chroma
            relative = os.path.join("images", f"{i:05d}.mp4")
            clip = [_shifted(small, step) for step in range(frames)]
            write_clip(os.path.join(out_dir, relative), clip, fps)
            records.append({"messages": [{"role": "user", "content": VIDEO_QUESTION}, *answer],
                            "videos": [relative]})
            continue
        relative = os.path.join("images", f"{i:05d}.png")
        draw(width, height, number, colour, shape, rng).save(os.path.join(out_dir, relative))
        records.append({"messages": [{"role": "user", "content": QUESTION}, *answer], "images": [relative]})
    path = os.path.join(out_dir, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(records, f, indent=1)
    return path


def _shifted(image, step: int):
    """The image rolled `step` pixels right and down (the clip's motion)."""
    import numpy as np

    return np.roll(np.asarray(image), (step, step), axis=(0, 1))
