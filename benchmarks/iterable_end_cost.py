"""What the end agreement of iterable data costs: the default task (mlp) with its training set map-style and
the same items as an iterable data set, interleaved, medians; and, inside each iterable run, the host time the
agreement took (issuing and reading its all-reduces) as a share of the run's step time.

    .venv/bin/python benchmarks/iterable_end_cost.py [--repeats 7] [--steps 300]

The throughput ratio bounds the whole iterable path (the stream read item by item and split per rank, the
batches fetched ahead, the agreement); the in-run share is the agreement's own cost.
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    base = ["spawn", "-n", "2", "--device", "cpu", "--amp", "off", "--steps", str(args.steps), "--batch-size", "8",
            "--quiet"]
    modes = {"map-style": ["--task", "mlp"], "iterable": ["--task", f"{HERE / 'tasks.py'}:mlp_stream"]}
    rows: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for mode, extra in modes.items():  # interleaved: drift on a shared machine hits both alike
                rows[mode].append(run_ddp_amp(base + extra, Path(tmp) / f"{mode}-{repeat}"))
    for mode, runs in rows.items():
        print(f"{mode:<10} samples/s {spread([r['samples_per_s'] for r in runs], '.0f')}")
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(rows["iterable"], rows["map-style"])]
    print(f"iterable / map-style throughput: {spread(ratios, '.3f')} (median {statistics.median(ratios):.3f})")
    # train_s: rank 0's time in the training loop, from its first step to its last
    shares = [r["data_agreement"]["seconds"] / r["train_s"] for r in rows["iterable"] if r.get("train_s")]
    counts = [r["data_agreement"]["count"] for r in rows["iterable"]]
    if shares:
        print(f"agreement: {spread([100 * s for s in shares], '.3f')} % of rank 0's step time, "
              f"{statistics.median(counts):.0f} all-reduces in {args.steps} steps")


if __name__ == "__main__":
    main()
