"""What a run records for comparison: per rank, the losses, the main gradients of every step, the parameters before
the first and after the last step, memory figures and the features applied. Each rank writes its part (--dump DIR);
`read_dump` gives it back as a Dump."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from mm_adaptor.core.wrapped import unwrap


@dataclass
class RankDump:
    rank: int
    losses: list
    grad_norms: list
    grads: list = field(default_factory=list)  # one {name: tensor} per step, read before the optimizer step
    activations: dict = field(default_factory=dict)  # module outputs of the first micro-batch of step 1
    initial_params: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    memory: dict = field(default_factory=dict)
    features: list = field(default_factory=list)
    expert_layout: dict = field(default_factory=dict)  # where this rank's experts sit among all (expert_layout)


@dataclass
class Dump:
    ranks: list
    args: dict = field(default_factory=dict)

    @property
    def losses(self) -> list:
        return self.ranks[0].losses

    @property
    def features(self) -> list:
        return self.ranks[0].features

    @property
    def memory(self) -> dict:
        return self.ranks[0].memory


def dump_entries(chunk):
    """(name, parameter, view) per parameter; GroupedMLP's fused expert matrices are split into SequentialMLP's
    per-expert weights and names, so the two expert implementations compare tensor by tensor."""
    from megatron.core.transformer.moe import experts

    grouped_mlp = getattr(experts, "GroupedMLP", None)  # megatron-core 0.17 removed it (TEGroupedMLP remains)

    def fc_views(n, h):
        fc1 = [lambda t, e=e: t.view(n, h, -1)[e].t() for e in range(n)]  # [hidden, E*2f] -> [2f, hidden]
        fc2 = [lambda t, e=e: t.view(n, -1, h)[e].t() for e in range(n)]  # [E*f, hidden] -> [hidden, f]
        return fc1, fc2

    split = {}
    for prefix, module in chunk.named_modules():
        if grouped_mlp is not None and isinstance(module, grouped_mlp):
            dot = f"{prefix}." if prefix else ""
            fc1, fc2 = fc_views(module.num_local_experts, module.config.hidden_size)
            split[f"{dot}weight1"] = [(f"{dot}local_experts.{e}.linear_fc1.weight", v) for e, v in enumerate(fc1)]
            split[f"{dot}weight2"] = [(f"{dot}local_experts.{e}.linear_fc2.weight", v) for e, v in enumerate(fc2)]
    for name, p in chunk.named_parameters():
        for split_name, view in split.get(name, [(name, lambda t: t)]):
            yield split_name, p, view


def _entries(model):
    for i, chunk in enumerate(model):
        for name, p, view in dump_entries(chunk):
            yield f"chunk{i}.{name}", p, view


def _host_copy(tensor):
    """An fp32 copy in host memory: what the dump keeps, on every device."""
    import torch

    return tensor.to("cpu", torch.float32, copy=True)


def parameters_snapshot(model) -> dict:
    return {key: _host_copy(view(p.detach())) for key, p, view in _entries(model)}


def gradients_snapshot(model) -> dict:
    """The gradients megatron's optimizer is about to use: main_grad (DDP's buffer) where it exists."""
    grads = {}
    for key, p, view in _entries(model):
        g = getattr(p, "main_grad", None)
        if g is None:
            g = p.grad
        if g is not None:
            grads[key] = _host_copy(view(g.detach()))
    return grads


# Per transformer layer: the outputs compared at the first micro-batch ("" is the layer itself).
RECORDED_SUBMODULES = ("input_layernorm", "self_attention", "pre_mlp_layernorm", "mlp", "")


def _recorded_modules(model):
    from megatron.core.transformer.identity_op import IdentityOp

    for i, chunk in enumerate(model):
        module = unwrap(chunk)
        module = getattr(module, "language_model", module)  # a VLM: its language model's layers
        for layer in getattr(getattr(module, "decoder", None), "layers", []):
            for sub in RECORDED_SUBMODULES:
                module = getattr(layer, sub, None) if sub else layer
                if module is not None and not isinstance(module, IdentityOp):
                    yield f"chunk{i}.L{layer.layer_number}.{sub or 'output'}", module


def expert_layout(model) -> dict:
    """This rank's place in megatron's expert groups, which names its local experts' global indices
    (harness.expert_view.assemble_experts assembles each expert from the ranks' slices by it); {} for a model without
    experts."""
    from megatron.core import parallel_state as ps

    module = unwrap(model[0])
    config = getattr(getattr(module, "language_model", module), "config", None)  # a VLM: its language model's
    if not getattr(config, "num_moe_experts", None):
        return {}
    return {"num_experts": config.num_moe_experts, "glu": bool(config.gated_linear_unit),
            "ep_rank": ps.get_expert_model_parallel_rank(), "ep_size": ps.get_expert_model_parallel_world_size(),
            "etp_rank": ps.get_expert_tensor_parallel_rank(), "etp_size": ps.get_expert_tensor_parallel_world_size(),
            "pp_rank": ps.get_pipeline_model_parallel_rank()}


class Recorder:
    """Collects one rank's dump during training."""

    def __init__(self, model):
        self.model = model
        self.initial_params = parameters_snapshot(model)
        self.grads: list[dict] = []
        self.activations: dict = {}
        self._hooks = [module.register_forward_hook(self._keep_first_output(key))
                       for key, module in _recorded_modules(model)]

    def _keep_first_output(self, key):
        def hook(module, inputs, output):
            if key not in self.activations:
                out = output[0] if isinstance(output, (tuple, list)) else output
                if hasattr(out, "detach"):
                    self.activations[key] = _host_copy(out.detach())

        return hook

    def after_backward(self) -> None:
        self.grads.append(gradients_snapshot(self.model))
        for handle in self._hooks:
            handle.remove()
        self._hooks = []

    def write(self, state, directory: str) -> None:
        import torch
        import torch.distributed as dist

        from mm_adaptor.api import applied_features, feature_statistics, patch_calls
        from mm_adaptor.devices.memory import model_state_bytes

        memory = dict(state.memory, **model_state_bytes(state.model, state.optimizer),
                      feature_statistics=feature_statistics(), patch_calls=patch_calls())
        rank = dist.get_rank()
        record = RankDump(rank=rank, losses=[r.loss for r in state.records],
                          grad_norms=[r.grad_norm for r in state.records], grads=self.grads,
                          activations=self.activations, initial_params=self.initial_params,
                          params=parameters_snapshot(self.model),
                          memory=memory, features=list(applied_features()),
                          expert_layout=expert_layout(self.model))
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        torch.save(asdict(record), path / f"rank{rank}.pt")
        if rank == 0:
            (path / "args.json").write_text(json.dumps(
                {k: v for k, v in vars(state.args).items() if isinstance(v, (int, float, str, bool, type(None)))},
                indent=1))


def read_dump(directory, world_size: int) -> Dump:
    import torch

    path = Path(directory)
    ranks = [RankDump(**torch.load(path / f"rank{rank}.pt")) for rank in range(world_size)]
    args_file = path / "args.json"
    return Dump(ranks=ranks, args=json.loads(args_file.read_text()) if args_file.exists() else {})
