"""--keep-best's model_best.pt kept in step with the best evaluation the resumed checkpoint records.

A checkpoint records the best evaluation so far and the checksum of the model_best.pt written for it. A run
resumed from a checkpoint older than the attempt's last best (`--resume PATH` to an earlier step, or a restart
after a best found past the newest checkpoint) finds model_best.pt holding the weights of a best the checkpoint
never saw: summary.json would name one step while the file held another's weights. So on resume every writer
of the run dir compares the file's checksum with the recorded one; where they differ, the file is rewritten from
the best step's checkpoint (never pruned while it is the best), and where that step has no checkpoint left, the
recorded best is dropped on every rank: this run's evaluations choose the best again, and the next one replaces
the file. Checkpoints written before the checksum was recorded are taken as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Protocol

import torch
import torch.distributed as dist

from ddp_amp.dist import DistEnv
from ddp_amp.files import recorded_checksum
from ddp_amp.outputs import BEST_MODEL_FILE, save_weights
from ddp_amp.train.evaluation import BestKeeper


class BestStepWeights(Protocol):
    """What of the run's checkpoints this needs (checkpoint.manager's)."""

    run_dir: Path

    def model_weights(self, step: int) -> dict[str, torch.Tensor] | None: ...


IN_STEP, REWRITTEN, LOST = 0, 1, 2


def write_best(run_dir: Path, state: dict[str, torch.Tensor], best: BestKeeper) -> None:
    """model_best.pt from `state` (a writer of the run dir), its checksum recorded with the best evaluation."""
    best.checksum = recorded_checksum(save_weights(run_dir, state, BEST_MODEL_FILE))


def reconcile(best: BestKeeper, checkpoints: BestStepWeights, env: DistEnv, device: torch.device,
              warn: Callable[[str], None]) -> None:
    """After a resume, every rank: model_best.pt made the weights of the best the checkpoint records (rewritten
    from the best step's checkpoint), or the best dropped where those weights are gone (one all-reduce, where
    the checkpoint records a best: the same on every rank). Rank 0 says which, in one line."""
    if best.best is None:
        return
    status = _bring_in_step(best, checkpoints) if env.writes_run_dir else IN_STEP
    flag = torch.tensor([status], dtype=torch.int32, device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    if env.rank != 0 or flag.item() == IN_STEP:
        best.best = None if flag.item() == LOST else best.best
        return
    if flag.item() == LOST:
        warn(f"--keep-best: {BEST_MODEL_FILE} does not hold step {best.best['step']}'s weights (the best the "
             f"resumed checkpoint records: {best.best['metric']} {best.best['value']:.6g}), and no checkpoint of "
             f"that step is left to take them from; this run's evaluations choose the best again")
        best.best = None
    elif flag.item() == REWRITTEN:
        warn(f"--keep-best: {BEST_MODEL_FILE} rewritten from step {best.best['step']}'s checkpoint (the best the "
             "resumed checkpoint records; the file held another attempt's weights)")


def _bring_in_step(best: BestKeeper, checkpoints: BestStepWeights) -> int:
    """This writer's model_best.pt: as recorded, rewritten from the best step's checkpoint, or lost."""
    if best.checksum is None or recorded_checksum(checkpoints.run_dir / BEST_MODEL_FILE) == best.checksum:
        return IN_STEP
    if (state := checkpoints.model_weights(best.best["step"])) is None:
        return LOST
    best.checksum = recorded_checksum(save_weights(checkpoints.run_dir, state, BEST_MODEL_FILE))
    return REWRITTEN
