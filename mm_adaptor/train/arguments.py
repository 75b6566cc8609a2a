"""The trainer's command line: Megatron-LM's own parser (megatron.training.arguments) with the adaptor's feature
flags and the trainer's arguments added through `extra_args_provider`, one-line errors and a --help that prints.

`prepare(args)` runs right after Megatron parses and before it validates (the trainer wraps Megatron's parse_args
with it): MindSpeed-MM's arguments are translated, a vision-language family sets the model's shape into Megatron's
model arguments, and the few defaults the trainer needs are filled in. Everything it refuses is one line."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

from mm_adaptor.core import features
from mm_adaptor.core.one_line_parser import ArgumentParser, count
from mm_adaptor.data import cli as data_cli
from mm_adaptor.mindspeed_mm import arguments as mindspeed_mm_arguments
from mm_adaptor.models import registry
from mm_adaptor.ranks.warning_digest import ShowEveryWarning
from mm_adaptor.convert.mcore_io import saved_arguments
from mm_adaptor.train import lora_arguments, vlm_data

PROG = "mm-adaptor train"
TRAINER_GROUP = "mm_adaptor trainer (not Megatron-LM's)"
LAUNCH_GROUP = "mm_adaptor trainer: local ranks without torchrun (not Megatron-LM's)"

# What prepare() says about the command (one line each; the ranks print them on rank 0). Not on Megatron's
# arguments: it prints them all in its table and pickles them into every checkpoint.
NOTES: list[str] = []
# Megatron defaults the trainer needs to see given or not: None here, filled in by prepare().
WATCHED_DEFAULTS = ("transformer_impl", "distributed_backend", "moe_aux_loss_coeff", "dataloader_type",
                    "make_vocab_size_divisible_by", "hidden_dropout", "attention_dropout", "moe_token_dispatcher_type",
                    "moe_router_load_balancing_type")
# Megatron's MoE arguments (and their parser defaults): refused, given to a model without experts
MOE_ARGUMENTS = {"moe_aux_loss_coeff": 0.0, "moe_token_dispatcher_type": "allgather", "moe_grouped_gemm": False,
                 "moe_router_load_balancing_type": "aux_loss", "moe_z_loss_coeff": None,
                 "moe_router_enable_expert_bias": False}


class UsageError(ValueError):
    """One line per problem with the command line, each naming the flag and the fix."""

    def __init__(self, *problems: str):
        super().__init__("\n".join(problems))
        self.problems = list(problems)

    def __reduce__(self):  # each problem its own line after a trip between processes too
        return type(self), tuple(self.problems)


class MegatronParser(ArgumentParser):
    """Megatron-LM's parser object, given the adaptor's one-line errors and a --help that formats every help text
    (megatron-core 0.19.2's own raises ValueError on an unescaped '%')."""

    @classmethod
    def adopt(cls, parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
        parser.__class__ = cls
        parser.prog, parser.also_valid, parser._parsing = PROG, [], False
        parser.help_hint = f"`{PROG} --help` lists every flag"
        return parser

    def format_help(self) -> str:
        for action in self._actions:
            if action.help:
                action.help = re.sub(r"%%|%\(\w+\)\w|%", lambda m: m.group(0) if len(m.group(0)) > 1 else "%%",
                                     action.help)
        return super().format_help()


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron's extra_args_provider: the feature flags, the trainer's arguments (those Megatron's parser does not
    have), MindSpeed-MM's; the defaults prepare() must see unset."""
    MegatronParser.adopt(parser)
    features.add_arguments(parser)
    backend = parser._option_string_actions.get("--distributed-backend")
    if backend is not None and backend.choices and "hccl" not in backend.choices:
        backend.choices = [*backend.choices, "hccl"]  # Ascend's, in MindSpeed(-MM)'s scripts
    existing = set(parser._option_string_actions)
    g = _Group(parser.add_argument_group(TRAINER_GROUP), existing)
    g.add("--model", choices=registry.model_choices(), default="gpt",
          help="gpt: the tiny GPT on mock data (a --load holding a converted checkpoint names its own family); NAME: "
               "the converted checkpoint in --load (its hf/config.json); NAME-tiny: a tiny randomly initialised model "
               "of that family on synthetic data. " + "; ".join(f"{s.name}: {s.summary}" for s in
                                                                registry.SPECS.values()))
    g.add("--hf-config", dest="hf_config_file", default=None, metavar="CONFIG_JSON",
          help="build the model randomly initialised from this Hugging Face config.json (its family, shapes and "
               "token ids; no --load)")
    g.add("--pipeline-layers", default=None,
          help="language layers per pipeline stage, e.g. 1,3 (MindSpeed-MM's --llm-pp-layers); default even")
    g.add("--freeze-vision", action="store_true",
          help="the vision encoder gets no gradient, gradient buffer or optimizer state (fine-tuning)")
    g.add("--freeze-language", action="store_true",
          help="the same for the language model (with --freeze-vision: train the projector only)")
    g.add("--encoder-dp-balance", action="store_true",
          help="spread the images of each micro-batch over the data-parallel ranks by patch count for the vision "
               "encoder, the embeddings returned to their samples' ranks (MindSpeed-MM's name)")
    g.add("--skip-bad-samples", nargs="?", type=count, const=True, default=False, metavar="N",
          help="train on the good records of the data and count the bad ones, instead of refusing them; while "
               "training, skip up to N samples that fail to load (default N: 100), each said in one line and "
               "counted on the iteration line; past N the run stops naming them")
    data_cli.add_preprocessing_arguments(g.add)
    g.add("--restart-data", action="store_true",
          help="on resuming (--load), read the data from its first sample instead of where the saved run stopped, "
               "e.g. after changing the data set (which is refused without it)")
    g.add("--data-cache", default=None, metavar="DIR",
          help="where the data's index is built once and found after (`mm-adaptor data prepare DATA DIR` builds "
               "it ahead); on several nodes, a shared directory (default: $MM_ADAPTOR_DATA_CACHE, else "
               "$XDG_CACHE_HOME/mm_adaptor/data-index)")
    g.add("--packing", action="store_true",
          help="pack each step's samples (per data-parallel rank) into micro-batches of at most --seq-length tokens, "
               "first-fit decreasing, attention kept within each sample; needs --micro-batch-size 1")
    g.add("--mock-lengths", choices=["full", "skewed"], default="full",
          help="the generated samples: all --seq-length tokens (full), or 1/16 of it to all of it, most short")
    g.add("--log-tps", action="store_true",
          help="tokens per sample, non-padding tokens per second and samples per second on the iteration line "
               "(MindSpeed-MM's flag)")
    g.add("--mfu-peak-tflops", type=float, default=None, metavar="TFLOPS",
          help="the device's peak dense TFLOP/s for --log-throughput's MFU (default: the table in "
               "mm_adaptor/devices/peak_flops.py for the device and precision)")
    g.add("--hybrid-layer-pattern", type=str, default=None, metavar="PATTERN",
          help="build megatron-core's HybridModel (0.18 and newer): one symbol per layer, '*' attention, '-' MLP, "
               "'E' MoE, '|' between pipeline segments")
    g.add("--verbose", action=ShowEveryWarning,
          help="print every library warning, the known-harmless ones included (by default they are counted)")
    launch = _Group(parser.add_argument_group(LAUNCH_GROUP), existing)
    launch.add("--nproc-per-node", type=int, default=None,
               help="local ranks to start (default: this node's GPUs or NPUs, 1 on the CPU); under torchrun, "
                    "torchrun's own")
    launch.add("--nnodes", type=int, default=1, help="nodes in the job (each runs this command)")
    launch.add("--node-rank", type=int, default=0, help="this node's rank, 0 to --nnodes - 1")
    launch.add("--master-addr", default=None, help="node 0's address (default 127.0.0.1 on one node)")
    launch.add("--master-port", type=int, default=None, help="node 0's port (default: a free one on one node)")
    lora_arguments.add_arguments(_Group(parser.add_argument_group(lora_arguments.GROUP), existing).add)
    mm = _Group(parser.add_argument_group(mindspeed_mm_arguments.GROUP), existing)
    for flag, kwargs in mindspeed_mm_arguments.trainer_arguments():
        mm.add(flag, **kwargs)
    parser.set_defaults(**{name: None for name in WATCHED_DEFAULTS})
    return parser


class _Group:
    """An argument group that leaves out a flag Megatron's parser already has (that flag is Megatron's own)."""

    def __init__(self, group, existing: set):
        self.group, self.existing = group, existing

    def add(self, flag: str, **kwargs):
        if flag not in self.existing:
            self.group.add_argument(flag, **kwargs)


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")


def prepare(args: argparse.Namespace) -> argparse.Namespace:
    """Right after Megatron's parse (before its validation): translate, shape the model, fill the defaults.
    Raises UsageError."""
    from mm_adaptor import mindspeed_mm
    from mm_adaptor.train import families, vlm

    if getattr(args, "mm_adaptor_prepared", False):
        return args
    try:
        NOTES[:] = mindspeed_mm.apply_to_trainer(args)  # first: --distributed-backend may choose the device
        vlm.read_hf_config(args)
        family = families.of(args)
    except ValueError as exc:
        raise UsageError(*str(exc).splitlines()) from None
    problems = _trainer_defaults(args) + family.problems_before_layout(args)
    problems += lora_arguments.problems(args, family, NOTES)
    NOTES.extend(_converted_load(args))
    if not problems:
        problems += family.shape_megatron_args(args)
    problems += _moe_problems(args)
    if not problems:
        from mm_adaptor import lora

        problems += lora.model_problems(args)
    missing = [f"--{name.replace('_', '-')}" for name in ("lr", "seq_length", "micro_batch_size")
               if getattr(args, name) is None]
    if missing and not problems:  # Megatron's asserts (or its optimizer, in every rank) would say it less plainly
        problems.append(f"{', '.join(missing)}: missing, and Megatron-LM has no default (the tiny presets have)")
    if problems:
        raise UsageError(*problems)
    args.mm_adaptor_prepared = True
    return args


def _trainer_defaults(args) -> list[str]:
    problems = []
    if args.transformer_impl is None:
        args.transformer_impl = "local"
    elif args.transformer_impl != "local":
        problems.append(f"--transformer-impl {args.transformer_impl}: the trainer builds megatron-core's local spec, "
                        "which the adaptor's features patch: drop it (or give local)")
    if args.dataloader_type is None:
        args.dataloader_type = "external"
    elif args.dataloader_type != "external":
        problems.append(f"--dataloader-type {args.dataloader_type}: the trainer's data sets bring their own loaders "
                        "and sampling (exact resume from the checkpoint's consumed samples): drop it")
    if args.distributed_backend is None:
        from mm_adaptor import devices

        args.distributed_backend = devices.current_or_chosen().dist_backend
    args.exit_signal_handler = True  # SIGTERM saves a checkpoint (with --save) and exits 0
    if args.eval_interval is None:
        # Megatron's meaning, no evaluation during training (only after it), which megatron-core 0.19's loop
        # computes by dividing by this value: one beyond any iteration
        args.eval_interval = 2**62
    if args.tokenizer_type is None:
        args.tokenizer_type = "NullTokenizer"
    return problems


def _moe_problems(args) -> list[str]:
    """MoE arguments given to a model without experts are refused; the unset ones get Megatron's defaults (the
    aux-loss coefficient: the checkpoint's router_aux_loss_coef where the family read one)."""
    given = [name for name, default in MOE_ARGUMENTS.items() if getattr(args, name) not in (None, default)]
    for name, default in MOE_ARGUMENTS.items():
        if getattr(args, name) is None:
            setattr(args, name, default)
    if args.num_experts and args.moe_grouped_gemm and not getattr(args, "use_fused_gmm", False) \
            and not _grouped_gemm_kernels():
        return ["--moe-grouped-gemm needs Transformer Engine or the grouped_gemm package, neither installed here: "
                "add --use-fused-gmm (the adaptor's grouped GEMM serves it)"]
    if args.num_experts or not given:
        return []
    return [f"{', '.join(_flag(name) for name in given)}: the model has no experts (no --num-experts, and its "
            "checkpoint has none): drop them"]


def _grouped_gemm_kernels() -> bool:
    import importlib.util

    return any(importlib.util.find_spec(name) is not None for name in ("transformer_engine", "grouped_gemm"))


def _converted_load(args) -> list[str]:
    """A --load written by `mm-adaptor convert hf-to-mcore` holds the model's weights alone: it starts the run as
    Megatron's --finetune (weights loaded, iteration 0, a new optimizer). The note to print."""
    from mm_adaptor.convert.mcore_io import INFO

    if not args.load or not (Path(args.load) / INFO).is_file() or args.finetune:
        return []
    args.finetune = True
    return [f"--load {args.load} is a converted checkpoint (weights only): it starts the run as --finetune does "
            "(iteration 0, a new optimizer)"]


def resume_problems(args) -> list[str]:
    """What Megatron's load cannot take from --load's save (one line): a MoE run's optimizer state across expert
    parallelism 1 and above, where Megatron builds one optimizer on one side and one per parameter kind on the
    other (its load raises); LoRA adapters under other targets, rank or alpha (the last would load and silently
    scale them otherwise)."""
    problems = lora_arguments.resume_problems(args)
    if problems or not args.load or args.finetune or args.no_load_optim or not args.num_experts:
        return problems
    saved = saved_arguments(args.load)
    if saved is None or not getattr(saved, "num_experts", None):
        return []
    before, now = saved.expert_model_parallel_size, args.expert_model_parallel_size
    if (before == 1) == (now == 1):
        return []
    return [f"--load {args.load} was saved at --expert-model-parallel-size {before}, --expert-model-parallel-size "
            f"{now} now: Megatron keeps the optimizer state of expert parallelism 1 and above in different shapes "
            "(one optimizer, or one for experts beside one for the rest) and cannot load one into the other: resume "
            f"at {'1' if before == 1 else 'an expert parallelism above 1'}, or add --no-load-optim"]


def data_resume_problems(args) -> list[str]:
    """A resumed run reads the data where the saved run stopped: its data and settings must be those the save was
    trained on (their index keys, vlm_data.fingerprint), unless --restart-data starts the data's stream anew at the
    saved iteration (args.data_first_sample: the consumed samples where the stream began, saved with the run)."""


    args.data_fingerprint = vlm_data.fingerprint(getattr(args, "validated_data", None))
    args.data_first_sample = 0
    if not args.load or args.finetune:
        return []
    saved = saved_arguments(args.load)
    before = getattr(saved, "data_fingerprint", None)
    if saved is None or before is None or args.data_fingerprint is None:
        return []
    if getattr(args, "restart_data", False):
        args.data_first_sample = int(getattr(saved, "consumed_train_samples", 0) or 0)
    elif before == args.data_fingerprint:
        args.data_first_sample = int(getattr(saved, "data_first_sample", 0) or 0)
    else:
        return [f"--load {args.load} was trained on other data or data settings (index {before}, now "
                f"{args.data_fingerprint}): its next samples are not this data's; give the data, --seq-length and "
                "tokenizer it was trained with, or --restart-data to read this data from its first sample"]
    return []


def path_problems(args) -> list[str]:
    """--save must be writable (it is created); --load is Megatron's to read (a missing one starts afresh)."""
    if not args.save:
        return []
    path = Path(args.save)
    if path.exists() and not path.is_dir():
        return [f"--save {args.save} is a file, not a directory: give a directory"]
    probe = path / f".mm-adaptor-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        return [f"--save {args.save} cannot be written ({exc.strerror or exc}): give a writable directory"]
    return []


def launch_problems(args, under_torchrun: bool) -> list[str]:
    problems = []
    if under_torchrun:
        given = [flag for flag, dest in (("--nproc-per-node", "nproc_per_node"), ("--master-addr", "master_addr"),
                                         ("--master-port", "master_port"))
                 if getattr(args, dest) is not None]
        given += ["--nnodes"] if args.nnodes != 1 else []
        given += ["--node-rank"] if args.node_rank != 0 else []
        if given:
            problems.append(f"{', '.join(given)}: under torchrun the ranks and nodes are torchrun's: give them to "
                            "torchrun, not to the trainer")
        return problems
    if args.nproc_per_node is not None and args.nproc_per_node < 1:
        problems.append(f"--nproc-per-node {args.nproc_per_node}: must be at least 1")
    if args.nnodes < 1:
        problems.append(f"--nnodes {args.nnodes}: must be at least 1")
    elif not 0 <= args.node_rank < args.nnodes:
        problems.append(f"--node-rank {args.node_rank}: must be 0 to --nnodes - 1 ({args.nnodes - 1})")
    if args.nnodes > 1 and (args.master_addr is None or args.master_port is None):
        problems.append(f"--nnodes {args.nnodes} needs --master-addr and --master-port: node 0's address and a free "
                        "port there, the same on every node (or start each node with torchrun)")
    return problems


def local_ranks(args) -> int:
    """--nproc-per-node, or this node's accelerators (1 on the CPU)."""
    if args.nproc_per_node is not None:
        return args.nproc_per_node
    from mm_adaptor import devices

    return devices.current_or_chosen().devices_per_node() or 1


def environment_world_size() -> int | None:
    value = os.environ.get("WORLD_SIZE")
    return int(value) if value else None
