"""The trainer's image and video preprocessing: the model's own (a converted checkpoint's preprocessor files, or its
family's defaults) with the --image-*/--video-* flags over it (mm_adaptor.data.cli defines them)."""

from __future__ import annotations


def processing(args, config):
    """The family's image and video preprocessing: a converted --load's preprocessor_config.json (Qwen3-VL requires
    it) and video_preprocessor_config.json, the family's defaults for a tiny model; --image-*/--video-* over them."""
    from pathlib import Path

    from mm_adaptor.data.cli import with_preprocessing_flags
    from mm_adaptor.data.images import ImageProcessing

    from mm_adaptor.train.families import model_home

    home = model_home(args)
    hf = Path(home or "") / "hf"
    if getattr(args, "image_processor_dir", None):  # --mm-data's model_name_or_path
        found = ImageProcessing.for_directory(args.image_processor_dir, config)
    elif home and (hf / "config.json").exists():
        found = ImageProcessing.for_directory(hf, config)
    else:
        found = ImageProcessing.for_model(config)
    return with_preprocessing_flags(found, args)
