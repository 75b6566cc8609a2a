"""Each MoE layer's expert load on the iteration line: the tokens every expert received over the logged training
steps (forward hooks on megatron's routers read each routing map), summed over all ranks at the step's end, and
shown as their coefficient of variation (standard deviation / mean; 0 is perfectly balanced, sqrt(E - 1) is every
token on one expert)."""

from __future__ import annotations


class ExpertLoads:
    def __init__(self):
        self.layers: list[int] = []  # global layer numbers of the MoE layers, every rank's
        self.experts = 0
        self.step = None  # this rank's counts this step, [layers, experts]
        self.interval = None  # the global counts since the last iteration line
        self.last_cv: dict[int, float] = {}

    def attach(self, chunks, args) -> None:
        """Hook every router of these model chunks (their layer numbers are global)."""
        import torch
        from megatron.core.transformer.moe.router import Router

        if not args.num_experts:
            return
        self.experts = args.num_experts
        self.layers = list(range(1, args.num_layers + 1))
        self.step = None  # on the routers' device, at the first routing map
        self.interval = torch.zeros(len(self.layers), self.experts, dtype=torch.int64)
        for chunk in chunks:
            for module in chunk.modules():
                if isinstance(module, Router):
                    module.register_forward_hook(self._hook)

    def _hook(self, router, _inputs, output):
        import torch

        layer = router.layer_number
        if not router.training or self.interval is None or layer is None or not 1 <= layer <= len(self.layers):
            return  # evaluation, or a multi-token-prediction layer
        routing_map = output[1]
        if self.step is None:
            self.step = torch.zeros(len(self.layers), self.experts, dtype=torch.int64, device=routing_map.device)
        self.step[layer - 1] += routing_map.sum(dim=0).to(torch.int64)

    def finish_step(self, device) -> None:
        """Every rank, once per training step (a rank without MoE layers contributes zeros)."""
        import torch
        import torch.distributed as dist

        if self.interval is None:
            return
        total = self.step if self.step is not None else torch.zeros_like(self.interval, device=device)
        dist.all_reduce(total)
        self.interval += total.cpu()
        total.zero_()

    def coefficients(self) -> dict[int, float]:
        """Layer number -> coefficient of variation of its experts' tokens since the last call (MoE layers only)."""
        found = {}
        if self.interval is None:
            return found
        for index, counts in enumerate(self.interval.double()):
            if counts.sum() > 0:
                found[self.layers[index]] = float(counts.std(unbiased=False) / counts.mean())
        self.interval.zero_()
        self.last_cv = found
        return found

    def spread_field(self) -> str:
        cv = self.coefficients()
        if not cv:
            return ""
        return "expert load cv per layer: " + " ".join(f"{layer}:{value:.3f}" for layer, value in cv.items())


LOADS = ExpertLoads()
