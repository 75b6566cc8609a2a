"""The FAKE 'hccl' process-group backend: gloo on host copies of npu tensors, refusing float64 as HCCL does.

Each collective copies its npu tensors to host buffers, runs gloo's collective on them, and writes the results
back into the npu tensors when its work is waited on. As torch_npu's HCCL, it takes npu tensors only (no CPU
tensor, which torch's object collectives would otherwise send) and no float64. Uneven list collectives (megatron's
gather and reduce-scatter with split sizes) are taken as HCCL's AllGatherV/ReduceScatterV take them. Not HCCL: no
timeouts, streams or topology of its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

CALLS: dict[str, int] = {}
_AllgatherOptions = torch._C._distributed_c10d.AllgatherOptions  # not exported by torch.distributed


def _refuse_fp64(tensors):
    for t in tensors:
        if t.dtype == torch.float64:
            raise RuntimeError("hccl (FAKE): float64 is not supported by HCCL collectives")


def _refuse_host_tensors(tensors):
    for t in tensors:
        if t.device.type != "npu" or t.layout != torch.strided:
            raise RuntimeError(f"hccl (FAKE): Tensors must be NPU and dense (got {t.device.type}, {t.layout})")


def _host(t):
    return t.detach().cpu() if t.device.type != "cpu" else t


class _CopyBack(dist.Work):
    """Waits on gloo's work, then writes the host results back into the npu tensors."""

    def __init__(self, work, pairs):
        super().__init__()
        self._work, self._pairs, self._done = work, pairs, False

    def wait(self, timeout=None):
        if not self._done:
            self._work.wait()
            for device_tensor, host in self._pairs:
                if device_tensor is not host:
                    device_tensor.detach().copy_(host)
            self._done = True
        return True

    def is_completed(self):
        return self._done

    def get_future(self):
        self.wait()
        fut = torch.futures.Future()
        fut.set_result([t for t, _ in self._pairs])
        return fut


class _All(dist.Work):
    """The works of a coalesced call, run one collective after another."""

    def __init__(self, works):
        super().__init__()
        self._works = works

    def wait(self, timeout=None):
        for work in self._works:
            work.wait()
        return True

    def is_completed(self):
        return all(work.is_completed() for work in self._works)


class FakeHccl(dist.ProcessGroup):
    def __init__(self, store, rank, size, timeout):
        super().__init__(rank, size)
        self._gloo = dist.ProcessGroupGloo(store, rank, size, timeout)

    def getBackendName(self):
        return "hccl"

    @property
    def _device_types(self):
        """torch_npu's HCCL backend serves npu alone, so torch's object collectives and barrier use npu tensors."""
        return [torch.device("npu")]

    def name(self):
        return "hccl"

    def _run(self, name, inputs, outputs, call):
        CALLS[name] = CALLS.get(name, 0) + 1
        _refuse_host_tensors([*inputs, *outputs])
        _refuse_fp64([*inputs, *outputs])
        host_in = {id(t): _host(t) for t in inputs}
        host_out = {id(t): host_in.get(id(t), _host(t)) for t in outputs}
        work = call(lambda t: host_in.get(id(t), host_out.get(id(t), t)))
        return _CopyBack(work, [(t, host_out[id(t)]) for t in outputs])

    def allreduce(self, tensors, opts):
        return self._run("allreduce", tensors, tensors, lambda h: self._gloo.allreduce([h(t) for t in tensors], opts))

    def broadcast(self, tensors, opts):
        return self._run("broadcast", tensors, tensors, lambda h: self._gloo.broadcast([h(t) for t in tensors], opts))

    def allgather(self, outputs, inputs, opts=None):
        opts = opts if opts is not None else _AllgatherOptions()  # torch 2.6/2.7's all_gather passes none
        flat = [t for group in outputs for t in group]
        if any(len({tuple(t.shape) for t in group}) > 1 for group in outputs):
            return self._allgather_uneven(outputs, inputs, opts)
        return self._run("allgather", inputs, flat, lambda h: self._gloo.allgather(
            [[h(t) for t in group] for group in outputs], [h(t) for t in inputs], opts))

    def _allgather_uneven(self, outputs, inputs, opts):
        """Outputs of different sizes, as HCCL's AllGatherV (torch_npu takes them; gloo does not): each rank's input
        padded to the largest output, gathered, and each output written from its rank's leading elements."""
        CALLS["allgather_uneven"] = CALLS.get("allgather_uneven", 0) + 1
        flat = [t for group in outputs for t in group]
        _refuse_host_tensors([*inputs, *flat])
        _refuse_fp64([*inputs, *flat])
        width = max(t.numel() for t in flat)
        padded_in = []
        for t in inputs:
            padded = torch.zeros(width, dtype=t.dtype)
            padded[:t.numel()] = _host(t).reshape(-1)
            padded_in.append(padded)
        padded_out = [[torch.empty(width, dtype=t.dtype) for t in group] for group in outputs]
        work = self._gloo.allgather(padded_out, padded_in, opts)
        pairs = [(t, buf[:t.numel()].view(t.shape)) for group, bufs in zip(outputs, padded_out)
                 for t, buf in zip(group, bufs)]
        return _CopyBack(work, pairs)

    def all_gather_single(self, output, input, opts):
        return self._run("all_gather_single", [input], [output],
                         lambda h: self._gloo._allgather_base(h(output), h(input), opts))

    def reduce_scatter_single(self, output, input, opts):
        return self._run("reduce_scatter_single", [input], [output],
                         lambda h: self._gloo._reduce_scatter_base(h(output), h(input), opts))

    def reduce_scatter(self, outputs, inputs, opts):
        flat = [t for group in inputs for t in group]
        try:
            return self._run("reduce_scatter", flat, outputs, lambda h: self._gloo.reduce_scatter(
                [h(t) for t in outputs], [[h(t) for t in group] for group in inputs], opts))
        except RuntimeError as error:  # torch 2.6/2.7's gloo has no reduce_scatter: every rank raises alike
            if "does not support reduce_scatter" not in str(error):
                raise
        # as HCCL's ReduceScatterV: each input list all-reduced whole, and this rank keeps its own part of it
        pairs, works = [], []
        for output, group in zip(outputs, inputs):
            whole = torch.cat([_host(t).reshape(-1) for t in group])
            all_reduce = dist.AllreduceOptions()
            all_reduce.reduceOp = opts.reduceOp
            works.append(self._gloo.allreduce([whole], all_reduce))
            start = sum(t.numel() for t in group[:self.rank()])
            pairs.append((output, whole[start:start + output.numel()].view(output.shape)))
        return _CopyBack(_All(works), pairs)

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts):
        return self._run("all_to_all_single", [input], [output], lambda h: self._gloo.alltoall_base(
            h(output), h(input), output_split_sizes, input_split_sizes, opts))

    def reduce(self, tensors, opts):
        return self._run("reduce", tensors, tensors, lambda h: self._gloo.reduce([h(t) for t in tensors], opts))

    def alltoall(self, outputs, inputs, opts):
        return self._run("alltoall", inputs, outputs, lambda h: self._gloo.alltoall(
            [h(t) for t in outputs], [h(t) for t in inputs], opts))

    def allreduce_coalesced(self, tensors, opts):
        return self._run("allreduce_coalesced", tensors, tensors,
                         lambda h: self._gloo.allreduce_coalesced([h(t) for t in tensors], opts))

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts):
        return _All([self.reduce_scatter_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def all_gather_single_coalesced(self, outputs, inputs, opts):
        return _All([self.all_gather_single(o, i, opts) for o, i in zip(outputs, inputs)])

    def allgather_coalesced(self, output_lists, inputs, opts):
        return _All([self.allgather([outs], [i], opts) for outs, i in zip(output_lists, inputs)])

    def send(self, tensors, dst, tag):
        return self._run("send", tensors, [], lambda h: self._gloo.send([h(t) for t in tensors], dst, tag))

    def recv(self, tensors, src, tag):
        return self._run("recv", [], tensors, lambda h: self._gloo.recv([h(t) for t in tensors], src, tag))

    def recv_anysource(self, tensors, tag):
        return self._run("recv", [], tensors, lambda h: self._gloo.recv_anysource([h(t) for t in tensors], tag))

    def barrier(self, opts):
        CALLS["barrier"] = CALLS.get("barrier", 0) + 1
        host = dist.BarrierOptions()
        host.timeout = opts.timeout
        return self._gloo.barrier(host)

    def gather(self, outputs, inputs, opts):
        flat = [t for group in outputs for t in group]
        return self._run("gather", inputs, flat, lambda h: self._gloo.gather(
            [[h(t) for t in group] for group in outputs], [h(t) for t in inputs], opts))

    def scatter(self, outputs, inputs, opts):
        flat = [t for group in inputs for t in group]
        return self._run("scatter", flat, outputs, lambda h: self._gloo.scatter(
            [h(t) for t in outputs], [[h(t) for t in group] for group in inputs], opts))

    # torch 2.6/2.7: its Python ProcessGroup trampoline overrides fewer methods, under these older names, and its
    # distributed_c10d calls them by these names (torch_npu's HCCL is a C++ Backend, which needs none of them)
    def _allgather_base(self, output, input, opts=None):
        return self.all_gather_single(output, input, opts if opts is not None else _AllgatherOptions())

    def _reduce_scatter_base(self, output, input, opts=None):
        return self.reduce_scatter_single(output, input, opts if opts is not None else dist.ReduceScatterOptions())

    def alltoall_base(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        return self.all_to_all_single(output, input, output_split_sizes, input_split_sizes,
                                      opts if opts is not None else dist.AllToAllOptions())

    def allgather_into_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.all_gather_single_coalesced(outputs, inputs, opts if opts is not None else _AllgatherOptions())

    def reduce_scatter_tensor_coalesced(self, outputs, inputs, opts=None):
        return self.reduce_scatter_single_coalesced(outputs, inputs,
                                                    opts if opts is not None else dist.ReduceScatterOptions())


def _create(store, rank, size, timeout):
    return FakeHccl(store, rank, size, timeout)


def register() -> None:
    if "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _create, devices=["npu"])  # as torch_npu: no CPU tensors
