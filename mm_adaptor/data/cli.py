"""`mm-adaptor data llava-to-messages | make-shapes | check | prepare`: a refusal is one line and exit status 2."""

from __future__ import annotations

import sys

from mm_adaptor.core.one_line_parser import ArgumentParser, did_you_mean

SUBCOMMANDS = ("llava-to-messages", "make-shapes", "check", "prepare")


def add_preprocessing_arguments(add) -> None:
    """The image and video preprocessing flags, through `add` (an argument group's add_argument): the trainer's
    parsers and `data check`/`prepare` (whose index is then the trainer's)."""
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


def with_preprocessing_flags(processing, args):
    """`processing` with the --image-*/--video-* flags of args over it; DataError in one line for a video flag a
    model without video preprocessing cannot take, or impossible settings."""
    import dataclasses

    from mm_adaptor.data.records import DataError

    found = processing.with_pixels(getattr(args, "image_min_pixels", None), getattr(args, "image_max_pixels", None))
    video = {name: getattr(args, f"video_{name}", None) for name in ("min_pixels", "max_pixels", "fps", "max_frames")}
    given = [f"--video-{name.replace('_', '-')}" for name, value in video.items() if value is not None]
    if getattr(found, "video", None) is None:
        if given:
            raise DataError(f"{' and '.join(given)}: this model's preprocessing takes no video (Qwen2.5-VL and "
                            "Qwen3-VL do; a Qwen3-VL checkpoint needs its video_preprocessor_config.json)")
        return found
    try:
        return dataclasses.replace(found, video=found.video.with_settings(**video))
    except ValueError as exc:
        raise DataError(f"{' '.join(given)}: {exc}") from None


def _parser(name: str) -> ArgumentParser:
    parser = ArgumentParser(prog=f"mm-adaptor data {name}")
    if name == "llava-to-messages":
        parser.description = "LLaVA JSON/JSONL (image, conversations) -> MindSpeed-MM messages JSON"
        parser.add_argument("input", metavar="IN")
        parser.add_argument("output", metavar="OUT")
        parser.add_argument("--image-folder", default=None, help="the folder LLaVA's image paths are relative to "
                                                                 "(default: IN's folder)")
    elif name == "make-shapes":
        parser.description = "a generated shapes-and-colours caption dataset (PNG + messages JSON)"
        parser.add_argument("out_dir", metavar="OUT_DIR")
        parser.add_argument("--count", type=int, default=64)
        parser.add_argument("--seed", type=int, default=0)
    else:
        if name == "check":
            parser.description = "the validation pass: bad records, one line each, and the sample count"
        else:
            parser.description = ("the data's index, built once (a process per core) for the settings a training "
                                  "run gives: later runs with the same data and settings open it in seconds")
        parser.add_argument("data_path", metavar="DATA")
        if name == "prepare":
            parser.add_argument("cache_dir", metavar="OUT", nargs="?", default=None,
                                help="where indexes live: the trainer's --data-cache (default: "
                                     "$MM_ADAPTOR_DATA_CACHE, else $XDG_CACHE_HOME/mm_adaptor/data-index)")
            parser.add_argument("--workers", type=int, default=None, help="processes (default: one per core)")
        parser.add_argument("--seq-length", type=int, required=True)
        parser.add_argument("--tokenizer-model", default=None, help="an HF tokenizer directory (default: bytes)")
        add_preprocessing_arguments(parser.add_argument)
        parser.add_argument("--max-samples", type=int, default=None)
        parser.add_argument("--model", default=None, help="the family whose preprocessing and special tokens the "
                                                          "data takes: NAME-tiny (its tiny preset), or NAME with "
                                                          "--load (default: --load's, else Qwen2.5-VL's)")
        parser.add_argument("--load", default=None, help="a converted checkpoint: its hf/config.json names the "
                                                         "family, its hf/ the preprocessing and the tokenizer")
    return parser


def main(argv: list[str]) -> int:
    from mm_adaptor.data.records import DataError

    if not argv or argv[0] in ("-h", "--help"):
        print("usage: mm-adaptor data {" + ",".join(SUBCOMMANDS) + "} ...  (each has --help)")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        hint = did_you_mean(name, SUBCOMMANDS)
        print(f"mm-adaptor data: error: unknown subcommand {name!r}" + (f"; {hint}" if hint else ""),
              file=sys.stderr)
        return 2
    parser = _parser(name)
    args = parser.parse_args(rest)
    if getattr(args, "workers", None) is not None and args.workers < 1:
        parser.error(f"argument --workers: {args.workers}: want 1 or more")
    try:
        return _run(name, args)
    except DataError as exc:
        print(f"mm-adaptor data {name}: error: " + " ".join(str(exc).split()), file=sys.stderr)
        return 2


def _run(name, args) -> int:
    if name == "llava-to-messages":
        from mm_adaptor.data.records import llava_to_messages

        print(f"{llava_to_messages(args.input, args.output, args.image_folder)} records written to {args.output}")
    elif name == "make-shapes":
        from mm_adaptor.data.shapes import make_shapes

        print(f"{args.count} samples written to {make_shapes(args.out_dir, args.count, args.seed)}")
    else:
        from mm_adaptor.data.tokenizer import BYTE_TOKENIZER_NOTE, ByteTokenizer, check_model_matches, for_checkpoint
        from mm_adaptor.data.vlm import validate

        from mm_adaptor.data.images import QWEN2_5_VL

        config, processing = _model_data(args)
        processing = with_preprocessing_flags(processing or QWEN2_5_VL, args)
        tokenizer = for_checkpoint(args.tokenizer_model, args.load, config)
        if isinstance(tokenizer, ByteTokenizer):
            print(BYTE_TOKENIZER_NOTE, file=sys.stderr)
        if config is not None:
            check_model_matches(tokenizer, config)
        prepare = name == "prepare"
        report = validate(args.data_path, tokenizer, args.seq_length, args.image_min_pixels, args.image_max_pixels,
                          args.max_samples, True, processing, getattr(args, "cache_dir", None),
                          getattr(args, "workers", None), verbose=prepare)
        if prepare:
            print(f"{report.summary()}; the bad ones' lines: {report.samples.index.directory / 'bad.txt'}"
                  if report.bad else report.summary())
            return 0
        for line in report.bad:
            print(line)
        print(report.summary())
        return 1 if report.bad else 0
    return 0


def _model_data(args):
    """(model config, image preprocessing) of `check` and `prepare`: --load's family and preprocessing
    (hf/preprocessor_config.json), or --model NAME-tiny's; neither: Qwen2.5-VL's defaults."""
    from pathlib import Path

    from mm_adaptor.data.images import ImageProcessing
    from mm_adaptor.data.records import DataError
    from mm_adaptor.models import registry

    if args.model is None and args.load is None:
        return None, None
    try:
        spec, tiny = registry.resolve(args.model) if args.model else (None, False)
        if spec is not None and spec.package is None:
            raise ValueError(f"--model {args.model} takes no image data (a vision-language family does)")
        if args.load is None:
            if not tiny:
                raise ValueError(f"--model {args.model} needs --load (a converted checkpoint), or {args.model}-tiny")
            config = spec.tiny_config()
            return config, ImageProcessing.for_model(config)
        if tiny:
            raise ValueError(f"--model {args.model} is a tiny preset; with --load give --model {spec.name} or none")
        found = registry.spec_for_directory(args.load)
        if spec is not None and spec is not found:
            raise ValueError(f"--model {args.model}: --load {args.load} holds a checkpoint of family {found.name}")
        hf = Path(args.load) / "hf"
        config = found.config_from_hf(registry.hf_config_of(args.load))
        return config, ImageProcessing.for_directory(hf, config)
    except (ValueError, OSError) as exc:
        raise DataError(str(exc)) from None
