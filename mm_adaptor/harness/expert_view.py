"""The experts of a run whole, by global expert index, whatever the layout that ran them: for comparing two runs whose
ranks hold other experts or other slices of them (verdict.points with whole_experts; Feature.regroups_experts). Each
rank's dump records where its experts sit (runner.dump.expert_layout). Imports torch only when assembling."""

from __future__ import annotations

import re

# An expert's tensor as the runner names it: megatron's SequentialMLP (GroupedMLP's are split into these names).
_EXPERT = re.compile(r"^(?P<head>.*\.experts\.)local_experts\.(?P<local>\d+)\.(?P<tail>.+)$")


def not_expert(named: dict) -> dict:
    return {name: tensor for name, tensor in named.items() if not _EXPERT.match(name)}


def expert_layouts_differ(off, on) -> bool:
    """Whether the two runs place experts differently (expert-parallel or expert tensor-parallel sizes)."""
    def sizes(dump):
        return [(r.expert_layout.get("ep_size"), r.expert_layout.get("etp_size"))
                for r in dump.ranks if getattr(r, "expert_layout", None)]

    return sizes(off) != sizes(on)


def _partition_dim(tail: str) -> int | None:
    """The dimension megatron's expert tensor parallelism slices: fc1 is column-parallel (its output rows, bias
    too), fc2 row-parallel (its input columns; its bias is whole on every rank)."""
    if tail.startswith("linear_fc1."):
        return 0
    return 1 if tail == "linear_fc2.weight" else None


def assemble_experts(dump, tensors_of) -> dict[str, tuple[int, object]]:
    """Every expert tensor of the run whole, under its global name ('...experts.global_experts.<index>.<tensor>',
    prefixed by the pipeline stage when there are several): (the first rank holding it, the tensor).
    tensors_of(rank_dump) gives the rank's {name: tensor}. Slices of expert tensor parallelism are concatenated along
    the dimension megatron slices, a gated unit's fc1 half by half (each rank holds [gate slice; up slice]);
    expert-data-parallel replicas are the same tensor (the first is taken)."""
    import torch

    pieces: dict[str, dict] = {}
    for r in dump.ranks:
        layout = getattr(r, "expert_layout", None) or {}
        if not layout:
            continue
        local_count = layout["num_experts"] // layout["ep_size"]
        for name, tensor in tensors_of(r).items():
            match = _EXPERT.match(name)
            if match is None:
                continue
            index = layout["ep_rank"] * local_count + int(match["local"])
            stage = f"stage{layout['pp_rank']}." if layout.get("pp_rank") else ""
            key = f"{stage}{match['head']}global_experts.{index}.{match['tail']}"
            entry = pieces.setdefault(key, {"rank": r.rank, "slices": {}, "size": layout["etp_size"],
                                            "dim": _partition_dim(match["tail"]), "glu": layout.get("glu", False)})
            entry["slices"].setdefault(layout["etp_rank"], tensor)
    assembled = {}
    for key, entry in pieces.items():
        slices = [entry["slices"][i] for i in sorted(entry["slices"])]
        dim, parts = entry["dim"], 2 if entry["glu"] and key.rsplit(".", 2)[-2] == "linear_fc1" else 1
        if dim is None or entry["size"] == 1 or len(slices) == 1:
            whole = slices[0]
        else:
            halves = [s.chunk(parts, dim) for s in slices]
            whole = torch.cat([torch.cat([h[part] for h in halves], dim) for part in range(parts)], dim)
        assembled[key] = (entry["rank"], whole)
    return assembled
