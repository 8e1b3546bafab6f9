"""What --shard optimizer (ZeRO-1) buys and costs: --shard none and optimizer interleaved, AdamW, fp32, per launch
rank 0's training-state memory (summary.json's peak_memory_mb less baseline_memory_mb), every rank's optimizer
state (optimizer_state_mb) and the throughput.

    .venv/bin/python benchmarks/shard_cost.py [--task transformer] [--nproc 2] [--repeats 3] [--steps 40]
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--task", default="transformer")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    base = ["spawn", "-n", str(args.nproc), "--device", "cpu", "--amp", "off", "--optimizer", "adamw", "--task",
            args.task, "--steps", str(args.steps), "--quiet"]
    rows: dict[str, list[dict]] = {"none": [], "optimizer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode in rows:  # interleaved: drift on a shared machine hits both alike
                rows[mode].append(run_ddp_amp([*base, "--shard", mode], Path(tmp) / f"{mode}-{repeat}"))
    for mode, runs in rows.items():
        state = spread([r["peak_memory_mb"] - r["baseline_memory_mb"] for r in runs], ".1f")
        shares = [round(v, 1) for v in runs[0]["optimizer_state_mb"]]
        speed = spread([r["samples_per_s"] for r in runs], ".0f")
        print(f"--shard {mode}: rank 0's training state {state} MB, optimizer state per rank {shares} MB, "
              f"{speed} samples/s")
    pairs = list(zip(rows["optimizer"], rows["none"]))
    memory = [(a["peak_memory_mb"] - a["baseline_memory_mb"]) / (b["peak_memory_mb"] - b["baseline_memory_mb"])
              for a, b in pairs]
    speed = [a["samples_per_s"] / b["samples_per_s"] for a, b in pairs]
    largest = statistics.median(max(a["optimizer_state_mb"]) / max(b["optimizer_state_mb"]) for a, b in pairs)
    print(f"optimizer / none: rank 0's training state {spread(memory, '.3f')}, the largest rank's optimizer state "
          f"{largest:.3f}, throughput {spread(speed, '.3f')}")

if __name__ == "__main__":
    main()
