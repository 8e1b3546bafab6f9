"""This working tree's ddp-amp against an earlier revision's (default HEAD), interleaved, medians: the
throughput of the training core, the time to the first step, and a whole launch's wall time and CPU seconds (every
process it starts; the machine's /proc/stat), on the built-in mlp task and the wide MLP.

    .venv/bin/python benchmarks/against_revision.py [--base REV] [--repeats 5] [--nproc 2] [--tasks mlp wide]
        [--flags "--amp on --dtype bf16-true"]

The earlier revision's src/ is exported with `git archive`; each side's src/ is put first on PYTHONPATH for its
launches (the ranks inherit it), so both run in the same interpreter and virtual environment. For a change that must not
cost speed (a refactor, an extra collective): the ratio's median should sit at 1.00 within the spread.
"""

import argparse
import os
import statistics
import subprocess
import tarfile
import tempfile
from pathlib import Path

from common import run_ddp_amp, spread

HERE = Path(__file__).parent
TASKS = {"mlp": ("mlp", 32, 300), "wide": (f"{HERE / 'tasks.py'}:wide_regression", 128, 60)}
"""--tasks: spec, batch per rank, optimizer steps (as make bench runs core_overhead.py)."""


def export_src(rev: str, into: Path) -> Path:
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(HERE.parent), "archive", rev, "src"], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", default="HEAD")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--tasks", nargs="+", choices=sorted(TASKS), default=sorted(TASKS))
    parser.add_argument("--flags", default="--amp off", help="every launch's precision flags (default: --amp off; "
                        "e.g. \"--amp on --dtype bf16-true\")")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        base_src = export_src(args.base, Path(tmp))
        envs = {"this tree": {**os.environ, "PYTHONPATH": str(HERE.parent / "src")},
                args.base: {**os.environ, "PYTHONPATH": str(base_src)}}
        for task in args.tasks:
            spec, batch, steps = TASKS[task]
            rows: dict[str, list[dict]] = {name: [] for name in envs}
            for repeat in range(args.repeats):
                for name, env in envs.items():  # interleaved: drift on a shared machine hits both alike
                    rows[name].append(run_ddp_amp(
                        ["spawn", "-n", str(args.nproc), "--device", "cpu", *args.flags.split(), "--steps",
                         str(steps), "--task", spec, "--batch-size", str(batch), "--quiet"],
                        Path(tmp) / f"{task}-{repeat}-{name.replace(' ', '_')}", env=env))
            print(f"task {task}, batch {batch} per rank, {args.nproc} ranks, {steps} steps, {args.repeats} rounds")
            for name, runs in rows.items():
                print(f"  {name:<10} samples/s {spread([r['samples_per_s'] for r in runs], '.0f'):>22}   first step s "
                      f"{spread([r['time_to_first_step_s'] for r in runs])}   launch wall s "
                      f"{spread([r['process_wall_s'] for r in runs])}   launch CPU s "
                      f"{spread([r['machine_cpu_s'] for r in runs])}")
            ratios = {key: [a[key] / b[key] for a, b in zip(rows["this tree"], rows[args.base])]
                      for key in ("samples_per_s", "time_to_first_step_s", "process_wall_s", "machine_cpu_s")}
            print(f"  this tree / {args.base}: throughput {spread(ratios['samples_per_s'], '.3f')} (median "
                  f"{statistics.median(ratios['samples_per_s']):.3f}), time to first step "
                  f"{spread(ratios['time_to_first_step_s'], '.3f')}, launch wall "
                  f"{spread(ratios['process_wall_s'], '.3f')}, launch CPU {spread(ratios['machine_cpu_s'], '.3f')}")

if __name__ == "__main__":
    main()
