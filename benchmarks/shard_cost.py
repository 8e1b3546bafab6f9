"""What --shard optimizer (ZeRO-1) and full (FSDP2) buy and cost against none (DDP): the three interleaved,
AdamW, fp32, per launch rank 0's training-state memory (summary.json's peak_memory_mb less baseline_memory_mb),
every rank's optimizer state (optimizer_state_mb) and the throughput, at each --nproc.

The default task is benchmarks/tasks.py's wide regression MLP (1024-4096-1024-1024, 9.4 M parameters) with
512 samples, so that the data set (built with the model, after the baseline) stays out of the figure;
`--task benchmarks/tasks.py:deep_regression` is the same parameter count in nine equal layers, and with
`--task-arg samples=512 --task-arg layers=24` 25 M parameters in 4 MB units (docs/benchmarks.md).

On a CPU the figure is the peak resident set, so it holds what glibc keeps of freed memory too: --shard full
fixes glibc's mmap threshold (parallel/fsdp.return_freed_memory), the other modes keep glibc's default.
`--mmap-threshold BYTES` sets MALLOC_MMAP_THRESHOLD_ for every mode's launches, so that all three are measured
under the same allocator policy and the figure follows the live tensors.

    .venv/bin/python benchmarks/shard_cost.py [--task T] [--task-arg K=V] [--nproc 2 4] [--repeats 3] [--steps 30]
                                              [--mmap-threshold 131072] [--modes none optimizer full]
"""

import argparse
import os
import statistics
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).resolve().parent
MODES = ("none", "optimizer", "full")


def training_state(run: dict) -> float:
    return run["peak_memory_mb"] - run["baseline_memory_mb"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default=f"{HERE / 'tasks.py'}:wide_regression")
    parser.add_argument("--task-arg", action="append", default=None)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the --shard modes to measure; none always runs, the ratios are against it")
    parser.add_argument("--mmap-threshold", type=int, default=None,
                        help="MALLOC_MMAP_THRESHOLD_ for every launch (default: each mode's own policy)")
    args = parser.parse_args()
    env = None if args.mmap_threshold is None else {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(args.mmap_threshold)}
    task_args = args.task_arg if args.task_arg is not None else (
        ["samples=512"] if args.task.endswith("_regression") else [])
    for nproc in args.nproc:
        base = ["spawn", "-n", str(nproc), "--device", "cpu", "--amp", "off", "--optimizer", "adamw", "--task",
                args.task, *(f for arg in task_args for f in ("--task-arg", arg)), "--steps", str(args.steps),
                "--quiet"]
        rows: dict[str, list[dict]] = {mode: [] for mode in ["none", *(m for m in args.modes if m != "none")]}
        with tempfile.TemporaryDirectory() as tmp:
            for repeat in range(args.repeats):
                for mode in rows:  # interleaved: drift on a shared machine hits every mode alike
                    rows[mode].append(run_ddp_amp([*base, "--shard", mode], Path(tmp) / f"{mode}-{repeat}", env))
        print(f"{nproc} ranks:")
        for mode, runs in rows.items():
            state = spread([training_state(r) for r in runs], ".1f")
            shares = [round(v, 1) for v in runs[0]["optimizer_state_mb"]]
            speed = spread([r["samples_per_s"] for r in runs], ".0f")
            print(f"  --shard {mode}: rank 0's training state {state} MB, optimizer state per rank {shares} MB, "
                  f"{speed} samples/s")
        for mode in list(rows)[1:]:
            pairs = list(zip(rows[mode], rows["none"]))
            memory = [training_state(a) / training_state(b) for a, b in pairs]
            speed = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
            largest = statistics.median(max(a["optimizer_state_mb"]) / max(b["optimizer_state_mb"]) for a, b in pairs)
            print(f"  {mode} / none: rank 0's training state {spread(memory, '.3f')}, the largest rank's optimizer "
                  f"state {largest:.3f}, throughput {spread(speed, '.3f')}")


if __name__ == "__main__":
    main()
