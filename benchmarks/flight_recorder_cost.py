"""What torch's flight recorder costs on every run: TORCH_FR_BUFFER_SIZE=200 (the default ddp-amp sets) against
0 (off), interleaved launches, medians.

    .venv/bin/python benchmarks/flight_recorder_cost.py [--repeats 5] [--steps 300] [--task mlp|wide]

ddp-amp spawn, 2 ranks, fp32, gloo; `--task wide` is the 1024-4096-1024-1024 regression of benchmarks/tasks.py
(batch 128). The figure is rank samples/s per interleaved pair.
"""

import argparse
from pathlib import Path

from common import interleaved, print_ratio

HERE = Path(__file__).parent
TASKS = {"mlp": ("mlp", "32"), "wide": (f"{HERE / 'tasks.py'}:wide_regression", "128")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--task", choices=sorted(TASKS), default="mlp")
    args = parser.parse_args()
    task, batch = TASKS[args.task]
    base = ["spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--task", task, "--batch-size", batch,
            "--steps", str(args.steps), "--log-every", str(args.steps), "--quiet", "--overwrite"]
    results = interleaved(base, {"recorder": [], "off": []}, args.repeats,
                          envs={"recorder": {"TORCH_FR_BUFFER_SIZE": "200"}, "off": {"TORCH_FR_BUFFER_SIZE": "0"}})
    print_ratio(results, "recorder", "off")


if __name__ == "__main__":
    main()
