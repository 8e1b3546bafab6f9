"""`ddp-amp --help` wall time (goal < 0.3 s): it must not import torch.

    .venv/bin/python benchmarks/cli_startup.py [--repeats 10]
"""

import argparse
import subprocess
import sys
import time

from common import spread


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    times = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "ddp_amp", "--help"], check=True, capture_output=True)
        times.append(time.perf_counter() - started)
    print(f"ddp-amp --help: {spread(times, '.3f')} s")


if __name__ == "__main__":
    main()
