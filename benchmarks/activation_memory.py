"""Activation memory and step time of a transformer block sized like Llama-2-7B's layers (hidden 4096, ffn 11008,
32 heads, seq 4096, micro-batch 1, SwiGLU, RMSNorm, RoPE, no bias) on one rank: unpatched vs
--recompute-activation-function vs --swap-attention vs both, measured side by side in one run.

Per configuration: median step time (forward + backward) and the saved activations at the end of forward, per
residence (device / host), from mm_adaptor.memory's accountant; on CUDA also the step's peak allocated memory above
what was allocated before it; on the CPU the peak growth of the process's resident memory (sampled), where the
"host" copy is RAM too, so swap attention saves nothing physical.

    python benchmarks/activation_memory.py                      # the device torch sees (CUDA if any), bf16 on CUDA
    python benchmarks/activation_memory.py --device cpu --steps 2 --warmup 1
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time

import torch

from _common import device_name, init_single_rank, llama_like_driver_options

CONFIGS = {
    "unpatched": [],
    "recompute activation": ["--recompute-activation-function"],
    "swap attention": ["--swap-attention"],
    "both": ["--recompute-activation-function", "--swap-attention"],
}
FUSED = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--use-flash-attn"]


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
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of: {', '.join(CONFIGS)}")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("bfloat16" if args.device == "cuda" else "float32")
    unknown = set(args.configs.split(",")) - set(CONFIGS)
    if unknown:
        p.error(f"--configs: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CONFIGS)}")
    return args


def driver_args(args, flags):
    return llama_like_driver_options(args, *(["--bf16"] if args.dtype == "bfloat16" else []),
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


def measure(args, name, flags, device):
    import mm_adaptor
    from megatron.core import tensor_parallel
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_block import TransformerBlock

    from mm_adaptor.memory import SavedTensorAccountant
    from mm_adaptor.train.model import transformer_config

    options = driver_args(args, flags)
    mm_adaptor.enable(options)
    try:
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        config = transformer_config(options)
        block = TransformerBlock(config, get_gpt_layer_local_spec(normalization="RMSNorm"), post_process=False)
        block = block.to(device)
        rope = RotaryEmbedding(kv_channels=args.hidden // args.heads, rotary_percent=1.0)(args.seq).to(device)
        dtype = getattr(torch, args.dtype)
        x = torch.randn(args.seq, args.micro_batch, args.hidden, dtype=dtype, device=device, requires_grad=True)
        saved = {}
        model = torch.nn.Module()
        model.decoder = block  # what the accountant looks for: parameters and decoder.layers

        def step(account=False):
            accountant = SavedTensorAccountant([model]) if account else None
            with accountant.hooks() if accountant else torch.autograd.graph.saved_tensors_hooks(lambda t: t,
                                                                                                 lambda t: t):
                out = block(x, attention_mask=None, rotary_pos_emb=rope)
            if accountant:
                saved.update(device=sum(accountant.bytes_per_layer("device").values()),
                             host=sum(accountant.bytes_per_layer("host").values()))
                accountant.close()
            out.float().square().mean().backward()
            block.zero_grad(set_to_none=False)
            x.grad = None

        step(account=True)
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
                    saved_host=saved["host"], peak=peak)
    finally:
        mm_adaptor.disable()


def main(argv=None):
    args = parse_args(argv)
    from mm_adaptor import devices

    device = torch.device(args.device)
    devices.install("cpu" if device.type == "cpu" else None)
    import torch.distributed as dist
    from megatron.core import parallel_state

    init_single_rank("gloo" if device.type == "cpu" else "nccl")
    print(f"# {args.layers} layers, hidden {args.hidden}, ffn {args.ffn}, {args.heads} heads, seq {args.seq}, "
          f"micro-batch {args.micro_batch}, {args.dtype}, {'unfused' if args.unfused else 'fused kernels'}; "
          f"{device_name(args.device)}; median of {args.steps} steps after {args.warmup} warm-up", flush=True)
    rows = []
    for name in args.configs.split(","):
        rows.append(measure(args, name, CONFIGS[name], device))
        print(f"#   {name}: {rows[-1]['ms']:.0f} ms", file=sys.stderr, flush=True)
    base = rows[0]
    peak_label = "peak allocated in step" if device.type == "cuda" else "peak RSS growth in step"
    print(f"| configuration | step ms | vs {base['name']} | saved on device MiB | saved in host MiB | "
          f"{peak_label} MiB | vs {base['name']} |")
    print("|---|---|---|---|---|---|---|")
    mib = 2 ** 20
    for r in rows:
        print(f"| {r['name']} | {r['ms']:.1f} | {r['ms'] / base['ms']:.3f}x | {r['saved_device'] / mib:.1f} | "
              f"{r['saved_host'] / mib:.1f} | {r['peak'] / mib:.1f} | {(r['peak'] - base['peak']) / mib:+.1f} |")
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
