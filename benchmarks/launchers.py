"""Wall time and time to first step of `ddp-amp spawn` vs `ddp-amp run` (torchrun), interleaved, medians.

    .venv/bin/python benchmarks/launchers.py [--repeats 3] [--nproc 2] [-- extra training flags]

Each launch is a fresh process, as a user starts it; figures come from each run's summary.json
(wall_s and time_to_first_step_s are measured from the launcher's start).
"""

import argparse
import statistics
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread


def launch(launcher: str, nproc: int, run_dir: Path, extra: list[str]) -> dict:
    flag = "--gpus" if launcher == "spawn" else "--nproc-per-node"
    return run_ddp_amp([launcher, flag, str(nproc), "--device", "cpu", *extra], run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="training flags passed to both launchers")
    args = parser.parse_args()
    results: dict[str, list[dict]] = {"spawn": [], "run": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for launcher in ("spawn", "run"):  # interleaved, so machine drift hits both alike
                results[launcher].append(launch(launcher, args.nproc, Path(tmp) / f"{launcher}{repeat}", args.extra))
    print(f"{'launcher':<8} {'wall_s (process)':>18} {'time_to_first_step_s':>22} {'samples/s':>10}"
          "   (median [min-max])")
    for launcher, runs in results.items():
        print(f"{launcher:<8} {spread([r['process_wall_s'] for r in runs]):>18} "
              f"{spread([r['time_to_first_step_s'] for r in runs]):>22} "
              f"{statistics.median(r['samples_per_s'] for r in runs):>10.0f}")


if __name__ == "__main__":
    main()
