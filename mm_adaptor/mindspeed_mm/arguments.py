"""Every argument of MindSpeed-MM's Qwen2.5-VL fine-tuning scripts (examples/qwen2.5vl/finetune_qwen2_5_vl_*.sh:
DISTRIBUTED_ARGS, GPT_ARGS, MM_ARGS, OUTPUT_ARGS and the backend) and what it does here. docs/mindspeed-mm.md's
table is generated from ARGUMENTS (mm_adaptor/cli/docs_gen.py). Imports neither torch nor megatron."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

# what an argument does here
SAME = "same"  # Megatron-LM's flag (or the trainer's) of the same name and meaning
MAPPED = "mapped"  # translated into Megatron-LM's flags (the note says how)
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
    _args("DISTRIBUTED_ARGS", TORCHRUN, "torchrun's own; `mm-adaptor train` without torchrun takes --nproc-per-node, "
          "--nnodes, --node-rank, --master-addr and --master-port", "--nproc_per_node", "--nnodes", "--node_rank",
          "--master_addr", "--master_port")
    + _args("GPT_ARGS", SAME, "Megatron-LM's flag (megatron-core's models are the only ones here)",
            "--use-mcore-models")
    + _args("GPT_ARGS", SAME, "Megatron-LM's flag, read by its training loop", "--tensor-model-parallel-size",
            "--pipeline-model-parallel-size", "--micro-batch-size", "--global-batch-size", "--seq-length", "--lr",
            "--lr-decay-style", "--weight-decay", "--train-iters", "--clip-grad", "--adam-beta1", "--adam-beta2",
            "--seed", "--bf16", "--use-distributed-optimizer", "--no-load-optim", "--no-load-rng", "--no-save-optim",
            "--no-save-rng", "--lr-warmup-fraction", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
            "--distributed-timeout-minutes", "--num-workers")
    + _args("GPT_ARGS", SAME, "the context-parallel feature (MindSpeed's names; docs/features/)",
            "--context-parallel-size", "--context-parallel-algo")
    + _args("GPT_ARGS", SAME, "the feature of that name (docs/features/)", "--use-fused-rmsnorm", "--use-fused-swiglu",
            "--use-flash-attn")
    + _args("GPT_ARGS", SAME, "Megatron-LM's flag (its tokenizer sizes its vocabulary; the data is tokenized with "
            "--mm-data's model_name_or_path)", "--tokenizer-type")
    + _args("GPT_ARGS", MAPPED, "must equal --mm-model's text_decoder.vocab_size (refused naming both otherwise)",
            "--vocab-size")
    + _args("GPT_ARGS", REFUSED, "1 (no padding, the default for a vision-language model here) is accepted; another "
            "value would pad the output layer's vocabulary, which is refused", "--make-vocab-size-divisible-by")
    + _args("GPT_ARGS", MAPPED, "must agree with --mm-model's text_decoder (RMSNorm, SwiGLU), refused otherwise",
            "--normalization", "--swiglu")
    + _args("GPT_ARGS", SAME, "Megatron-LM's --load; also a checkpoint converted by hf-to-mcore and mm-convert's "
            "layout (release/ or iter_N/ mp_rank_TT_PPP)", "--load")
    + _args("GPT_ARGS", NO_EFFECT, "micro-batches are padded to --seq-length (padding masked from the loss), so "
            "pipeline stages exchange one shape", "--variable-seq-lengths")
    + _args("MM_ARGS", MAPPED, "the data set, its key mapping, template and image pixels (data_json.py)", "--mm-data")
    + _args("MM_ARGS", MAPPED, "the model's shape, pipeline split and frozen modules (model_json.py)", "--mm-model")
    + _args("MM_ARGS", NO_EFFECT, "their profiling and memory tools", "--mm-tool")
    + _args("OUTPUT_ARGS", SAME, "Megatron-LM's flag, read by its training loop", "--log-interval", "--save-interval",
            "--save", "--eval-interval", "--eval-iters", "--ckpt-format")
    + _args("OUTPUT_ARGS", SAME, "tokens per sample, non-padding tokens per second and samples per second on "
            "Megatron's iteration line", "--log-tps")
    + _args("command", MAPPED, "the device: gloo the CPU, nccl CUDA, hccl an Ascend NPU (MM_ADAPTOR_DEVICE)",
            "--distributed-backend")
)

BY_NAME = {a.name: a for a in ARGUMENTS}


GROUP = "MindSpeed-MM's arguments (docs/mindspeed-mm.md; not Megatron-LM's)"


def trainer_arguments() -> list[tuple[str, dict]]:
    """Their arguments that Megatron-LM's parser does not have (the trainer adds each one it lacks)."""
    return [
        ("--mm-model", dict(default=None, metavar="FILE", help="their model.json (model_id qwen2_5vl)")),
        ("--mm-data", dict(default=None, metavar="FILE", help="their data.json (template qwen2vl)")),
        ("--mm-tool", dict(default=None, metavar="FILE", help=BY_NAME["--mm-tool"].note + ": no effect here")),
        ("--variable-seq-lengths", dict(action="store_true", help="no effect here: "
                                        + BY_NAME["--variable-seq-lengths"].note)),
        ("--use-mcore-models", dict(action="store_true", help="no effect here: megatron-core's models only")),
    ]


def has_torch_npu() -> bool:
    return importlib.util.find_spec("torch_npu") is not None


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def given_without_effect(args) -> list[str]:
    """The no-effect arguments this command gives."""
    return [a.name for a in ARGUMENTS
            if a.kind == NO_EFFECT and getattr(args, _dest(a.name), None) not in (None, False)]


def translate(args) -> tuple[list[str], list[str]]:
    """(problems, notes): their device choice (--distributed-backend given) into MM_ADAPTOR_DEVICE, and a note per
    argument without effect here."""
    problems, notes = [], []
    if args.distributed_backend:
        device = BACKEND_DEVICES.get(args.distributed_backend)
        forced = os.environ.get("MM_ADAPTOR_DEVICE", "").strip().lower()
        if device is None:
            pass  # Megatron's other backends: its own validation speaks
        elif forced and forced != device:
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
