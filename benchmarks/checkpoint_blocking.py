"""How long a checkpoint blocks training: a 25 M-parameter MLP whose checkpoint (weights and AdamW's moments) is
about 300 MB, 2 CPU ranks, a save every few steps, in each --checkpoint-format (single: gathered on rank 0, one
file; sharded: a DCP directory, each rank writing its part). Per launch, summary.json's mean seconds the loop
was blocked per save; --async-checkpoint (the default: the loop waits while the state is copied to host memory,
and for the previous write if it is still going) and --no-async-checkpoint (the loop writes it) interleaved in
each repeat, and their ratio per repeat.

    .venv/bin/python benchmarks/checkpoint_blocking.py [--repeats 3] [--steps 40] [--every 20] \
        [--formats single sharded]
"""

import argparse
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent


def size_mb(path: Path) -> float:
    files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return sum(p.stat().st_size for p in files) / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=20)
    parser.add_argument("--formats", nargs="+", default=["single", "sharded"], choices=["single", "sharded"])
    args = parser.parse_args()
    command = ["spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--task", f"{HERE / 'tasks.py'}:big_regression",
               "--batch-size", "32", "--steps", str(args.steps), "--checkpoint-every", str(args.every), "--keep", "2",
               "--quiet"]
    runs = {(fmt, mode): [] for fmt in args.formats for mode in ("async", "sync")}
    sizes = {fmt: [] for fmt in args.formats}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for fmt in args.formats:
                for mode, flag in (("async", "--async-checkpoint"), ("sync", "--no-async-checkpoint")):
                    run_dir = Path(tmp) / f"{fmt}-{mode}-{repeat}"
                    runs[fmt, mode].append(run_ddp_amp([*command, "--checkpoint-format", fmt, flag], run_dir))
                    sizes[fmt].append(max(size_mb(p) for p in (run_dir / "checkpoints").glob("step-*")
                                          if p.suffix != ".json"))
    for fmt in args.formats:
        background, synchronous = runs[fmt, "async"], runs[fmt, "sync"]
        blocked = [r["checkpoint_blocked_s"] for r in background]
        sync_blocked = [r["checkpoint_blocked_s"] for r in synchronous]
        written = [r["checkpoint_write_s"] for r in background]
        print(f"{fmt}: checkpoint {spread(sizes[fmt], '.0f')} MB; --async-checkpoint blocked the loop "
              f"{spread(blocked, '.3f')} s per save (most {max(r['checkpoint_blocked_max_s'] for r in background):.3f}"
              f" s, {sum(r['checkpoint_waits'] for r in background)} waits for a previous write; the background "
              f"write {spread(written, '.3f')} s), --no-async-checkpoint {spread(sync_blocked, '.3f')} s")
        ratios = [a / s for a, s in zip(blocked, sync_blocked)]
        print(f"{fmt}: blocked, async / sync, per repeat: {spread(ratios, '.3f')}")


if __name__ == "__main__":
    main()
