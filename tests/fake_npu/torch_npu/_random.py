"""Random ops on FAKE npu tensors draw from torch.npu's per-device generator (the CPU fallback would use torch's
CPU generator and hide RNG bugs): computed on a host copy with that generator, written back."""

from __future__ import annotations

import torch

_LIB = torch.library.Library("aten", "IMPL")  # noqa: TOR901
# Counted per op so tests can assert the fake generator was the one used.
DRAWS: dict[str, int] = {}


def _gen(tensor, generator):
    if generator is not None and generator.device.type == "cpu":
        return generator
    torch.npu._lazy_init()
    return torch.npu.default_generators[tensor.device.index or 0]


def _drawing(generator, draw):
    """Run draw(host_generator): an npu generator (torch.Generator(device='npu'), a CPU generator underneath)
    lends its state to a host generator and takes the advanced state back."""
    if generator is None or generator.device.type != "npu":
        return draw(generator)
    host = torch.Generator()
    host.set_state(generator.get_state())
    result = draw(host)
    generator.set_state(host.get_state())
    return result


def _inplace(name, draw):
    def kernel(self, *args, generator=None):
        DRAWS[name] = DRAWS.get(name, 0) + 1
        host = torch.empty(self.shape, dtype=self.dtype)
        host_args = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        _drawing(generator, lambda g: draw(host, *host_args, generator=g if g is not None else _gen(self, None)))
        self.copy_(host)
        return self
    _LIB.impl(name, kernel, "PrivateUse1")


def _native_dropout(input, p, train):
    if train is False or p == 0:
        return input.clone(), torch.ones_like(input, dtype=torch.bool)
    DRAWS["native_dropout"] = DRAWS.get("native_dropout", 0) + 1
    keep = torch.empty(input.shape, dtype=torch.bool).bernoulli_(1 - p, generator=_gen(input, None)).to(input.device)
    scale = 0.0 if p == 1 else 1.0 / (1 - p)
    return input * keep * scale, keep


def _randperm_out(n, *, generator=None, out):
    DRAWS["randperm"] = DRAWS.get("randperm", 0) + 1
    perm = _drawing(generator, lambda g: torch.randperm(n, generator=g if g is not None else _gen(out, None),
                                                        dtype=out.dtype))
    out.resize_(n).copy_(perm)
    return out


def register() -> None:
    _inplace("bernoulli_.float", lambda t, p, generator: t.bernoulli_(p, generator=generator))
    _inplace("bernoulli_.Tensor", lambda t, p, generator: t.bernoulli_(p, generator=generator))
    _inplace("uniform_", lambda t, a=0.0, b=1.0, generator=None: t.uniform_(a, b, generator=generator))
    _inplace("normal_", lambda t, m=0.0, s=1.0, generator=None: t.normal_(m, s, generator=generator))
    _inplace("exponential_", lambda t, lambd=1.0, generator=None: t.exponential_(lambd, generator=generator))
    _inplace("random_", lambda t, generator=None: t.random_(generator=generator))
    _inplace("random_.to", lambda t, to, generator=None: t.random_(to, generator=generator))
    _inplace("random_.from", lambda t, f, to, generator=None: t.random_(f, to, generator=generator))
    _LIB.impl("native_dropout", _native_dropout, "PrivateUse1")
    _LIB.impl("randperm.generator_out", _randperm_out, "PrivateUse1")
