"""split_fp32_words / join_fp32_words: an fp32 word kept as a bf16 high half (the model's own value, any value)
plus an int16 residual, for --reuse-fp32-param.

split: residual = word - (high << 16), computed exactly; where that does not fit int16 (a tie rounded down to
even, a NaN, or a high half that is not the word's rounding) the residual is clamped and the position listed in
`index` (ascending), so the caller keeps those words whole. join writes high << 16 + residual, then the kept
words at `index`. Native kernels: csrc/cpu/fp32_words.cpp, csrc/cuda/fp32_words.cu (one fused pass each way;
the reference below needs int64 temporaries and several passes)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, ensure, op, register

SLICE = 1 << 22  # elements per reference pass: bounds its int64 temporaries to 32 MiB each
INT16_MIN, INT16_MAX = -(1 << 15), (1 << 15) - 1


def _check(main, model):
    if main.dtype != torch.float32 or model.dtype != torch.bfloat16 or main.numel() != model.numel():
        raise ValueError(f"split_fp32_words needs fp32 words and bf16 high halves of the same size, got "
                         f"{main.dtype}[{main.numel()}] and {model.dtype}[{model.numel()}]")


def reference_split(main, model):
    _check(main, model)
    words, high_halves = main.reshape(-1).view(torch.int32), model.reshape(-1).view(torch.int16)
    residual = torch.empty(words.numel(), dtype=torch.int16, device=main.device)
    indices = []
    for start in range(0, words.numel(), SLICE):
        end = min(start + SLICE, words.numel())
        diff = words[start:end].to(torch.int64) - high_halves[start:end].to(torch.int64) * 65536
        outside = ((diff < INT16_MIN) | (diff > INT16_MAX)).nonzero().view(-1)
        if outside.numel():
            indices.append(outside + start)
        residual[start:end] = diff.clamp_(INT16_MIN, INT16_MAX)
    index = torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64, device=main.device)
    return residual, index


def reference_join(model, residual, index, kept, out):
    words, high_halves = out.view(-1).view(torch.int32), model.reshape(-1).view(torch.int16)
    for start in range(0, words.numel(), SLICE):
        end = min(start + SLICE, words.numel())
        joined = high_halves[start:end].to(torch.int64) * 65536 + residual[start:end]
        words[start:end] = joined.clamp_(-(1 << 31), (1 << 31) - 1)  # the kept words overwrite these below
    if index.numel():
        words[index] = kept


def fake_split(main, model):
    exceptions = torch.library.get_ctx().new_dynamic_size()
    return main.new_empty(main.numel(), dtype=torch.int16), main.new_empty(exceptions, dtype=torch.int64)


def fake_join(model, residual, index, kept, out):
    return None


SPECS = register(
    OpSpec("split_fp32_words", "(Tensor main, Tensor model) -> (Tensor, Tensor)", reference_split, fake_split,
           native=("cpu", "cuda")),
    OpSpec("join_fp32_words", "(Tensor model, Tensor residual, Tensor index, Tensor kept, Tensor(a!) out) -> ()",
           reference_join, fake_join, native=("cpu", "cuda")),
)


def split_fp32_words(main: torch.Tensor, model: torch.Tensor):
    """(residual int16, exception indices int64, exception words int32) from which join_fp32_words restores
    `main` bit for bit. main: contiguous fp32; model: bf16 of the same numel (any values)."""
    _check(main, model)
    ensure(main.device.type)
    residual, index = op("split_fp32_words")(main.reshape(-1), model.reshape(-1))
    return residual, index, main.reshape(-1).view(torch.int32)[index]


def join_fp32_words(out: torch.Tensor, model: torch.Tensor, residual, index, kept) -> None:
    """Write the fp32 words split_fp32_words split into `out` (contiguous fp32, numel of model)."""
    if not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"join_fp32_words writes a contiguous fp32 tensor, got {out.dtype} "
                         f"{'contiguous' if out.is_contiguous() else 'strided'}")
    ensure(out.device.type)
    op("join_fp32_words")(model.reshape(-1), residual, index, kept, out.view(-1))
