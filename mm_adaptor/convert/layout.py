"""The parallel layout a checkpoint is prepared and validated for: TP, EP, and per pipeline stage the number of
language and vision layers (MindSpeed-MM's `[[12,16]]`, one inner list per virtual chunk, or a plain `12,16`).

A dist checkpoint stores whole tensors (each layer a chunk of its stack, each expert a chunk under its global
number) and megatron reshards it on load, so the layout is what the conversion checked the model against (heads
divisible by TP, experts by EP, layer splits that add up, the vision tower on the first stage) and what it records;
the same files load under another layout that megatron accepts."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from mm_adaptor.convert import ConvertError


def parse_layers(text: str | None, flag: str) -> list[list[int]] | None:
    """`[[12,16]]` or `[[6,8],[6,8]]` (virtual chunks) or `12,16` -> a list of chunks, each a list per stage."""
    if text is None:
        return None
    text = text.strip()
    try:
        value = json.loads(text if text.startswith("[") else f"[[{text}]]")
    except json.JSONDecodeError:
        raise ConvertError(f"{flag} {text!r}: expected [[12,16]] or 12,16") from None
    if value and all(isinstance(v, int) for v in value):
        value = [value]
    if (not value or not all(isinstance(chunk, list) and chunk for chunk in value)
            or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for chunk in value for n in chunk)):
        raise ConvertError(f"{flag} {text!r}: expected non-negative layer counts, e.g. [[12,16]] or 12,16")
    if len({len(chunk) for chunk in value}) != 1:
        raise ConvertError(f"{flag} {text!r}: every virtual chunk needs one count per pipeline stage")
    return value


@dataclass
class Layout:
    tp: int
    llm_pp_layers: list[list[int]]
    vit_pp_layers: list[list[int]]
    ep: int = 1
    moe_tp_extend_ep: bool = False  # the experts spread over TP x EP ranks whole (expert TP 1, EP tp x ep)

    @property
    def pp(self) -> int:
        return len(self.llm_pp_layers[0])

    def to_dict(self) -> dict:
        recorded = {**asdict(self), "pp": self.pp}
        if self.moe_tp_extend_ep:  # what megatron builds: expert tensor parallelism 1, expert parallelism tp x ep
            recorded.update(expert_tensor_parallel_size=1, expert_model_parallel_size=self.tp * self.ep)
        else:
            recorded.pop("moe_tp_extend_ep")
        return recorded


def validate(dims: dict, tp: int, llm: list[list[int]] | None, vit: list[list[int]] | None, ep: int = 1,
             experts: int = 0, moe_tp_extend_ep: bool = False) -> Layout:
    """Refuses (ConvertError, one line) a layout the model cannot take; `dims` as mapping.dims gives them, `experts`
    the experts per MoE layer (0: a dense model); moe_tp_extend_ep: the training's --moe-tp-extend-ep (whole experts
    over TP x EP ranks; the files are the same, each expert under its global number)."""
    if moe_tp_extend_ep:
        if not experts:
            raise ConvertError("--moe-tp-extend-ep spreads experts over the tensor-parallel ranks: the model has none")
        if tp < 2:
            raise ConvertError(f"--moe-tp-extend-ep with --tensor-model-parallel-size {tp}: nothing to extend (give "
                               "the training's TP, 2 or more)")
        if tp >= 1 and ep >= 1 and experts % (tp * ep):
            raise ConvertError(f"--moe-tp-extend-ep: the model's {experts} experts do not divide over "
                               f"--tensor-model-parallel-size {tp} x --expert-model-parallel-size {ep} = {tp * ep} "
                               "ranks")
    if tp < 1:
        raise ConvertError(f"--tensor-model-parallel-size {tp}: must be at least 1")
    if ep < 1:
        raise ConvertError(f"--expert-model-parallel-size {ep}: must be at least 1")
    if ep > 1 and not experts:
        raise ConvertError(f"--expert-model-parallel-size {ep}: the model has no experts")
    if experts % ep:
        raise ConvertError(f"--expert-model-parallel-size {ep} does not divide the model's {experts} experts")
    for tower in ("llm", "vit"):
        heads, groups = dims[f"{tower}_heads"], dims[f"{tower}_groups"]
        if tp > groups:
            raise ConvertError(f"--tensor-model-parallel-size {tp} is above the {tower}'s {groups} key/value heads")
        if heads % tp or groups % tp:
            raise ConvertError(f"--tensor-model-parallel-size {tp} does not divide the {tower}'s {heads} attention "
                               f"heads / {groups} key/value heads")
    llm = llm or [[dims["llm_layers"]]]
    vit = vit or [[dims["vit_layers"]] + [0] * (len(llm[0]) - 1)] + [[0] * len(llm[0])] * (len(llm) - 1)
    for flag, split, total in (("--llm-pp-layers", llm, dims["llm_layers"]),
                               ("--vit-pp-layers", vit, dims["vit_layers"])):
        if sum(map(sum, split)) != total:
            raise ConvertError(f"{flag} {json.dumps(split)} sums to {sum(map(sum, split))}, "
                               f"the model has {total} layers")
    if (len(vit), len(vit[0])) != (len(llm), len(llm[0])):
        raise ConvertError(f"--vit-pp-layers {json.dumps(vit)} and --llm-pp-layers {json.dumps(llm)} name different "
                           "numbers of pipeline stages")
    if any(n for c, chunk in enumerate(vit) for s, n in enumerate(chunk) if (c, s) != (0, 0)):
        raise ConvertError(f"--vit-pp-layers {json.dumps(vit)} puts vision layers on a stage other than the first "
                           "(the vision tower runs on the first stage)")
    return Layout(tp, llm, vit, ep, moe_tp_extend_ep)
