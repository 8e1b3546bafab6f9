"""ddp-amp vs a minimal hand-written DDP script (benchmarks/handwritten.py): throughput of the training core
and time to first step / to exit of the launcher, interleaved runs, medians.

    .venv/bin/python benchmarks/core_overhead.py [--repeats 3] [--steps 300] [--nproc 2 4] [--task mlp|wide]
        [--batch-size 32]

Same model, data, batch per rank, AdamW + cosine, fp32, gloo, cores/ranks threads; ddp-amp with its defaults
(fused AdamW, gradients as bucket views), the hand-written loop with torch's.
--task mlp: the default mlp task; wide: the 1024-4096-1024-1024 regression of benchmarks/tasks.py.
Goals: throughput ratio >= 1.2 on wide (batch 128), >= 1.0 on mlp; time to first step <= 0.8x the plain
script's at 2 ranks and <= 0.5x at 4.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent


TASK_SPECS = {"mlp": "mlp", "wide": f"{HERE / 'tasks.py'}:wide_regression"}


def handwritten(nproc: int, steps: int, out: Path, task: str, batch_size: int) -> dict:
    started = time.perf_counter()
    subprocess.run([sys.executable, str(HERE / "handwritten.py"), "--nproc", str(nproc), "--steps", str(steps),
                    "--task", task, "--batch-size", str(batch_size), "--out", str(out)], check=True,
                   capture_output=True)
    result = json.loads(out.read_text())
    result["process_wall_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--nproc", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--task", choices=sorted(TASK_SPECS), default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    print(f"task {args.task}, batch {args.batch_size} per rank, {args.steps} steps, {args.repeats} rounds")
    print(f"{'ranks':<6} {'runner':<12} {'samples/s':>22} {'first step s':>20} {'exit s':>20}  median [min-max]")
    with tempfile.TemporaryDirectory() as tmp:
        for nproc in args.nproc:
            rows: dict[str, list[dict]] = {"ddp-amp": [], "hand-written": []}
            for repeat in range(args.repeats):  # interleaved
                rows["ddp-amp"].append(run_ddp_amp(
                    ["spawn", "-n", str(nproc), "--device", "cpu", "--amp", "off", "--steps", str(args.steps),
                     "--schedule", "cosine", "--min-lr-ratio", "0", "--task", TASK_SPECS[args.task],
                     "--batch-size", str(args.batch_size), "--quiet"], Path(tmp) / f"a{nproc}-{repeat}"))
                rows["hand-written"].append(handwritten(nproc, args.steps, Path(tmp) / f"h{nproc}-{repeat}.json",
                                                        args.task, args.batch_size))
            for runner, runs in rows.items():
                print(f"{nproc:<6} {runner:<12} {spread([r['samples_per_s'] for r in runs], '.0f'):>22} "
                      f"{spread([r['time_to_first_step_s'] for r in runs]):>20} "
                      f"{spread([r['process_wall_s'] for r in runs]):>20}")
            ratio = [a["samples_per_s"] / h["samples_per_s"] for a, h in zip(rows["ddp-amp"], rows["hand-written"])]
            first = [a["time_to_first_step_s"] / h["time_to_first_step_s"]
                     for a, h in zip(rows["ddp-amp"], rows["hand-written"])]
            print(f"{nproc:<6} ddp-amp/hand-written: throughput {spread(ratio, '.3f')} (median of per-round ratios), "
                  f"time to first step {spread(first, '.2f')} (median {statistics.median(first):.2f})")


if __name__ == "__main__":
    main()
