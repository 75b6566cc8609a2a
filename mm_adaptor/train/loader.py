"""--num-workers (Megatron's flag): the training batches are made in DataLoader worker processes.

Worker w of N makes items w, w + N, w + 2N, ... of this rank's stream (its micro-batches; with --packing whole steps
of packs, which the step's first micro-batch waits for), and torch's loader hands them over in that order, so a run
with workers reads exactly what one without reads. Each item carries the non-padding tokens it holds (--log-tps) and
the samples that failed to load and were skipped while making it (--skip-bad-samples).
The workers make host tensors; they move to the device here, in the rank."""

from __future__ import annotations

import dataclasses
import signal


def _ignore_stop_signals(_worker_id: int) -> None:
    """SIGTERM is the rank's to handle (it finishes its iteration and saves); a worker stops with its loader."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _stream_class():
    import torch

    class Stream(torch.utils.data.IterableDataset):
        def __init__(self, make, packed: bool):
            super().__init__()
            self.make, self.packed = make, packed

        def __iter__(self):
            info = torch.utils.data.get_worker_info()
            worker, workers = (info.id, info.num_workers) if info else (0, 1)
            source = self.make()
            position = worker
            while True:
                source.seek(position)
                failed = len(getattr(source, "failed", ()))
                if self.packed:
                    source.start_step()
                    item = [next(source) for _ in range(source.microbatches_this_step)], source.tokens_this_step
                else:
                    before = getattr(source, "tokens_this_step", None)
                    batch = next(source)
                    item = batch, None if before is None else source.tokens_this_step - before
                yield (*item, getattr(source, "failed", [])[failed:])
                position += workers

    return Stream


def to_device(batch: dict, device) -> dict:
    """A batch's tensors (and a PackedSeqParams' bounds) on `device`."""
    import torch

    def moved(value):
        if isinstance(value, torch.Tensor):
            return value.to(device, non_blocking=True)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            return dataclasses.replace(value, **{f.name: moved(getattr(value, f.name))
                                                 for f in dataclasses.fields(value)
                                                 if isinstance(getattr(value, f.name), torch.Tensor)})
        return value

    return {name: moved(value) for name, value in batch.items()}


class WorkerBatches:
    """The batches a forward step iterates, made by `workers` loader processes from `make()` (a source on the
    host with seek(position)); the step interface (start_step, microbatches_this_step, tokens_this_step) of the
    source it replaces."""

    def __init__(self, make, device, workers: int, packed: bool, counts_tokens: bool, bad_limit: int = 0):
        import torch

        loader = torch.utils.data.DataLoader(_stream_class()(make, packed), batch_size=None, num_workers=workers,
                                             persistent_workers=True, worker_init_fn=_ignore_stop_signals,
                                             multiprocessing_context="fork")  # the stream's closure, inherited
        self.items, self.device, self.packed = iter(loader), device, packed
        self.queue: list = []
        self.microbatches_this_step = 0
        self.tokens_this_step = 0 if counts_tokens else None
        self.failed: list[str] = []  # samples the workers failed to load and skipped, one line each
        self.bad_limit = bad_limit

    def __iter__(self):
        return self

    def _said(self, failed: list[str]) -> None:
        """The samples a worker skipped, each said in one line by this rank."""
        from mm_adaptor.data.vlm import skipped_line

        for line in failed:
            self.failed.append(line)
            print(skipped_line(line, len(self.failed), self.bad_limit), flush=True)

    def start_step(self) -> None:
        if self.packed:
            self.queue, tokens, failed = next(self.items)
            self.microbatches_this_step, self.tokens_this_step = len(self.queue), tokens
            self._said(failed)
        elif self.tokens_this_step is not None:
            self.tokens_this_step = 0

    def __next__(self):
        if self.packed:
            if not self.queue:
                raise RuntimeError("all packs of the step were read: call start_step() before each step")
            return to_device(self.queue.pop(0), self.device)
        batch, tokens, failed = next(self.items)
        self._said(failed)
        if tokens is not None and self.tokens_this_step is not None:
            self.tokens_this_step += tokens
        return to_device(batch, self.device)
