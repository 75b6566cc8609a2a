"""Videos in records (MindSpeed-MM's `videos` field and `<video>` tags) for Qwen2.5-VL and Qwen3-VL.

A clip is read with PyAV as transformers' pyav reader reads it (the stream's frame count and average rate from the
container, frames decoded in order, RGB), frames are sampled and preprocessed as the family's transformers video
processor does with fps sampling (Qwen2VLVideoProcessor for Qwen2.5-VL, Qwen3VLVideoProcessor for Qwen3-VL), and the
prompt's placeholder is the family processor's: Qwen2.5-VL one vision block of t*h*w/4 video pads (its rope times
each temporal patch by seconds per grid), Qwen3-VL a "<s seconds>" text and a block of h*w/4 pads per temporal patch.

What the index keeps of a clip (`Clip`): its frame count, frame rate and size, from the container header; the frame
indices, the grid and the pads follow from them and the settings (`VideoProcessing`), so the validation pass decodes
no frame."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from mm_adaptor.data.pixels import smart_resize

QWEN2_5_VL_VIDEO_PIXELS = (128 * 28 * 28, 768 * 28 * 28)  # Qwen2VLVideoProcessor's size (shortest/longest edge)
QWEN3_VL_VIDEO_PIXELS = (128 * 32 * 32, 768 * 32 * 32)  # Qwen3VLVideoProcessor's
SAMPLING_FAMILIES = ("qwen2_5_vl", "qwen3_vl")


@dataclass(frozen=True)
class Clip:
    """A video as the index keeps it: total frames, frames per second, height and width (the container's)."""
    frames: int
    fps: float
    height: int
    width: int


@dataclass(frozen=True)
class VideoProcessing:
    """How a family samples, sizes and patches a clip. `frames`: an ImageProcessing holding the patch, merge and
    temporal sizes, the statistics and the video pixel bounds (per frame for Qwen2.5-VL, per clip for Qwen3-VL, as
    their processors read them)."""
    family: str
    frames: object
    fps: float = 2.0
    min_frames: int = 4
    max_frames: int = 768

    def __post_init__(self):
        if self.family not in SAMPLING_FAMILIES:
            raise ValueError(f"no video processing for family {self.family!r} (known: {', '.join(SAMPLING_FAMILIES)})")

    def with_settings(self, min_pixels=None, max_pixels=None, fps=None, max_frames=None) -> VideoProcessing:
        """These settings where given (not None), the others kept; ValueError for impossible ones."""
        frames = self.frames.with_pixels(min_pixels, max_pixels)
        if not 0 < frames.min_pixels <= frames.max_pixels:
            raise ValueError(f"video pixels from {frames.min_pixels} to {frames.max_pixels}: want 0 < min <= max")
        found = replace(self, frames=frames, fps=self.fps if fps is None else float(fps),
                        max_frames=self.max_frames if max_frames is None else int(max_frames))
        if found.fps <= 0 or found.max_frames < max(found.min_frames, found.frames.temporal_patch_size):
            raise ValueError(f"video fps {found.fps} and at most {found.max_frames} frames: want fps > 0 and at "
                             f"least {max(found.min_frames, found.frames.temporal_patch_size)} frames")
        return found

    def indices(self, clip: Clip) -> list[int]:
        """The frames the family's processor samples at self.fps."""
        total, tp = clip.frames, self.frames.temporal_patch_size
        if self.family == "qwen3_vl":  # Qwen3VLVideoProcessor.sample_frames
            count = min(max(int(total / clip.fps * self.fps), self.min_frames), self.max_frames, total)
            return [int(i) for i in np.linspace(0, total - 1, count).round().astype(int)]
        # Qwen2VLVideoProcessor.sample_frames: the count floored to the temporal patch, then torch.arange's steps
        cap = math.floor(min(self.max_frames, total) / tp) * tp
        count = math.floor(min(max(total / clip.fps * self.fps, self.min_frames), cap, total) / tp) * tp
        if count < tp:
            raise ValueError(f"a video of {total} frames is too short to sample {tp} frames")
        import torch

        return [int(i) for i in torch.arange(0, total, total / count).int()]

    def size(self, count: int, clip: Clip) -> tuple[int, int]:
        """(rows, cols) every sampled frame is resized to."""
        f = self.frames
        if self.family == "qwen3_vl":
            return video_smart_resize(count, clip.height, clip.width, f.factor, f.temporal_patch_size, f.min_pixels,
                                      f.max_pixels)
        return smart_resize(clip.height, clip.width, f.factor, f.min_pixels, f.max_pixels)

    def grid(self, clip: Clip) -> tuple[int, int, int]:
        """video_grid_thw of the clip (no frame decoded)."""
        count = len(self.indices(clip))
        rows, cols = self.size(count, clip)
        p = self.frames.patch_size
        return -(-count // self.frames.temporal_patch_size), rows // p, cols // p

    def seconds_per_grid(self, clip: Clip) -> float:
        """Qwen2.5-VL's second_per_grid_ts: the temporal patch over the sampled rate (sampled / total * fps)."""
        sampled_fps = len(self.indices(clip)) / clip.frames * clip.fps
        return self.frames.temporal_patch_size / sampled_fps

    def pieces(self, clip: Clip, special: dict) -> list:
        """The prompt's placeholder of the clip: str pieces (tokenized with the text around) and id lists."""
        grid = self.grid(clip)
        merge = self.frames.merge_size ** 2
        start, pad, end = special["<|vision_start|>"], special["<|video_pad|>"], special["<|vision_end|>"]
        if self.family == "qwen2_5_vl":
            return [[start] + [pad] * (grid[0] * grid[1] * grid[2] // merge) + [end]]
        block = [start] + [pad] * (grid[1] * grid[2] // merge) + [end]
        pieces = []
        for seconds in frame_timestamps(self.indices(clip), clip.fps, self.frames.merge_size):
            pieces += [f"<{seconds:.1f} seconds>", block]
        return pieces

    def pixels(self, path: str, clip: Clip):
        """(pixel_values_videos float32 [t*h*w, 3*T*P*P], grid) of the clip's sampled frames, decoded."""
        indices = self.indices(clip)  # decode() refuses a clip with fewer frames: the grid is grid(clip)'s
        return self.frames.video_pixels(decode(path, indices), self.size(len(indices), clip))


def video_smart_resize(frames: int, height: int, width: int, factor: int, temporal_factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """Qwen3-VL's frame size for a clip: as smart_resize, but the bounds hold the clip's volume (frames rounded to
    the temporal patch, times the frame's area), and too few frames, a side under factor or an aspect ratio over
    200 are errors (as in transformers)."""
    if frames < temporal_factor:
        raise ValueError(f"a video needs at least {temporal_factor} frames, got {frames}")
    if min(height, width) < factor:
        raise ValueError(f"video frames of {width}x{height}: both sides must be at least {factor}")
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"aspect ratio {max(height, width) / min(height, width):.1f} is over 200")
    rows, cols = round(height / factor) * factor, round(width / factor) * factor
    volume = round(frames / temporal_factor) * temporal_factor * rows * cols
    if volume > max_pixels:
        shrink = math.sqrt(frames * height * width / max_pixels)
        rows = max(factor, math.floor(height / shrink / factor) * factor)
        cols = max(factor, math.floor(width / shrink / factor) * factor)
    elif volume < min_pixels:
        grow = math.sqrt(min_pixels / (frames * height * width))
        rows = math.ceil(height * grow / factor) * factor
        cols = math.ceil(width * grow / factor) * factor
    return rows, cols


def frame_timestamps(frame_indices, fps: float, merge_size: int = 2) -> list[float]:
    """Seconds of each temporal patch as Qwen3VLProcessor writes them: the sampled frame indices padded with the
    last to a multiple of merge_size (transformers groups by the merge size, which equals the temporal patch 2),
    each group's first and last frame times averaged."""
    indices = [int(i) for i in frame_indices]
    indices += indices[-1:] * (-len(indices) % merge_size)
    return [(indices[i] / fps + indices[i + merge_size - 1] / fps) / 2 for i in range(0, len(indices), merge_size)]


def video_placeholder(timestamps, tokens_per_frame: int) -> str:
    """The text that replaces "<|vision_start|><|video_pad|><|vision_end|>" in Qwen3-VL's prompt: per temporal
    patch "<{seconds:.1f} seconds>" then a vision block of tokens_per_frame video pads."""
    block = "<|vision_start|>" + "<|video_pad|>" * tokens_per_frame + "<|vision_end|>"
    return "".join(f"<{seconds:.1f} seconds>{block}" for seconds in timestamps)


def probe(path: str) -> Clip:
    """The clip's frame count, rate and size from its container header (no frame decoded); OSError or
    ValueError for a file PyAV cannot open or one without a frame count or rate."""
    import os

    av = _pyav()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"video {path} does not exist")
    try:
        with av.open(path) as container:
            if not container.streams.video:
                raise ValueError(f"video {path} has no video stream")
            stream = container.streams.video[0]
            frames, rate = int(stream.frames), stream.average_rate
            clip = Clip(frames, float(rate) if rate else 0.0, int(stream.height), int(stream.width))
    except av.error.FFmpegError as exc:
        raise OSError(f"video {path} is unreadable ({type(exc).__name__}: {exc})") from None
    if clip.frames <= 0 or clip.fps <= 0:
        raise ValueError(f"video {path}: its container gives no frame count or rate (re-mux it, e.g. to MP4)")
    return clip


def decode(path: str, indices) -> np.ndarray:
    """The frames at `indices` (sorted) as uint8 RGB [n, H, W, 3], decoded in order from the first."""
    av = _pyav()

    wanted, frames = set(indices), {}
    last = max(indices)
    try:
        with av.open(path) as container:
            for i, frame in enumerate(container.decode(video=0)):
                if i > last:
                    break
                if i in wanted:
                    frames[i] = frame.to_ndarray(format="rgb24")
    except av.error.FFmpegError as exc:
        raise OSError(f"video {path} is unreadable ({type(exc).__name__}: {exc})") from None
    if len(frames) != len(wanted):
        raise ValueError(f"video {path} ends before frame {min(wanted - set(frames))}")
    return np.stack([frames[i] for i in indices])


def write_clip(path: str, frames, fps) -> str:
    """Write RGB frames (uint8 [H, W, 3] arrays or PIL images of one size) as an MPEG-4 video at `fps` (a number or
    a fractions.Fraction) with PyAV; returns the path. The container records the frame count and rate."""
    import fractions

    av = _pyav()
    frames = [np.asarray(frame, dtype=np.uint8) for frame in frames]
    rate = fps if isinstance(fps, fractions.Fraction) else fractions.Fraction(fps).limit_denominator(1001)
    with av.open(path, "w") as container:
        stream = container.add_stream("mpeg4", rate=rate)
        stream.height, stream.width = frames[0].shape[:2]
        stream.pix_fmt = "yuv420p"
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())
    return path


def _pyav():
    try:
        import av
    except ImportError:
        from mm_adaptor.data.records import DataError

        raise DataError("reading videos needs PyAV: pip install av (it comes with mm_adaptor's vlm extra)") from None
    return av
