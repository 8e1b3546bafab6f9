"""Micro-batches: a rank's batch cut into pieces that fit in memory (--micro-batch N), and the agreement that
lets --micro-batch auto halve the pieces on every rank when any one runs out of memory.

The protocol of auto, after composer's automatic micro-batching: while a size is new (the first step, the
first step after each halving, and any step before the optimizer has allocated its state), every piece's forward
and backward run under `no_sync`, so no collective runs inside any pass and a rank that fails anywhere in them
leaves no other rank waiting in one; after each piece the ranks all-reduce one flag, "did anyone run out of
memory". If anyone did, every rank drops its gradients, empties the CUDA cache, halves the piece and runs the
same batch again: the optimizer, GradScaler, schedule and data position have not moved. Otherwise the
accumulated gradients are all-reduced once after the last piece, in buckets. Once a whole step has run at a size
beside the optimizer's state, the steps are DDP's own again (the last backward all-reduces, overlapping) with no
flag at all: a flag per piece cost 25% of the default task's 5 ms step here (a gloo all-reduce of one number
takes ~450 us on this machine). A size that has so trained a whole step needs the same memory at the next step
of the same shapes; where it does not (shapes that vary), an out-of-memory error at a settled size ends the run
with one line, as without auto.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.errors import RankOutOfMemory

CPU_ALLOCATOR_FAILURE = "DefaultCPUAllocator: can't allocate memory"
BACKEND_ALLOCATION_FAILURES = ("could not create a primitive",)
"""How CPU backends with allocators of their own say they ran out: oneDNN's bf16 matmul under RLIMIT_DATA on an
avx512_bf16 CPU. The message also names other oneDNN failures, so it is treated as out of memory but never
trusted to the end: see MicroBatches.halve."""


def is_certainly_out_of_memory(exc: BaseException) -> bool:
    """CUDA's torch.OutOfMemoryError, or the CPU allocator's RuntimeError (under RLIMIT_DATA, or a full host)."""
    return isinstance(exc, torch.OutOfMemoryError) or (isinstance(exc, RuntimeError)
                                                        and CPU_ALLOCATOR_FAILURE in str(exc))


def is_out_of_memory(exc: BaseException) -> bool:
    """Out of memory, as the allocators say it, or as a backend with its own allocator does (oneDNN)."""
    return is_certainly_out_of_memory(exc) or (isinstance(exc, RuntimeError) and any(
        failure in str(exc) for failure in BACKEND_ALLOCATION_FAILURES))


def batch_length(batch: Any) -> int:
    """The number of samples in a batch: the first dimension of its first tensor that has one (a 0-d tensor, a
    scalar of the whole batch such as a loss weight, has none)."""
    if isinstance(batch, torch.Tensor):
        if batch.ndim == 0:
            raise ValueError("a 0-d tensor counts no samples")
        return batch.shape[0]
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else []
    for value in values:
        try:
            return batch_length(value)
        except ValueError:
            continue
    raise ValueError("the batch holds no tensor to count its samples by")


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch if batch.ndim == 0 else batch[start:stop]  # a 0-d tensor is the whole batch's: every piece's
    if isinstance(batch, Mapping):
        return type(batch)({key: _slice(value, start, stop) for key, value in batch.items()})
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice(value, start, stop) for value in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_slice(value, start, stop) for value in batch)
    return batch


def split_batch(batch: Any, size: int) -> list[tuple[Any, float]]:
    """`batch` cut into pieces of `size` samples (the last one shorter), each with its share of the batch: a
    piece's mean loss weighted by its share adds up to the batch's mean loss, an uneven last piece included."""
    total = batch_length(batch)
    if size >= total:
        return [(batch, 1.0)]
    return [(_slice(batch, start, min(start + size, total)), (min(start + size, total) - start) / total)
            for start in range(0, total, size)]


@dataclass
class MicroBatches:
    """The micro-batch size of a run and its history."""

    size: int
    auto: bool
    changes: list[dict[str, int]] = field(default_factory=list)
    """Each halving under auto: the optimizer step it happened in and the new size."""
    settled: bool = False
    """Under auto: a whole step has run at this size on every rank (AmpStep then runs DDP's own step again,
    with no agreement)."""

    def halve(self, step: int, cause: BaseException | None = None) -> None:
        """Half the size, after `cause` (what a rank raised, where this rank saw it). At a size of 1 there is
        nothing left to halve: an allocator's failure means the model does not fit; a backend's look-alike,
        which halving never answered, is raised as it is (it may not have been memory at all)."""
        if self.size == 1:
            if cause is not None and not is_certainly_out_of_memory(cause):
                cause.halving_gave_up = True  # AmpStep passes it on as it is
                raise cause
            raise RankOutOfMemory(f"out of memory in step {step} with a micro-batch of 1 sample, under "
                                  "--micro-batch auto: the model itself does not fit (see --max-memory)")
        self.size //= 2
        self.settled = False
        self.changes.append({"step": step, "micro_batch_size": self.size})


class OutOfMemoryAgreement:
    """One flag all-reduced per micro-batch under auto: whether any rank ran out of memory in it."""

    def __init__(self, device: torch.device) -> None:
        self.flag = torch.zeros(1, device=device)  # allocated once: after an OOM there may be no room for it

    def anyone(self, failed: bool) -> bool:
        self.flag.fill_(1.0 if failed else 0.0)
        dist.all_reduce(self.flag, op=dist.ReduceOp.MAX)
        return bool(self.flag.item())  # host sync: every rank must know before it goes on


def free_after_out_of_memory(drop_gradients: Callable[[], None], device: torch.device) -> None:
    """Drop the partial gradients and whatever the failed pass left, so the rerun starts from what the step
    started with."""
    drop_gradients()
    gc.collect()  # the failed pass's activations, held by its traceback's frames until now
    if device.type == "cuda":
        torch.cuda.empty_cache()


def all_reduce_gradients(params: list[torch.nn.Parameter], world_size: int, bucket_mb: float,
                         compression: str) -> None:
    """The mean of the accumulated gradients over the ranks, as DDP would have made it in the last backward:
    flat buckets of about `bucket_mb`, launched together, in fp16 or bf16 under --grad-compression. A
    parameter without a gradient counts as zeros, so every rank reduces the same sizes."""
    wire = {"none": None, "fp16": torch.float16, "bf16": torch.bfloat16}[compression]
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    limit = bucket_mb * 2**20
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for grad in grads:
        if buckets[-1] and size + grad.numel() * grad.element_size() > limit:
            buckets.append([])
            size = 0
        buckets[-1].append(grad)
        size += grad.numel() * grad.element_size()
    flats = []
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        flat = (flat.to(wire) if wire is not None else flat).div_(world_size)  # divided first, as DDP's hooks do
        flats.append((bucket, flat, dist.all_reduce(flat, async_op=True)))
    for bucket, flat, work in flats:
        work.wait()
        for grad, piece in zip(bucket, flat.split([g.numel() for g in bucket])):
            grad.copy_(piece.view_as(grad))
