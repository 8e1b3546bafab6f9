"""What --micro-batch auto costs on a step that fits: its one flag all-reduce per micro-batch (and the
gradients all-reduced after the backward instead of inside it), against the same run without it,
interleaved, medians. Goal: at most 1%.

    .venv/bin/python benchmarks/micro_batch_auto.py [--repeats 5] [--steps 300] [--task mlp|wide]
        [--batch-size 32] [--nproc 2]

ddp-amp spawn, fp32, gloo, the default options otherwise; `--task wide` is the 1024-4096-1024-1024 regression of
benchmarks/tasks.py.
"""

import argparse
from pathlib import Path

from common import interleaved, print_ratio

HERE = Path(__file__).parent
TASKS = {"mlp": "mlp", "wide": f"{HERE / 'tasks.py'}:wide_regression"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--nproc", type=int, default=2)
    args = parser.parse_args()
    base = ["spawn", "-n", str(args.nproc), "--device", "cpu", "--amp", "off", "--task", TASKS[args.task],
            "--batch-size", str(args.batch_size), "--steps", str(args.steps), "--log-every", str(args.steps),
            "--quiet", "--overwrite"]
    results = interleaved(base, {"auto": ["--micro-batch", "auto"], "none": []}, args.repeats)
    print_ratio(results, "auto", "none")


if __name__ == "__main__":
    main()
