"""The stop agreement: all ranks stop at one step, within a step or two of a stop request on any of them,
whatever --log-every is, and the host never waits for it.

Each step, every rank all-reduces a one-element flag (the number of the stop signal it received, or 0)
asynchronously on a gloo group of its own, on the CPU, and reads the result (the MAX) at the next step, by
when it has long arrived. Every rank reads the same value at the same step, so they all leave the loop there,
and all know which signal stopped them, even the ranks that never received it. On a GPU the flag never
touches the device, and the collectives of DDP's group are not interleaved with it.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist


class StopAgreement:
    def __init__(self, requested: Callable[[], int | None]) -> None:
        self.requested = requested
        """This rank's stop signal (its number), or None."""
        # new_group is itself a collective: every rank builds it, at the same point of its start-up.
        self.group = dist.new_group(backend="gloo")
        self.flag = torch.zeros(1)
        self.work: dist.Work | None = None

    def agreed(self) -> int:
        """Called once per step on every rank: the stop signal some rank had received by the previous call
        (the highest number, if several), else 0."""
        if self.work is not None:
            self.work.wait()  # the previous step's all-reduce: finished by now, this returns at once
            self.work = None
            if signum := int(self.flag.item()):  # a CPU tensor: no device sync
                return signum
        self.flag.fill_(float(self.requested() or 0))
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return 0

    def close(self) -> None:
        """Wait for the flag in flight (no collective may be pending when the group is torn down)."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        dist.destroy_process_group(self.group)
