"""`mm-adaptor convert hf-to-mcore | mcore-to-hf`: a refusal is one line and exit status 2, before anything is
written; progress goes to stderr, one line per shard."""

from __future__ import annotations

import sys

from mm_adaptor.core.one_line_parser import ArgumentParser, did_you_mean

LAYOUT_NOTE = (
    "A Megatron dist checkpoint holds whole tensors and megatron reshards it on load: TP, EP and the pipeline "
    "splits are the layout the conversion checks the model against (heads and key/value heads divisible by TP, TP "
    "at most the key/value heads, experts divisible by EP, splits that add up to the layer counts, the vision tower "
    "on the first stage) and records in mm_adaptor_convert.json and the checkpoint's content metadata; the files "
    "are the same for any layout (each expert under its global number).")


def _hf_to_mcore_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mm-adaptor convert hf-to-mcore",
                            description="Hugging Face directory -> Megatron dist checkpoint. " + LAYOUT_NOTE)
    parser.add_argument("hf_dir", metavar="HF_DIR", help="config.json and safetensors (sharded with an index, or one)")
    parser.add_argument("mcore_dir", metavar="MCORE_DIR",
                        help="an empty or new directory; the driver's --load reads it")
    parser.add_argument("--tensor-model-parallel-size", "--tp", type=int, default=1, dest="tp")
    parser.add_argument("--expert-model-parallel-size", "--ep", type=int, default=1, dest="ep",
                        help="experts per MoE layer must divide by it (default 1)")
    parser.add_argument("--moe-tp-extend-ep", action="store_true",
                        help="for training with --moe-tp-extend-ep: the experts spread whole over TP x EP ranks, "
                             "which must divide them (recorded as expert TP 1, EP TP x EP; the files are the same)")
    parser.add_argument("--llm-pp-layers", default=None,
                        help="language layers per pipeline stage: [[12,16]] (MindSpeed-MM) or 12,16; "
                             "default all on one")
    parser.add_argument("--vit-pp-layers", default=None,
                        help="vision layers per stage, all on the first: [[32,0]] or 32,0")
    parser.add_argument("--lora", default=None, metavar="ADAPTER_DIR",
                        help="convert this peft LoRA adapter (adapter_config.json + adapter_model.safetensors) of the "
                             "model in HF_DIR (its HF directory or converted checkpoint) instead of the model: "
                             "MCORE_DIR then holds the adapters alone, for the trainer's --load beside "
                             "--load-base-model")
    return parser


def _mcore_to_hf_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mm-adaptor convert mcore-to-hf",
                            description="Megatron dist checkpoint -> Hugging Face directory that transformers loads "
                                        "with from_pretrained (sharded safetensors + index, config, tokenizer files); "
                                        "experts fused in the installed transformers' layout.")
    parser.add_argument("mcore_dir", metavar="MCORE_DIR", help="written by hf-to-mcore (or a training run's --save)")
    parser.add_argument("hf_dir", metavar="HF_DIR", help="an empty or new directory")
    _hf_output_arguments(parser, "the HF config.json (default MCORE_DIR/hf/config.json, which hf-to-mcore wrote)")
    parser.add_argument("--layout", choices=["native", "original"], default=None,
                        help="InternVL only: native (transformers' InternVLForConditionalGeneration, the default) or "
                             "original (OpenGVLab's InternVLChatModel)")
    return parser


def _lora_to_hf_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mm-adaptor convert lora-to-hf",
                            description="A LoRA run's --save (adapters alone, any TP/PP layout) -> peft's adapter "
                                        "directory (adapter_config.json + adapter_model.safetensors) for "
                                        "transformers' model, which PeftModel.from_pretrained loads.")
    parser.add_argument("mcore_dir", metavar="MCORE_DIR", help="the LoRA run's --save (its latest iteration)")
    parser.add_argument("hf_dir", metavar="OUT", help="an empty or new directory")
    parser.add_argument("--hf-config", default=None,
                        help="the base model's config.json (default MCORE_DIR/hf/config.json, which the run wrote)")
    return parser


def _merge_lora_parser() -> ArgumentParser:
    parser = ArgumentParser(prog="mm-adaptor convert merge-lora",
                            description="A LoRA run's --save merged into its base model: a whole Hugging Face "
                                        "checkpoint (W + alpha / r * B @ A, what peft's merge_and_unload gives).")
    parser.add_argument("mcore_dir", metavar="LORA_DIR", help="the LoRA run's --save (its latest iteration)")
    parser.add_argument("hf_dir", metavar="OUT", help="an empty or new directory")
    parser.add_argument("--base", default=None, metavar="BASE_DIR",
                        help="the base model's Megatron checkpoint (default: the run's --load-base-model)")
    _hf_output_arguments(parser, "the base model's config.json (default LORA_DIR/hf/config.json, which the run "
                                 "wrote)")
    return parser


def _hf_output_arguments(parser, config_help: str) -> None:
    """The flags of a command that writes a whole HF checkpoint: its config and its shard size."""
    parser.add_argument("--hf-config", default=None, help=config_help)
    parser.add_argument("--max-shard-size-gb", type=float, default=5.0, help="largest output shard (default 5)")


COMMANDS = {"hf-to-mcore": _hf_to_mcore_parser, "mcore-to-hf": _mcore_to_hf_parser, "lora-to-hf": _lora_to_hf_parser,
            "merge-lora": _merge_lora_parser}


def main(argv: list[str]) -> int:
    top = ArgumentParser(prog="mm-adaptor convert",
                         description="Convert checkpoints (Qwen2.5-VL, Qwen3-VL, Qwen3-VL-MoE, InternVL). "
                                     + LAYOUT_NOTE,
                         help_hint="`mm-adaptor convert --help` lists the directions")
    top.add_argument("direction", choices=list(COMMANDS),
                     help="hf-to-mcore, mcore-to-hf, lora-to-hf or merge-lora (each has --help)")
    if not argv or argv[0].startswith("-"):
        top.parse_args(argv or ["--help"])
        return 2
    if argv[0] not in COMMANDS:
        hint = did_you_mean(argv[0], COMMANDS)
        top.fail(f"unknown direction {argv[0]}" + (f": {hint}" if hint else "") + top.help_pointer())
    parser = COMMANDS[argv[0]]()
    args = parser.parse_args(argv[1:])

    from mm_adaptor.convert import ConvertError

    try:
        if argv[0] == "merge-lora":
            from mm_adaptor.lora.convert import merge

            figures = merge(args.mcore_dir, args.hf_dir, args.base, args.hf_config, int(args.max_shard_size_gb * 1e9))
        elif argv[0] == "lora-to-hf":
            from mm_adaptor.lora.convert import lora_to_hf

            figures = lora_to_hf(args.mcore_dir, args.hf_dir, args.hf_config)
        elif argv[0] == "hf-to-mcore" and args.lora:
            from mm_adaptor.lora.convert import hf_to_mcore

            if (args.tp, args.ep, args.llm_pp_layers, args.vit_pp_layers, args.moe_tp_extend_ep) != \
                    (1, 1, None, None, False):
                raise ConvertError("--lora converts an adapter, which the trainer reshards to its layout on load: "
                                   "drop the layout flags")
            figures = hf_to_mcore(args.lora, args.hf_dir, args.mcore_dir)
        elif argv[0] == "hf-to-mcore":
            from mm_adaptor.convert.hf_to_mcore import convert
            from mm_adaptor.convert.layout import parse_layers

            figures = convert(args.hf_dir, args.mcore_dir, args.tp,
                              parse_layers(args.llm_pp_layers, "--llm-pp-layers"),
                              parse_layers(args.vit_pp_layers, "--vit-pp-layers"), args.ep,
                              args.moe_tp_extend_ep)
        else:
            from mm_adaptor.convert.mcore_to_hf import convert

            if args.max_shard_size_gb <= 0:
                raise ConvertError(f"--max-shard-size-gb {args.max_shard_size_gb}: must be positive")
            figures = convert(args.mcore_dir, args.hf_dir, args.hf_config, int(args.max_shard_size_gb * 1e9),
                              args.layout)
    except ConvertError as error:
        parser.fail(str(error))
    print(f"{argv[0]}: {figures['tensors']} tensors, {figures['bytes'] / 1e9:.2f} GB in {figures['seconds']:.1f} s",
          file=sys.stderr)
    return 0
