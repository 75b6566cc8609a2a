"""The trainer's image and video preprocessing: its flags (both argument parsers, MindSpeed-MM's data.json names
in their help) and the processing they give over the model's own (a converted checkpoint's preprocessor files, or
its family's defaults)."""

from __future__ import annotations


def add_preprocessing_arguments(add) -> None:
    """The image and video preprocessing flags, through `add` (an argument group's add_argument)."""
    add("--image-min-pixels", type=int, default=None, metavar="N",
        help="an image is resized to at least N pixels (default: the model's preprocessor_config.json, else its "
             "family's; MindSpeed-MM's data.json image_min_pixels)")
    add("--image-max-pixels", type=int, default=None, metavar="N",
        help="and to at most N pixels (MindSpeed-MM's data.json image_max_pixels)")
    add("--video-min-pixels", type=int, default=None, metavar="N",
        help="a video frame is resized to at least N pixels (Qwen2.5-VL: a frame's, Qwen3-VL: the clip's, as their "
             "video processors; default: the model's video_preprocessor_config.json, else the processor's; "
             "MindSpeed-MM's data.json video_min_pixels)")
    add("--video-max-pixels", type=int, default=None, metavar="N",
        help="and to at most N pixels (MindSpeed-MM's data.json video_max_pixels)")
    add("--video-fps", type=float, default=None, metavar="F",
        help="frames sampled per second of video (default 2; MindSpeed-MM's data.json video_fps)")
    add("--video-max-frames", type=int, default=None, metavar="N",
        help="at most N frames sampled from a video (default 768; MindSpeed-MM's data.json video_maxlen)")


def processing(args, config):
    """The family's image and video preprocessing: a converted --load's preprocessor_config.json (Qwen3-VL requires
    it) and video_preprocessor_config.json, the family's defaults for a tiny model; --image-*/--video-* over them."""
    import dataclasses
    from pathlib import Path

    from mm_adaptor.data import DataError

    from mm_adaptor.data.images import ImageProcessing

    hf = Path(args.load or "") / "hf"
    if getattr(args, "image_processor_dir", None):  # --mm-data's model_name_or_path
        found = ImageProcessing.for_directory(args.image_processor_dir, config)
    elif args.load and (hf / "config.json").exists():
        found = ImageProcessing.for_directory(hf, config)
    else:
        found = ImageProcessing.for_model(config)
    found = found.with_pixels(getattr(args, "image_min_pixels", None), getattr(args, "image_max_pixels", None))
    video = {name: getattr(args, f"video_{name}", None) for name in ("min_pixels", "max_pixels", "fps", "max_frames")}
    given = [f"--video-{name.replace('_', '-')}" for name, value in video.items() if value is not None]
    if found.video is None:
        if given:
            raise DataError(f"{' and '.join(given)}: this model's preprocessing takes no video (Qwen2.5-VL and "
                            "Qwen3-VL do; a Qwen3-VL checkpoint needs its video_preprocessor_config.json)")
        return found
    try:
        return dataclasses.replace(found, video=found.video.with_settings(**video))
    except ValueError as exc:
        raise DataError(f"{' '.join(given)}: {exc}") from None
