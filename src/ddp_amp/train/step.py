"""One optimizer step under DDP and mixed precision, on one screen (docs/training.md, "The step"):

autocast forward -> scaled backward (`no_sync` on every micro-step but the last) -> the optimizer's update
(train.update: `unscale_` -> clip or norm -> `scaler.step` -> `update` -> `zero_grad(set_to_none=True)` -> the LR
schedule, unless GradScaler skipped).
With --micro-batch each batch runs in pieces (train.microbatch); an out-of-memory error that no halving
answers is one line, RankOutOfMemory.

Nothing here reads a value back from the device except where marked: the loss and the gradient norm are
returned as device tensors, for the metrics to read at log intervals.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ddp_amp.errors import RankOutOfMemory, RankSetupError
from ddp_amp.parallel.base import Strategy
from ddp_amp.precision import Precision, autocast
from ddp_amp.tasks.batches import batch_loss
from ddp_amp.train.data import to_device
from ddp_amp.train.microbatch import (
    MicroBatches,
    OutOfMemoryAgreement,
    batch_length,
    free_after_out_of_memory,
    is_certainly_out_of_memory,
    is_out_of_memory,
    split_batch,
)
from ddp_amp.train.update import OptimizerUpdate

PHASES = ("data", "forward", "backward", "step", "log")
"""Where the training loop can be, in order within one optimizer step; `AmpStep.position` names one."""
DATA, FORWARD, BACKWARD, STEP, LOG = range(len(PHASES))


@dataclass
class StepOutcome:
    stepped: bool
    """False when GradScaler found inf/NaN gradients and skipped the update (and the schedule with it)."""
    loss: torch.Tensor
    """The sum of the micro-steps' losses, fp32, on the device."""
    micro_steps: int
    grad_norm: torch.Tensor | None
    """The global norm of the unscaled gradients, on the device; None when neither clipping nor a log asked."""
    samples: int | None = None
    """The samples this rank trained on in the step (an epoch's last batch may be short of --batch-size); None
    where a batch holds no tensor to count them by."""


class CountingBatches:
    """The step's batches as they are taken, counting their samples (shapes only: no device sync)."""

    def __init__(self, batches: Iterator[Any]) -> None:
        self.batches, self.samples = batches, 0

    def __iter__(self) -> CountingBatches:
        return self

    def __next__(self) -> Any:
        batch = next(self.batches)
        if self.samples is not None:
            try:
                self.samples += batch_length(batch)
            except ValueError:
                self.samples = None
        return batch


class AmpStep:
    """The training step, with what it needs: the wrapped model, the loss, the optimizer, its scaler and
    schedule, and the parallel strategy that wrapped the model (its no_sync, its errors)."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor] | None,
                 optimizer: torch.optim.Optimizer, scaler: torch.amp.GradScaler, scheduler: Any, precision: Precision,
                 device: torch.device, strategy: Strategy, *,
                 grad_accum: int, clip_grad: float | None, gradient_reduction: Callable[[], None],
                 batch_size: int = 0, micro: MicroBatches | None = None, task: str = "",
                 every_field: bool = False, count_items: Callable[[Any], Any] | None = None) -> None:
        self.model, self.loss_fn, self.optimizer, self.scaler = model, loss_fn, optimizer, scaler
        self.strategy = strategy
        self.task = task
        """--task, for the message of a batch whose loss the Task contract cannot find."""
        self.every_field = every_field
        """Task.pass_every_field: a mapping batch's every field to the model, not only those its forward names."""
        self.count_items = count_items
        """The items a batch's loss averages over (loss_items_counter), where they are not its samples: each
        piece is then weighted by its share of the global batch's items; None: by its share of samples."""
        self.precision, self.device = precision, device
        self.grad_accum, self.clip_grad, self.batch_size = grad_accum, clip_grad, batch_size
        self.micro = micro
        """--micro-batch: each batch cut into pieces (train.microbatch); None: one piece per batch."""
        self.gradient_reduction = gradient_reduction
        """The all-reduce of the accumulated gradients under --micro-batch auto (and `try_batch`), after the
        ranks agreed that every piece fitted: its backward passes all ran under no_sync."""
        self.out_of_memory = OutOfMemoryAgreement(device) if micro is not None and micro.auto else None
        self.failed_with: BaseException | None = None
        """This rank's out-of-memory error of the piece that failed, if it was this rank's (under auto)."""
        self._position: tuple[int, int, int] = (0, 0, DATA)
        self._since = time.perf_counter()
        self.phase_s = [0.0] * len(PHASES)
        """Host seconds spent in each phase since `take_phase_times`: where this rank's time went (stragglers)."""
        self.update = OptimizerUpdate(optimizer, scaler, strategy, clip_grad=clip_grad, schedulers=[scheduler])
        """The optimizer's update (train.update): ddp_amp.loop's step takes the same."""

    @property
    def scheduler(self) -> Any:
        return self.update.schedulers[0]

    @scheduler.setter
    def scheduler(self, value: Any) -> None:  # a resized --epochs run re-enters its schedule (Trainer)
        self.update.schedulers = [value]

    @property
    def steps_taken(self) -> int:
        """The optimizer steps actually taken (fp16's skipped steps not counted)."""
        return self.update.steps_taken

    @property
    def position(self) -> tuple[int, int, int]:
        """(optimizer step, micro-step, phase): rebound, never mutated, so a watchdog thread reads it whole.
        Each change closes the time spent in the phase before (two clock reads; no device sync)."""
        return self._position

    @position.setter
    def position(self, value: tuple[int, int, int]) -> None:
        now = time.perf_counter()
        self.phase_s[self._position[2]] += now - self._since
        self._since, self._position = now, value

    def take_phase_times(self) -> list[float]:
        """The seconds per phase since the last call (the current phase's so far included), and start over."""
        self.position = self._position
        taken, self.phase_s = self.phase_s, [0.0] * len(PHASES)
        return taken

    def __call__(self, batches: Iterator[Any], step: int, *, want_norm: bool) -> StepOutcome:
        batches = CountingBatches(batches)
        try:
            if self.micro is None and self.count_items is None:
                loss_sum = self._accumulate(batches, step)
            else:  # the step's batches in hand: their pieces' weights depend on all of them
                loss_sum = self._accumulate_pieces([next(batches) for _ in range(self.grad_accum)], step)
            self.position = (step, self.grad_accum, STEP)
            stepped, grad_norm = self.update(want_norm=want_norm)
        except Exception as exc:
            if (line := self.strategy.error_line(exc, self.model, step)) is not None:
                raise RankSetupError(line) from exc
            if isinstance(exc, RankOutOfMemory) or not is_out_of_memory(exc) or getattr(exc, "halving_gave_up", False):
                raise
            line = self._out_of_memory_line(step)
            if not is_certainly_out_of_memory(exc):  # a backend's own report: say whose words it was
                line += f" (the backend reported: {str(exc).strip().splitlines()[0]})"
            raise RankOutOfMemory(line) from exc
        return StepOutcome(stepped, loss_sum, self.grad_accum, grad_norm, batches.samples)

    def try_batch(self, batch: Any, step: int) -> bool:
        """One optimizer step on `batch` as a single piece, under the out-of-memory agreement of auto: False,
        with nothing stepped and the memory freed, when it did not fit on some rank (bench --max-batch)."""
        if self.out_of_memory is None:
            self.out_of_memory = OutOfMemoryAgreement(self.device)
        if self._run_pieces([(batch, 1.0)], step, probe=True) is None:
            self.failed_with = None
            free_after_out_of_memory(self._drop_gradients, self.device)
            return False
        self.gradient_reduction()
        self.update.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def train_batch(self, batch: Any, step: int) -> bool:
        """One plain optimizer step on `batch` (bench --max-batch under --shard full: one launch per size)."""
        self.forward_backward(batch, step, 0, sync=True)
        self.update.step()
        self.optimizer.zero_grad(set_to_none=True)
        return True

    def _accumulate(self, batches: Iterator[Any], step: int) -> torch.Tensor:
        """Forward and backward of each of the step's batches; the sum of their losses, on the device."""
        last = self.grad_accum - 1
        loss_sum: torch.Tensor | None = None
        for micro in range(self.grad_accum):
            self.position = (step, micro, DATA)
            # Gradients are all-reduced only on the last micro-step; the others accumulate locally.
            part = self.forward_backward(next(batches), step, micro, sync=micro == last)
            loss_sum = part if loss_sum is None else loss_sum + part
        return loss_sum

    def forward_backward(self, batch: Any, step: int, index: int, *, sync: bool,
                         share: float | None = None) -> torch.Tensor:
        """One micro-step, the body both paths share (torchtitan's forward_backward_step): the batch to the
        device, the autocast forward and loss, the scaled backward, which all-reduces only when `sync` (else
        under no_sync). The loss counts 1/K of the step's K batches, times `share` for a piece of a batch
        (--micro-batch). Returns the loss, detached, fp32, on the device, unweighted."""
        if self.device.type != "cpu":
            batch = to_device(batch, self.device)
        with self.strategy.no_backward_sync(self.model, enabled=not sync):
            self.position = (step, index, FORWARD)
            with autocast(self.precision, self.device.type):
                loss = batch_loss(self.model, batch, self.loss_fn, self.task, self.every_field)
            self.position = (step, index, BACKWARD)  # DDP's all-reduce runs inside the last backward
            if share is not None:
                weighted = loss * (share / self.grad_accum)
            else:  # no extra kernel when there is one micro-step
                weighted = loss if self.grad_accum == 1 else loss / self.grad_accum
            self.scaler.scale(weighted).backward()
        return loss.detach().float()

    def _accumulate_pieces(self, batches: list[Any], step: int) -> torch.Tensor:
        """--micro-batch: the step's batches in pieces. Under auto, a piece that does not fit on any rank
        halves the pieces on every rank and the same batches run again (train.microbatch)."""
        while True:
            pieces = [(piece, share) for batch in batches
                      for piece, share in (split_batch(batch, self.micro.size) if self.micro else [(batch, 1.0)])]
            if self.count_items is not None:
                pieces = self._weighted_by_items(pieces)
            probe = self.micro is not None and self.micro.auto and not self.micro.settled
            loss_sum = self._run_pieces(pieces, step, probe=probe)
            if loss_sum is not None:
                break
            cause, self.failed_with = self.failed_with, None
            free_after_out_of_memory(self._drop_gradients, self.device)
            self.micro.halve(step + 1, cause)
        if probe:
            self.gradient_reduction()
            # The first optimizer step allocates the optimizer's state (AdamW: two copies of the weights), which
            # every later step's passes share the memory with: a size settles only once a whole step has run
            # beside it. (Settled after the first step, a GPU run fit 2048 samples in step 1 and ran out of
            # memory in step 2's backward.)
            self.micro.settled = self.steps_taken > 0
        return loss_sum

    def _weighted_by_items(self, pieces: list[tuple[Any, float]]) -> list[tuple[Any, torch.Tensor]]:
        """Each piece with its weight by items: its items' share of the global batch's (summed over the ranks, one
        small all-reduce a step), times K batches and W ranks, which forward_backward's 1/K and the gradient
        average over the ranks take back. A piece's mean loss so weighted adds up, over every piece of every rank,
        to the mean over all the step's items (Hugging Face's num_items_in_batch, and its fix of 2024)."""
        import torch.distributed as dist

        counts = torch.stack([torch.as_tensor(self.count_items(piece)).reshape(()).to(self.device, torch.float32)
                              for piece, _ in pieces])
        total = counts.sum().reshape(1)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world > 1:
            dist.all_reduce(total)
        weights = counts * (self.grad_accum * world) / total.clamp(min=1)  # no items anywhere: zero, not NaN
        return [(piece, weights[index]) for index, (piece, _) in enumerate(pieces)]

    def _run_pieces(self, pieces: list[tuple[Any, float]], step: int, *, probe: bool) -> torch.Tensor | None:
        """Forward and backward of each piece, its mean loss weighted by its share of its batch (and 1/K of
        the step's K batches); the sum of the batches' losses, or None when a rank ran out of memory.

        `probe` (auto, a size not yet run a whole step): every backward runs under no_sync and the ranks
        agree after each piece. No collective runs inside any pass, so a rank that fails anywhere leaves
        nobody waiting; the caller all-reduces the gradients after. Otherwise the last backward all-reduces,
        as DDP does, and nothing is agreed on: a settled size's step costs what a step without auto does."""
        last = len(pieces) - 1
        loss_sum: torch.Tensor | None = None
        for index, (batch, share) in enumerate(pieces):
            self.position = (step, index, DATA)
            failed = False
            try:
                loss = self.forward_backward(batch, step, index, sync=index == last and not probe, share=share)
            except Exception as exc:
                if not (probe and is_out_of_memory(exc)):
                    raise
                failed = True
                # Kept for halve(): its traceback holds the pass's tensors, so it is dropped (with them) as soon
                # as the halving has decided, before the rerun.
                self.failed_with = exc.with_traceback(None)
            if probe and self.out_of_memory.anyone(failed):
                return None
            part = loss * share
            if isinstance(share, torch.Tensor):  # a piece with no items: its mean is 0/0, and it weighs nothing
                part = torch.where(share > 0, part, torch.zeros_like(part))
            loss_sum = part if loss_sum is None else loss_sum + part
        return loss_sum

    def _out_of_memory_line(self, step: int) -> str:
        _, _, phase = self.position
        micro = self.micro
        size = (f"a micro-batch of {micro.size} samples (--batch-size {self.batch_size})" if micro
                else f"a batch of {self.batch_size} samples per rank")
        if micro is None or not micro.auto:
            advice = "use --micro-batch auto, or a smaller --batch-size" + (" or --micro-batch" if micro else "")
        elif micro.settled:  # it had trained a whole step at this size
            advice = (f"the memory a step needs grew after --micro-batch auto settled on {micro.size} (shapes that "
                      f"vary?); use --micro-batch {max(1, micro.size // 2)} or a smaller --batch-size")
        else:  # outside the pieces: the gradients' all-reduce or the optimizer's state
            advice = "the model, its gradients and its optimizer state do not fit (see --max-memory)"
        return f"out of memory in step {step + 1} ({PHASES[phase]}) with {size}: {advice}"

    def _drop_gradients(self) -> None:
        self.strategy.drop_gradients(self.model, self.optimizer)
