"""What validation while training costs: the default task (mlp) with 16384 validation samples, evaluated every
--eval-every steps, on 1 rank and on 2 (each rank a disjoint half), interleaved; per launch the seconds of one
evaluation and the share of the run they took (summary.json's `validation`).

    .venv/bin/python benchmarks/evaluation_cost.py [--repeats 5] [--steps 200] [--eval-every 50]
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--eval-every", type=int, default=50)
    args = parser.parse_args()
    base = ["spawn", "--device", "cpu", "--amp", "off", "--task", f"{HERE / 'tasks.py'}:mlp_validated", "--steps",
            str(args.steps), "--eval-every", str(args.eval_every), "--batch-size", "256", "--quiet"]
    rows: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for ranks in rows:  # interleaved: drift on a shared machine hits both alike
                summary = run_ddp_amp([*base, "-n", str(ranks)], Path(tmp) / f"{ranks}-{repeat}")
                rows[ranks].append(summary["validation"])
    for ranks, runs in rows.items():
        each = spread([r["seconds_each"] for r in runs], ".3f")
        print(f"{ranks} rank(s): {runs[0]['evaluations']} evaluations, each {each} s, "
              f"{spread([100 * r['share_of_run'] for r in runs], '.1f')} % of the training time")
    ratios = [a["seconds_each"] / b["seconds_each"] for a, b in zip(rows[2], rows[1])]
    print(f"2 ranks / 1 rank, seconds per evaluation: {spread(ratios, '.3f')} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
