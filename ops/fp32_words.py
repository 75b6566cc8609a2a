"""split_fp32_words / join_fp32_words: an fp32 word kept as a bf16 high half (the model's own value, any value)
plus an int16 residual, for --reuse-fp32-param.

split: residual = word - (high << 16), computed exactly; where that does not fit int16 (a tie rounded down to
even, a NaN, or a high half that is not the word's rounding) the residual is clamped and the word kept whole in an
exception list. The op never reads anything back to the host: it writes at most `capacity` exceptions (positions
and words) into fixed-size buffers and their true number into a one-element device counter. split_fp32_words_many
splits a list of tensors and reads all their counters to the host at once (counts_to_host: one synchronisation per
list, not per tensor), trims each list to its count and sorts it, and splits again the rare tensor whose
exceptions overflowed its buffer. join writes high << 16 + residual, then the kept words at `index`. Native
kernels: csrc/cpu/fp32_words.cpp, csrc/cuda/fp32_words.cu (one fused pass each way; the reference below needs
int64 temporaries and several passes).

The multi-tensor forms serve --reuse-fp32-param's step, one call per batch of parameters whatever their number:
round_split_fp32_words (round_split_many) rounds each fp32 word to the bf16 model value exactly as megatron's
copy does (nearest, ties to even), writes it, and splits the word against it in the same pass, into persistent
residual and exception buffers of each tensor and a per-tensor device counter; join_fp32_words_multi (join_many)
restores a batch from them. Neither reads anything back to the host: the caller reads the counters when the
device has written them and splits again a tensor whose exceptions outnumbered its buffer (its words are still
whole then)."""

from __future__ import annotations

import torch

from mm_adaptor.ops.library import OpSpec, ensure, op, register

SLICE = 1 << 22  # elements per reference pass: bounds its int64 temporaries to 32 MiB each
INT16_MIN, INT16_MAX = -(1 << 15), (1 << 15) - 1


def _check(main, model):
    if main.dtype != torch.float32 or model.dtype != torch.bfloat16 or main.numel() != model.numel():
        raise ValueError(f"split_fp32_words needs fp32 words and bf16 high halves of the same size, got "
                         f"{main.dtype}[{main.numel()}] and {model.dtype}[{model.numel()}]")


def exception_capacity(numel: int) -> int:
    """Room for exceptions in a first split: rounded model values give about one per 131072 words (ties rounded
    down to even); a tensor with more is split again."""
    return 64 + numel // 1024


def reference_split(main, model, capacity):
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
    found = torch.cat(indices) if indices else torch.empty(0, dtype=torch.int64, device=main.device)
    listed = found[:capacity]
    index = torch.full((capacity,), -1, dtype=torch.int64, device=main.device)
    kept = torch.zeros(capacity, dtype=torch.int32, device=main.device)
    index[:listed.numel()] = listed
    kept[:listed.numel()] = words[listed]
    count = torch.full((1,), found.numel(), dtype=torch.int64, device=main.device)
    return residual, index, kept, count


def reference_join(model, residual, index, kept, out):
    words, high_halves = out.view(-1).view(torch.int32), model.reshape(-1).view(torch.int16)
    for start in range(0, words.numel(), SLICE):
        end = min(start + SLICE, words.numel())
        joined = high_halves[start:end].to(torch.int64) * 65536 + residual[start:end]
        words[start:end] = joined.clamp_(-(1 << 31), (1 << 31) - 1)  # the kept words overwrite these below
    if index.numel():
        words[index] = kept


def fake_split(main, model, capacity):
    return (main.new_empty(main.numel(), dtype=torch.int16), main.new_empty(capacity, dtype=torch.int64),
            main.new_empty(capacity, dtype=torch.int32), main.new_empty(1, dtype=torch.int64))


def fake_join(model, residual, index, kept, out):
    return None


def reference_round_split(mains, models, residuals, indices, kept, counts, round_model):
    for t, (main, model, residual, index, words) in enumerate(zip(mains, models, residuals, indices, kept)):
        if round_model:
            model.copy_(main.view(model.shape))  # megatron's copy on this device
        parts = reference_split(main, model, index.numel())
        for out, part in zip((residual, index, words, counts[t:t + 1]), parts):
            out.copy_(part)


def reference_join_multi(models, residuals, indices, kept, counts, outs):
    for model, residual, index, words, count, out in zip(models, residuals, indices, kept, counts, outs):
        listed = min(int(count), index.numel())  # the reference reads each counter (the native kernels do not)
        reference_join(model, residual, index[:listed], words[:listed], out)


def fake_round_split(mains, models, residuals, indices, kept, counts, round_model):
    return None


def fake_join_multi(models, residuals, indices, kept, counts, outs):
    return None


SPECS = register(
    OpSpec("split_fp32_words", "(Tensor main, Tensor model, int capacity) -> (Tensor, Tensor, Tensor, Tensor)",
           reference_split, fake_split,
           native=("cpu", "cuda")),
    OpSpec("join_fp32_words", "(Tensor model, Tensor residual, Tensor index, Tensor kept, Tensor(a!) out) -> ()",
           reference_join, fake_join, native=("cpu", "cuda")),
    OpSpec("round_split_fp32_words",
           "(Tensor[] mains, Tensor(a!)[] models, Tensor(b!)[] residuals, Tensor(c!)[] indices, Tensor(d!)[] kept, "
           "Tensor(e!) counts, bool round_model) -> ()",
           reference_round_split, fake_round_split, native=("cpu", "cuda")),
    OpSpec("join_fp32_words_multi",
           "(Tensor[] models, Tensor[] residuals, Tensor[] indices, Tensor[] kept, Tensor[] counts, "
           "Tensor(a!)[] outs) -> ()",
           reference_join_multi, fake_join_multi, native=("cpu", "cuda")),
)


def split_fp32_words(main: torch.Tensor, model: torch.Tensor):
    """(residual int16, exception indices int64 ascending, exception words int32) from which join_fp32_words
    restores `main` bit for bit. main: contiguous fp32; model: bf16 of the same numel (any values). One host
    synchronisation: split many tensors with split_fp32_words_many."""
    return split_fp32_words_many([(main, model)])[0]


def split_fp32_words_many(pairs) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """split_fp32_words of each (main, model), reading the exception counts to the host once for the whole list."""
    bounded = []
    for main, model in pairs:
        _check(main, model)
        ensure(main.device.type)
        bounded.append(op("split_fp32_words")(main.reshape(-1), model.reshape(-1), exception_capacity(main.numel())))
    counts = counts_to_host([count for *_, count in bounded])
    splits = []
    for (main, model), (residual, index, kept, _), count in zip(pairs, bounded, counts):
        if count > index.numel():  # more exceptions than room: split again with room for all of them
            residual, index, kept, _ = op("split_fp32_words")(main.reshape(-1), model.reshape(-1), count)
        index, order = index[:count].sort()  # ascending on every device (a CUDA kernel lists them in any order)
        splits.append((residual, index, kept[:count][order]))
    return splits


def counts_to_host(counts: list[torch.Tensor]) -> list[int]:
    """The one place a split waits for the device: every counter of a batch read back together."""
    return torch.cat(counts).tolist() if counts else []


def join_fp32_words(out: torch.Tensor, model: torch.Tensor, residual, index, kept) -> None:
    """Write the fp32 words split_fp32_words split into `out` (contiguous fp32, numel of model)."""
    if not out.is_contiguous() or out.dtype != torch.float32:
        raise ValueError(f"join_fp32_words writes a contiguous fp32 tensor, got {out.dtype} "
                         f"{'contiguous' if out.is_contiguous() else 'strided'}")
    ensure(out.device.type)
    op("join_fp32_words")(model.reshape(-1), residual, index, kept, out.view(-1))


def round_split_many(mains, models, residuals, indices, kept, counts: torch.Tensor, round_model: bool) -> None:
    """One native call for a batch: for each tensor t (all flat and contiguous), with round_model write
    models[t] = mains[t] rounded to bf16 as megatron's copy does, then split mains[t] against models[t] into
    residuals[t] (int16, numel), the first indices[t].numel() exceptions (positions int64, words int32; in any
    order) and counts[t] (int64, one per tensor: every exception, listed or not). Nothing is read back."""
    if not mains:
        return
    for main, model in zip(mains, models):
        _check(main, model)
    ensure(mains[0].device.type)
    op("round_split_fp32_words")(list(mains), list(models), list(residuals), list(indices), list(kept), counts,
                                 round_model)


def join_many(outs, models, residuals, indices, kept, counts) -> None:
    """One native call for a batch: outs[t] (flat contiguous fp32) = the words round_split_many split, from the first
    min(counts[t], capacity) listed exceptions (counts: one-element int64 tensors on the device)."""
    if not outs:
        return
    ensure(outs[0].device.type)
    op("join_fp32_words_multi")(list(models), list(residuals), list(indices), list(kept), list(counts), list(outs))
