"""A script's loop through ddp_amp.loop for the tests: which samples each rank trains on. A data set of N
indices, `--batch` per rank; each rank appends the indices of every step's batch to OUT/w<world size>-r<rank>.txt
(one line per step). The run ends at --steps, or (--to-epoch-end) at the end of the first epoch, whatever the world
size; a checkpoint at --checkpoint-every (given on the command line) and at the end.

    python loop_samples.py --out DIR [--size N] [--batch B] [--steps K | --to-epoch-end] [--no-finish]
                           [--async-save] [--file-size-limit BYTES] [--hold-last-step DIR] [--exit CODE|MESSAGE]

--no-finish: the script ends without run.finish() (a mistake ddp_amp.loop names); --async-save: setup's default
of background checkpoint writes; --file-size-limit: RLIMIT_FSIZE after setup(), so that a checkpoint write
fails as on a full disk (EFBIG), where the loop's small files still fit; --hold-last-step: in the last step each
rank writes DIR/rank<R>.holding and waits for a stop signal to reach it (a stop that lands in the last step);
--exit: after the loop, without finish(), sys.exit(CODE) for a number, else raise SystemExit(MESSAGE).
"""

import argparse
import resource
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ddp_amp import loop


class Indices(torch.utils.data.Dataset):
    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor(index)


def hold_for_a_stop(where: Path, rank: int) -> None:
    """Says this rank is in its last step, then waits (60 s at most) for the stop signal the test sends."""
    from ddp_amp.files import atomic_write
    from ddp_amp.rank.signals import STOP_REQUEST

    where.mkdir(parents=True, exist_ok=True)
    atomic_write(where / f"rank{rank}.holding", b"")
    deadline = time.monotonic() + 60
    while not STOP_REQUEST.signum and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--size", type=int, default=96)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--steps", type=int, default=0)
    parser.add_argument("--to-epoch-end", action="store_true")
    parser.add_argument("--no-finish", action="store_true")
    parser.add_argument("--async-save", action="store_true")
    parser.add_argument("--file-size-limit", type=int, default=0)
    parser.add_argument("--hold-last-step")
    parser.add_argument("--exit")
    args = parser.parse_args()
    run = loop.setup(**({"async_checkpoint": True} if args.async_save else {}))
    if args.file_size_limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write gets EFBIG instead of the process dying
        resource.setrlimit(resource.RLIMIT_FSIZE, (args.file_size_limit, args.file_size_limit))
    torch.manual_seed(0)
    net = nn.Linear(1, 1)
    model, optimizer = run.prepare(net, torch.optim.SGD(net.parameters(), lr=0.01))
    data = run.loader(Indices(args.size), batch_size=args.batch)
    start = run.restore(model=model, optimizer=optimizer, data=data)
    total = start + data.remaining_batches(1) if args.to_epoch_end else args.steps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"w{run.world_size}-r{run.rank}.txt", "a") as seen:
        for step in run.steps(total):
            for batch in run.accumulate(model, data):
                with run.autocast():
                    loss = model(batch.float().unsqueeze(1) / args.size).pow(2).mean()
                run.backward(loss)
                print(" ".join(str(int(index)) for index in batch), file=seen, flush=True)
            run.step(optimizer)
            run.log(loss=loss)
            if args.hold_last_step and step + 1 == total:
                hold_for_a_stop(Path(args.hold_last_step), run.rank)
    if run.stopped_at is None:
        run.save(total)
    if args.exit is not None:
        if args.exit.isdigit():
            sys.exit(int(args.exit))
        raise SystemExit(args.exit)
    if not args.no_finish:
        run.finish()


if __name__ == "__main__":
    main()
