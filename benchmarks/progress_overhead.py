"""What progress reporting costs: `spawn` with plain per-rank lines vs `--quiet`, interleaved, medians.

    .venv/bin/python benchmarks/progress_overhead.py [--repeats 5] [--steps 400]

Both send the same events (--quiet only stops printing them), so this measures the display side;
the worker side is a few small socket writes per log interval. Goal: ratio >= 0.99.
"""

import argparse

from common import interleaved, print_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    base = ["spawn", "-n", "2", "--device", "cpu", "--steps", str(args.steps), "--log-every", "10"]
    modes = {"plain": ["--log-format", "plain"], "quiet": ["--quiet"]}
    results = interleaved(base, modes, args.repeats)
    print_ratio(results, "plain", "quiet")

if __name__ == "__main__":
    main()
