"""What --checkpoint-every costs: the transformer task with and without checkpoints, interleaved, medians.

    .venv/bin/python benchmarks/checkpoint_cost.py [--repeats 3] [--steps 120] [--every 20]

Throughput is summary.json's steady-state samples/s (the first 10% of steps excluded), so the checkpoints
inside the measured window are what differs. Goal: the ratio stays within noise of 1 (training waits only for
the copy to host memory; a background thread writes the file).
"""

import argparse

from common import interleaved, print_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--every", type=int, default=20)
    args = parser.parse_args()
    base = ["spawn", "-n", "2", "--device", "cpu", "--task", "transformer", "--steps", str(args.steps),
            "--log-every", "20", "--quiet"]
    modes = {"none": [], "checkpoints": ["--checkpoint-every", str(args.every), "--keep", "2"]}
    sizes = []

    def checkpoint_size(mode, run_dir):
        if mode == "checkpoints":
            sizes.append(max(p.stat().st_size for p in (run_dir / "checkpoints").glob("*.pt")))

    results = interleaved(base, modes, args.repeats, after=checkpoint_size)
    size = max(sizes)
    print(f"transformer, 2 CPU ranks, {args.steps} steps, a checkpoint every {args.every} steps "
          f"({size / 2**20:.1f} MiB each)")
    print_ratio(results, "checkpoints", "none")

if __name__ == "__main__":
    main()
