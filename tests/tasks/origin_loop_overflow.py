"""examples/origin_loop.py, the project's origin example written with ddp_amp.loop, run unchanged with one
infinite loss forced (its MSELoss patched to return inf at --overflow-at, counting calls from 1) and each step
watched from outside (Loop.step wrapped): whether it stepped, the optimizer's rate, both schedules' positions,
the loss scale, whether the weights moved. Rank 0 writes them to --out as JSON when the example finishes."""

import argparse
import json
import runpy
import sys
from pathlib import Path

import torch

from ddp_amp import loop

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "origin_loop.py"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--overflow-at", type=int, default=3)
    parser.add_argument("--epochs", default="6")
    args = parser.parse_args()
    losses = [0]
    mse = torch.nn.MSELoss.forward

    def forward(self, input, target):
        losses[0] += 1
        loss = mse(self, input, target)
        return loss * float("inf") if losses[0] == args.overflow_at else loss

    steps, step, finish = [], loop.Loop.step, loop.Loop.finish

    def watched_step(run, optimizer, *schedulers, **options):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        before = [p.detach().clone() for p in params]
        stepped = step(run, optimizer, *schedulers, **options)
        steps.append({"stepped": stepped, "lr": optimizer.param_groups[0]["lr"],
                      "positions": [scheduler.last_epoch for scheduler in schedulers],
                      "scale": run.scaler.get_scale(),
                      "moved": any(not torch.equal(a, b) for a, b in zip(before, params))})
        return stepped

    def finish_and_write(run):
        if run.rank == 0:
            Path(args.out).write_text(json.dumps({"precision": run.precision, "steps": steps,
                                                  "skipped": run.skipped_steps}))
        finish(run)

    torch.nn.MSELoss.forward, loop.Loop.step, loop.Loop.finish = forward, watched_step, finish_and_write
    sys.argv = [str(EXAMPLE), "--epochs", args.epochs]
    runpy.run_path(str(EXAMPLE), run_name="__main__")


if __name__ == "__main__":
    main()
