"""A script's loop through ddp_amp.loop for the tests: a linear regression on a fixed batch per rank (its own
generator, so a resume draws the same data), a report every step, a checkpoint every 2 steps, model.pt at the end
(as examples/own_loop.py writes it), and ways to fail where a test wants it.

    --steps N        optimizer steps
    --step-s S       seconds of sleep per step (a run long enough to signal)
    --fail-at K      rank 1 raises ValueError at step K; 0: right after setup(), before any step
    --batch B        samples per rank and step, split into --grad-accum micro-batches
    --inf-at K       the loss of step K is multiplied by inf (an fp16 overflow: the step is skipped)
    --pids-to DIR    each rank writes DIR/rank<R>.pid (a test signals one rank alone)
    --scale-to FILE  rank 0 writes the gradient scaler's scale right after restore() (a resume's)
    --kill-once-at K rank 1 SIGKILLs itself at step K of the first attempt (torchrun's restart count 0)
    --write-s S      each checkpoint after step 4 takes S seconds more to write (a slow disk)
    --report-first   report(0, loss=0.0) before restore() (an evaluation before training)
"""

import argparse
import os
import signal
import time
from pathlib import Path

import torch
from torch import nn

from ddp_amp import loop
from ddp_amp.files import atomic_write  # a reader never sees the pid file empty


def slow_disk(seconds: float) -> None:
    """The checkpoints after step 4 written `seconds` late, before their first byte (the core's atomic write)."""
    from ddp_amp.checkpoint import storage

    write = storage.atomic_write

    def slow(path, *args, **options):
        if path.suffix == ".pt" and int(path.stem.split("-")[1]) > 4:
            time.sleep(seconds)
        return write(path, *args, **options)

    storage.atomic_write = slow


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--fail-at", type=int, default=-1)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--inf-at", type=int, default=-1)
    parser.add_argument("--pids-to")
    parser.add_argument("--scale-to")
    parser.add_argument("--kill-once-at", type=int, default=-1)
    parser.add_argument("--write-s", type=float, default=0.0)
    parser.add_argument("--report-first", action="store_true")
    args = parser.parse_args()
    if args.write_s:
        slow_disk(args.write_s)
    run = loop.setup(checkpoint_every=2)
    failing = os.environ.get("RANK") == "1"
    if args.pids_to:
        Path(args.pids_to).mkdir(parents=True, exist_ok=True)
        atomic_write(Path(args.pids_to, f"rank{run.rank}.pid"), str(os.getpid()).encode())
    if args.fail_at == 0 and failing:
        raise ValueError("fails before its first step")
    torch.manual_seed(0)
    net = nn.Linear(4, 1)
    model, optimizer = run.prepare(net, torch.optim.SGD(net.parameters(), lr=0.1))
    if args.report_first:
        run.report(0, loss=0.0)
    start = run.restore(model=model, optimizer=optimizer)
    if args.scale_to and run.rank == 0:
        Path(args.scale_to).write_text(repr(run.scaler.get_scale() if run.scaler.is_enabled() else None))
    data = torch.Generator().manual_seed(100 + run.rank)
    inputs, targets = torch.randn(args.batch, 4, generator=data), torch.randn(args.batch, 1, generator=data)
    micro = args.batch // run.grad_accum
    for step in range(start, args.steps):
        if step + 1 == args.fail_at and failing:
            raise ValueError(f"fails at step {step + 1}")
        if step + 1 == args.kill_once_at and failing and os.environ.get("TORCHELASTIC_RESTART_COUNT") == "0":
            os.kill(os.getpid(), signal.SIGKILL)
        for part in range(run.grad_accum):
            with run.autocast(model):
                loss = nn.functional.mse_loss(model(inputs[part * micro:(part + 1) * micro]),
                                              targets[part * micro:(part + 1) * micro])
            run.backward(loss * float("inf") if step + 1 == args.inf_at else loss, model)
        run.step(optimizer)
        run.report(step + 1, loss=loss)
        if run.checkpoint_due(step + 1):
            run.save(step + 1)
        if run.should_stop(step + 1):
            break
        time.sleep(args.step_s)
    weights = run.full_state_dict(model)
    if run.rank == 0 and run.stopped_at is None:
        torch.save(weights, run.run_dir / "model.pt")
    run.finish()


if __name__ == "__main__":
    main()
