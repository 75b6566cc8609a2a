"""Every argument of MindSpeed-MM's Qwen2.5-VL fine-tuning scripts (examples/qwen2.5vl/finetune_qwen2_5_vl_*.sh:
DISTRIBUTED_ARGS, GPT_ARGS, MM_ARGS, OUTPUT_ARGS and the backend) and what it does here. docs/mindspeed-mm.md's
table is generated from ARGUMENTS (mm_adaptor/cli/docs_gen.py). Imports neither torch nor megatron."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

# what an argument does here
SAME = "same"  # the driver's flag of the same name and meaning
MAPPED = "mapped"  # translated into the driver's flags (the note says how)
NO_EFFECT = "no effect"  # only tunes their runtime: accepted, one line says so
REFUSED = "refused"  # changes the math and is not supported (refused in one line where the note says)
TORCHRUN = "torchrun"  # read by torchrun itself

BACKEND_DEVICES = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


@dataclass(frozen=True)
class Argument:
    name: str
    group: str  # the scripts' variable that holds it
    kind: str
    note: str


def _args(group: str, kind: str, note: str, *names: str) -> list[Argument]:
    return [Argument(name, group, kind, note) for name in names]


ARGUMENTS: tuple[Argument, ...] = tuple(
    _args("DISTRIBUTED_ARGS", TORCHRUN, "torchrun's own; `mm-adaptor train` without torchrun takes --nproc-per-node",
          "--nproc_per_node", "--nnodes", "--node_rank", "--master_addr", "--master_port")
    + _args("GPT_ARGS", NO_EFFECT, "megatron-core's models are the only ones here", "--use-mcore-models")
    + _args("GPT_ARGS", SAME, "Megatron-LM's flag", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
            "--micro-batch-size", "--global-batch-size", "--seq-length", "--lr", "--lr-decay-style",
            "--weight-decay", "--train-iters", "--clip-grad", "--adam-beta1", "--adam-beta2", "--seed", "--bf16",
            "--use-distributed-optimizer", "--no-load-optim", "--no-load-rng", "--no-save-optim", "--no-save-rng")
    + _args("GPT_ARGS", SAME, "the context-parallel feature (MindSpeed's names; docs/features/)",
            "--context-parallel-size", "--context-parallel-algo")
    + _args("GPT_ARGS", SAME, "the feature of that name (docs/features/)", "--use-fused-rmsnorm", "--use-fused-swiglu",
            "--use-flash-attn")
    + _args("GPT_ARGS", NO_EFFECT, "the tokenizer comes from --mm-data's model_name_or_path (or the built-in byte "
            "tokenizer); only NullTokenizer is accepted", "--tokenizer-type")
    + _args("GPT_ARGS", MAPPED, "must equal --mm-model's text_decoder.vocab_size (refused naming both otherwise)",
            "--vocab-size")
    + _args("GPT_ARGS", REFUSED, "1 (no padding) is accepted; another value pads the output layer's vocabulary, "
            "which is refused", "--make-vocab-size-divisible-by")
    + _args("GPT_ARGS", MAPPED, "must agree with --mm-model's text_decoder (RMSNorm, SwiGLU), refused otherwise",
            "--normalization", "--swiglu")
    + _args("GPT_ARGS", NO_EFFECT, "the local spec's softmax is not fused here", "--no-masked-softmax-fusion")
    + _args("GPT_ARGS", MAPPED, "--lr-warmup-iters = fraction x --train-iters (Megatron's rule when no decay "
            "iterations are given)", "--lr-warmup-fraction")
    + _args("GPT_ARGS", NO_EFFECT, "the default here (--gradient-accumulation-fusion turns it on)",
            "--no-gradient-accumulation-fusion")
    + _args("GPT_ARGS", SAME, "a converted checkpoint (hf-to-mcore), a training run's --save, or mm-convert's "
            "layout (release/ or iter_N/ mp_rank_TT_PPP)", "--load")
    + _args("GPT_ARGS", NO_EFFECT, "micro-batches are padded to --seq-length (padding masked from the loss), so "
            "pipeline stages exchange one shape", "--variable-seq-lengths")
    + _args("GPT_ARGS", NO_EFFECT, "the driver's batches are built in the rank", "--num-workers")
    + _args("GPT_ARGS", MAPPED, "--timeout, in seconds (a rank without progress that long is declared hung)",
            "--distributed-timeout-minutes")
    + _args("MM_ARGS", MAPPED, "the data set, its key mapping, template and image pixels (data_json.py)", "--mm-data")
    + _args("MM_ARGS", MAPPED, "the model's shape, pipeline split and frozen modules (model_json.py)", "--mm-model")
    + _args("MM_ARGS", NO_EFFECT, "their profiling and memory tools", "--mm-tool")
    + _args("OUTPUT_ARGS", SAME, "Megatron-LM's flag", "--log-interval", "--save-interval", "--save")
    + _args("OUTPUT_ARGS", SAME, "tokens per sample, non-padding tokens per second and samples per second",
            "--log-tps")
    + _args("OUTPUT_ARGS", NO_EFFECT, "the driver has no validation set", "--eval-interval", "--eval-iters")
    + _args("OUTPUT_ARGS", NO_EFFECT, "--save writes megatron-core's distributed format, which --load and `mm-adaptor "
            "convert mcore-to-hf` read; --load reads their torch format too", "--ckpt-format")
    + _args("command", MAPPED, "the device: gloo the CPU, nccl CUDA, hccl an Ascend NPU (MM_ADAPTOR_DEVICE)",
            "--distributed-backend")
)

BY_NAME = {a.name: a for a in ARGUMENTS}


def add_arguments(parser) -> None:
    """Their arguments that the driver has no flag for."""
    g = parser.add_argument_group("MindSpeed-MM's arguments (docs/mindspeed-mm.md)")
    g.add_argument("--mm-model", default=None, metavar="FILE", help="their model.json (model_id qwen2_5vl)")
    g.add_argument("--mm-data", default=None, metavar="FILE", help="their data.json (template qwen2vl)")
    g.add_argument("--mm-tool", default=None, metavar="FILE", help=BY_NAME["--mm-tool"].note + ": no effect here")
    g.add_argument("--distributed-backend", choices=sorted(BACKEND_DEVICES), default=None,
                   help=BY_NAME["--distributed-backend"].note)
    g.add_argument("--tokenizer-type", choices=["NullTokenizer"], default=None, help="no effect here")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=None, help="only 1")
    g.add_argument("--lr-warmup-fraction", type=float, default=None, help=BY_NAME["--lr-warmup-fraction"].note)
    g.add_argument("--distributed-timeout-minutes", type=float, default=None,
                   help=BY_NAME["--distributed-timeout-minutes"].note)
    g.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default=None, help="no effect here")
    g.add_argument("--eval-interval", type=int, default=None, help="no effect here")
    g.add_argument("--eval-iters", type=int, default=None, help="no effect here")
    g.add_argument("--num-workers", type=int, default=None, help="no effect here")
    for flag in ("--use-mcore-models", "--no-masked-softmax-fusion", "--no-gradient-accumulation-fusion",
                 "--variable-seq-lengths"):
        g.add_argument(flag, action="store_true", help="no effect here")


def has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def given_without_effect(args) -> list[str]:
    """The no-effect arguments this command gives (those the driver registers: not the SAME ones)."""
    return [a.name for a in ARGUMENTS
            if a.kind == NO_EFFECT and getattr(args, _dest(a.name), None) not in (None, False)]


def translate(args) -> tuple[list[str], list[str]]:
    """(problems, notes): their command-line arguments into the driver's flags, in place."""
    problems, notes = [], []
    divisible = args.make_vocab_size_divisible_by
    if divisible not in (None, 1):
        problems.append(f"--make-vocab-size-divisible-by {divisible} pads the vocabulary, which changes the output "
                        "layer's shape (not supported): give 1, as MindSpeed-MM's Qwen2.5-VL scripts do")
    if args.lr_warmup_fraction is not None:
        if args.lr_warmup_iters:
            problems.append(f"--lr-warmup-fraction {args.lr_warmup_fraction} and --lr-warmup-iters "
                            f"{args.lr_warmup_iters} both set the warm-up: give one")
        elif not 0 <= args.lr_warmup_fraction <= 1:
            problems.append(f"--lr-warmup-fraction {args.lr_warmup_fraction}: give a fraction in [0, 1]")
        else:
            args.lr_warmup_iters = int(args.lr_warmup_fraction * args.train_iters)
    if args.no_gradient_accumulation_fusion and args.gradient_accumulation_fusion:
        problems.append("--no-gradient-accumulation-fusion and --gradient-accumulation-fusion: give one")
    if args.distributed_timeout_minutes is not None:
        args.timeout = args.distributed_timeout_minutes * 60
    if args.distributed_backend:
        device = BACKEND_DEVICES[args.distributed_backend]
        forced = os.environ.get("MM_ADAPTOR_DEVICE", "").strip().lower()
        if forced and forced != device:
            problems.append(f"--distributed-backend {args.distributed_backend} runs on {device} but "
                            f"MM_ADAPTOR_DEVICE={forced}: unset one")
        elif device == "npu" and not has_torch_npu():
            problems.append("--distributed-backend hccl runs on an Ascend NPU, which needs torch_npu (not "
                            "installed): install it, or give nccl (CUDA) or gloo (CPU)")
        else:
            os.environ["MM_ADAPTOR_DEVICE"] = device
    for name in given_without_effect(args):
        notes.append(f"{name}: no effect here ({BY_NAME[name].note})")
    return problems, notes


def markdown_table() -> str:
    """docs/mindspeed-mm.md's generated table: every argument of the four scripts and what it does here."""
    rows = ["| argument | in their script | here | what it does here |", "|---|---|---|---|"]
    rows += [f"| `{a.name}` | {a.group} | {a.kind} | {a.note} |" for a in ARGUMENTS]
    return "\n".join(rows) + "\n"
