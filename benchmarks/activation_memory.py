"""Activation memory and step time of a transformer block sized like Llama-2-7B's layers (hidden 4096, ffn 11008,
32 heads, seq 4096, micro-batch 1, SwiGLU, RMSNorm, RoPE, no bias) on one rank: unpatched vs
--recompute-activation-function vs --swap-attention vs both, measured side by side in one run.

Per configuration: median step time (forward + backward) and the saved activations at the end of forward, per
residence (device / host), from mm_adaptor.devices.memory's accountant; on CUDA also the step's peak allocated
memory above what was allocated before it; on the CPU the peak growth of the process's resident memory (sampled),
where the "host" copy is RAM too, so swap attention saves nothing physical. For the swap configurations also which
layers swapped (swapped / layers: under the default --swap-select bandwidth the block's last layer never, the others
as the link timed in the first two steps allows; chosen from the third step, so the timed steps use the choice with
--warmup 2 or more) and the link's rate achieved by the timed copies out (GB/s; on the CPU a memcpy timed on the host
clock, not a link). "swap attention all" (--swap-select all: every layer, the last included) is opt-in (--configs).

    python benchmarks/activation_memory.py                      # the device torch sees (CUDA if any), bf16 on CUDA
    python benchmarks/activation_memory.py --device cpu --steps 2 --warmup 1
    python benchmarks/activation_memory.py --device cpu --seq 512 --native   # and megatron-core's own mechanisms

megatron-core's own mechanisms are opt-in (--native adds the NATIVE list; --configs takes any of these names):
"megatron-recompute-M[+M...]" builds the block with recompute_granularity="selective", recompute_modules=[M, ...];
"megatron-offload-M[+M...]" with fine_grained_activation_offloading=True, offload_modules=[M, ...] (driven as
GPTModel and the schedules drive it: a chunk handler before each forward, a reset after each backward; its saved
bytes are read after megatron's planning iteration, on the step after). No mm_adaptor feature is on in them besides
the fused kernels every row shares. A configuration megatron-core refuses, when the config is built or during the
step, prints one line saying so and where it was raised, and the run goes on.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import statistics
import sys
import threading
import time
import traceback
import weakref

import torch

from _common import device_name, init_single_rank, llama_like_driver_options, package_version

CONFIGS = {
    "unpatched": [],
    "recompute activation": ["--recompute-activation-function"],
    "swap attention": ["--swap-attention"],
    "both": ["--recompute-activation-function", "--swap-attention"],
}
# accepted by --configs, not run unless named
OPTIONAL_CONFIGS = {"swap attention all": ["--swap-attention", "--swap-select", "all"]}
# --experts N: MoE layers (EP1, the alltoall dispatcher) and these configurations by default
MOE_CONFIGS = {
    "unpatched": [],
    "recompute activation": ["--recompute-activation-function"],
    "moe-zero-memory level0": ["--moe-zero-memory", "level0"],
    "moe-zero-memory level1": ["--moe-zero-memory", "level1"],
}
MOE_NATIVE = ["megatron-recompute-moe_act", "megatron-recompute-moe"]
FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]
# megatron-core's own mechanisms, by TransformerConfig field (see the module docstring); module names joined by "+"
NATIVE_RECOMPUTE, NATIVE_OFFLOAD = "megatron-recompute-", "megatron-offload-"
NATIVE = ["megatron-recompute-mlp", "megatron-recompute-layernorm", "megatron-recompute-core_attn",
          "megatron-recompute-moe_act", "megatron-offload-core_attn",
          "megatron-offload-attn_norm+qkv_linear+core_attn+attn_proj+mlp_norm"]


def native_fields(name: str) -> dict:
    """The TransformerConfig fields of a megatron-recompute-/megatron-offload- configuration ({} for ours)."""
    for prefix, fields in ((NATIVE_RECOMPUTE, lambda m: dict(recompute_granularity="selective", recompute_modules=m)),
                           (NATIVE_OFFLOAD, lambda m: dict(fine_grained_activation_offloading=True,
                                                           offload_modules=m))):
        if name.startswith(prefix):
            return fields([m for m in name[len(prefix):].split("+") if m])
    return {}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--layers", type=int, default=2, help="layers in the block (swap needs 2 to prefetch ahead)")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--ffn", type=int, default=11008)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None, help="default: bf16 on CUDA, fp32 on CPU")
    p.add_argument("--unfused", action="store_true", help=f"Megatron's own kernels instead of {' '.join(FUSED)}")
    p.add_argument("--steps", type=int, default=5, help="measured steps per configuration")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--experts", type=int, default=0,
                   help="MoE layers with this many experts of --ffn each (one rank: EP1, the alltoall dispatcher); "
                        f"the configurations are then {', '.join(MOE_CONFIGS)} (--native: {', '.join(MOE_NATIVE)})")
    p.add_argument("--topk", type=int, default=2, help="experts per token, with --experts")
    p.add_argument("--configs", default=None,
                   help=f"comma-separated subset of: {', '.join(CONFIGS)} ({', '.join(MOE_CONFIGS)} with --experts); "
                        f"opt-in: {', '.join(OPTIONAL_CONFIGS)}; "
                        f"or megatron-core's own: "
                        f"{NATIVE_RECOMPUTE}M[+M...] (recompute_modules), {NATIVE_OFFLOAD}M[+M...] (offload_modules)")
    p.add_argument("--native", action="store_true",
                   help=f"append megatron-core's own recompute and offloading to --configs: {', '.join(NATIVE)}")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    known = MOE_CONFIGS if args.experts else CONFIGS
    names = (args.configs or ",".join(known)).split(",")
    known = known if args.experts else {**CONFIGS, **OPTIONAL_CONFIGS}
    if args.native:
        names += [n for n in (MOE_NATIVE if args.experts else NATIVE) if n not in names]
    unknown = {n for n in names if n not in known and not native_fields(n)}
    if unknown:
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(known)}, "
                f"{NATIVE_RECOMPUTE}M[+M...] or {NATIVE_OFFLOAD}M[+M...]")
    args.configs = ",".join(names)
    return args


def driver_args(args, flags):
    moe = (["--num-experts", str(args.experts), "--moe-router-topk", str(args.topk),
            "--moe-token-dispatcher-type", "alltoall"] if args.experts else [])
    return llama_like_driver_options(args, *(["--bf16"] if args.dtype == "bfloat16" else []), *moe,
                                     *([] if args.unfused else FUSED), *flags)


class ResidentPeak:
    """Peak growth of this process's resident memory while in the block (sampled every 2 ms)."""

    def __enter__(self):
        import psutil

        self.process = psutil.Process(os.getpid())
        self.start = self.peak = self.process.memory_info().rss
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self):
        while self.running:
            self.peak = max(self.peak, self.process.memory_info().rss)
            time.sleep(0.002)

    def __exit__(self, *exc):
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)
        self.growth = self.peak - self.start


def refusal(error: BaseException) -> str:
    """One line: what megatron-core raised and where (its innermost frame under megatron/)."""
    site = ""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        path = frame.filename.replace(os.sep, "/")
        if "/megatron/core/" in path:
            site = f" (megatron/core/{path.split('/megatron/core/', 1)[1]}:{frame.lineno})"
            break
    message = (str(error).strip().splitlines() or [""])[0]
    return f"{type(error).__name__}: {message}{site}"


class _Offloaded:
    """What the accountant sees of one tensor megatron's offload hooks packed (their saved_tensors_hooks shadow the
    accountant's): where it lives at the end of forward, read from megatron's group. part "host": the host copy
    once megatron copied it out; part "device": the device tensor while megatron keeps it, or after the copy while
    something else still holds it (the block's input, a released residual reads 0 bytes)."""

    def __init__(self, group, tag, tensor, part, param_storages):
        self.group, self.tag, self.part = group, tag, part
        self.tensor = weakref.ref(tensor)
        self.param = tensor.untyped_storage().data_ptr() in param_storages

    def memory_residence(self):
        held = self.group._tensors.get(self.tag)
        copied = isinstance(held, tuple)  # (device, host copy, pooled)
        if self.part == "host":
            if not copied:
                return "host", ("not copied", id(self)), 0
            storage = held[1].untyped_storage()
            return "host", (storage.data_ptr(), storage.nbytes()), storage.nbytes()
        tensor = held if isinstance(held, torch.Tensor) else self.tensor()
        if tensor is None or self.param:
            return "device", ("gone", id(self)), 0
        storage = tensor.untyped_storage()
        return "device", (storage.data_ptr(), storage.nbytes()), storage.nbytes()


class NativeOffload:
    """megatron-core's fine-grained activation offloading around a bare TransformerBlock, driven as GPTModel's
    forward (a chunk handler per micro-batch, parameters marked not to offload) and the schedules (a reset after
    backward) drive it; every tensor its hooks pack is reported to the accountant."""

    def __init__(self, config, block):
        from megatron.core.pipeline_parallel import fine_grained_activation_offload as offload

        self.offload, self.config = offload, config
        offload.PipelineOffloadManager.OFFLOAD_MGR = None  # a fresh singleton per configuration
        manager = offload.PipelineOffloadManager.get_instance()
        interface = offload.FineGrainedActivationOffloadingInterface
        mark = getattr(interface, "mark_not_offload", None) or interface.mark_not_offloadable  # 0.19 / 0.16
        for p in block.parameters():
            mark(p)
        param_storages = {p.untyped_storage().data_ptr() for p in block.parameters()}
        pack = manager.on_save_for_backward

        def on_save_for_backward(tensor):
            from mm_adaptor.devices.memory import notify_saved

            packed = pack(tensor)
            if isinstance(packed, tuple):
                group = manager.cur_forward_chunk().offload_groups[packed[0] - 1]
                for part in ("device", "host"):
                    notify_saved(_Offloaded(group, packed, tensor, part, param_storages))
            else:  # passed through untouched (0.19: parameters, tensors not on a 'cuda' device)
                notify_saved(packed)
            return packed

        manager.on_save_for_backward = on_save_for_backward  # 0.16 pushes the bound method at each __enter__
        if hasattr(manager, "_saved_tensors_hooks"):  # 0.19 builds its hooks once
            manager._saved_tensors_hooks = torch.autograd.graph.saved_tensors_hooks(
                on_save_for_backward, manager.on_get_saved_tensor)

    def start(self):
        """GPTModel.preprocess_for_fine_grained_offloading: a chunk handler for this micro-batch."""
        c = self.config
        known = dict(pp_rank=0, vp_size=c.virtual_pipeline_model_parallel_size, vp_stage=None,
                     min_offloaded_tensor_size=c.min_offloaded_tensor_size,
                     delta_offload_bytes_across_pp_ranks=getattr(c, "delta_offload_bytes_across_pp_ranks", 0),
                     activation_offload_fraction=getattr(c, "activation_offload_fraction", 1.0),
                     max_inflight_offloads=getattr(c, "fine_grained_offloading_max_inflight_offloads", None))
        init = self.offload.FineGrainedActivationOffloadingInterface.init_chunk_handler
        init(**{k: v for k, v in known.items() if k in inspect.signature(init).parameters})

    def finish(self):
        """The schedules' off_interface.reset() after forward-backward (its first one prints megatron's summary
        table: to stderr, away from this script's table)."""
        with contextlib.redirect_stdout(sys.stderr):
            self.offload.FineGrainedActivationOffloadingInterface.reset()

    def close(self):
        self.offload.PipelineOffloadManager.OFFLOAD_MGR = None


def measure(args, name, flags, device):
    import mm_adaptor
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mm_adaptor.devices.memory import SavedTensorAccountant
    from mm_adaptor.harness.runner.model import transformer_config

    native = native_fields(name)
    options = driver_args(args, flags)
    mm_adaptor.enable(options)
    offload = None
    try:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = transformer_config(options)
        try:
            if native:
                # megatron-core validates the fields itself (__post_init__ runs again)
                config = dataclasses.replace(config, **native)
            spec = get_gpt_layer_local_spec(num_experts=args.experts or None, normalization="RMSNorm")
            block = TransformerBlock(config, spec, post_process=False)
            block = block.to(device)
            if getattr(config, "fine_grained_activation_offloading", False):
                offload = NativeOffload(config, block)
        except Exception as error:
            if not native:
                raise
            return dict(name=name, refused=refusal(error))
        rope = RotaryEmbedding(kv_channels=args.hidden // args.heads, rotary_percent=1.0)(args.seq).to(device)
        dtype = getattr(torch, args.dtype)
        x = torch.randn(args.seq, args.micro_batch, args.hidden, dtype=dtype, device=device, requires_grad=True)
        saved = {}
        model = torch.nn.Module()
        model.decoder = block  # what the accountant looks for: parameters and decoder.layers

        def step(account=False):
            accountant = SavedTensorAccountant([model]) if account else None
            if offload:
                offload.start()
            try:
                with accountant.hooks() if accountant else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                     lambda t: t):
                    # megatron's attn_norm offload frees the first layer's input outright (resize to 0, as its
                    # forced_released_tensors): give it a copy of x, as GPTModel gives it a fresh embedding
                    out = block(x.clone() if offload else x, attention_mask=None, rotary_pos_emb=rope)
                if accountant:
                    saved.update(device=sum(accountant.bytes_per_layer("device").values()),
                                 host=sum(accountant.bytes_per_layer("host").values()))
            finally:
                if accountant:
                    accountant.close()
            out.float().square().mean().backward()
            block.zero_grad(set_to_none=False)
            x.grad = None
            if offload:
                offload.finish()

        try:
            if offload:
                step()  # megatron's offload manager plans its groups in its first iteration (all offloaded)
            step(account=True)
        except Exception as error:
            if not native:
                raise
            return dict(name=name, refused=refusal(error))
        for _ in range(args.warmup - 1):
            step()
        times, peak = [], None
        for _ in range(args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                before = torch.cuda.memory_allocated()
                start = time.perf_counter()
                step()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                peak = max(peak or 0, torch.cuda.max_memory_allocated() - before)
            else:
                with ResidentPeak() as resident:
                    start = time.perf_counter()
                    step()
                    times.append(time.perf_counter() - start)
                peak = max(peak or 0, resident.growth)
        return dict(name=name, ms=statistics.median(times) * 1e3, saved_device=saved["device"],
                    saved_host=saved["host"], peak=peak, swap=swap_selection())
    finally:
        if offload:
            offload.close()
        mm_adaptor.disable()


def swap_selection() -> str:
    """"swapped/layers at G GB/s" from --swap-attention's statistics ("-" when it is off)."""
    from mm_adaptor.api import feature_statistics

    stats = feature_statistics().get("swap-attention")
    if not stats:
        return "-"
    rate = stats.get("link_gb_per_s")
    pending = " (still measuring)" if stats.get("selection_pending") else ""
    return (f"{stats['layers_swapped']}/{stats['layers']} {stats['select']}{pending} at "
            f"{'?' if rate is None else f'{rate:.2f}'} GB/s")


def main(argv=None):
    args = parse_args(argv)
    from mm_adaptor import devices

    device = torch.device(args.device)
    devices.install("cpu" if device.type == "cpu" else None)
    import torch.distributed as dist
    from megatron.core import parallel_state

    init_single_rank("gloo" if device.type == "cpu" else "nccl")
    experts = f"{args.experts} experts of ffn {args.ffn}, top-{args.topk}" if args.experts else f"ffn {args.ffn}"
    print(f"# {args.layers} layers, hidden {args.hidden}, {experts}, {args.heads} heads, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.dtype}, {'unfused' if args.unfused else 'fused kernels'}; "
          f"{device_name(args.device)}; median of {args.steps} steps after {args.warmup} warm-up", flush=True)
    rows, refused = [], []
    for name in args.configs.split(","):
        row = measure(args, name, (MOE_CONFIGS if args.experts else {**CONFIGS, **OPTIONAL_CONFIGS}).get(name, []),
                      device)
        if "refused" in row:
            refused.append(row)
            print(f"#   {name}: refused: {row['refused']}", file=sys.stderr, flush=True)
            continue
        rows.append(row)
        print(f"#   {name}: {rows[-1]['ms']:.0f} ms", file=sys.stderr, flush=True)
    base = rows[0] if rows else None
    if base is not None:
        peak_label = "peak allocated in step" if device.type == "cuda" else "peak RSS growth in step"
        print(f"| configuration | step ms | vs {base['name']} | saved on device MiB | saved in host MiB | "
              f"{peak_label} MiB | vs {base['name']} | swapped layers, link |")
        print("|---|---|---|---|---|---|---|---|")
        mib = 2 ** 20
        for r in rows:
            print(f"| {r['name']} | {r['ms']:.1f} | {r['ms'] / base['ms']:.3f}x | {r['saved_device'] / mib:.1f} | "
                  f"{r['saved_host'] / mib:.1f} | {r['peak'] / mib:.1f} | {(r['peak'] - base['peak']) / mib:+.1f} | "
                  f"{r['swap']} |")
    for row in refused:
        print(f"# {row['name']}: refused by megatron-core {package_version('megatron-core')}: {row['refused']}")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
