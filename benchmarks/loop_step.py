"""ddp_amp.loop's step against ddp-amp's own loop on the peer model (1024-4096-1024-1024 MLP, AdamW fused, batch
128 per rank, fp32, 2 CPU ranks), interleaved rounds, medians of the per-round ratios:

    .venv/bin/python benchmarks/loop_step.py [--repeats 3] [--nproc 2] [--steps 60]

1. Throughput: the loop script's samples/s (its silent steps after warm-up: every rank's batch over the median step)
   against the core's summary.json samples/s (goal: >= 0.95).
2. report() every step: the median reporting step against the median silent one within each run (goal: <= 1%).
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

HERE = Path(__file__).resolve().parent


def loop_run(nproc: int, steps: int, batch: int, work: Path) -> dict:
    out = work / f"loop-{time.monotonic_ns()}.json"
    subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", str(nproc), "--amp", "off", "--quiet",
                    "--run-dir", str(work / f"loop-run-{time.monotonic_ns()}"), str(HERE / "loop_step_script.py"),
                    "--steps", str(steps), "--batch-size", str(batch), "--out", str(out)],
                   check=True, capture_output=True, cwd=HERE)
    found = json.loads(out.read_text())
    silent, reporting = statistics.median(found["silent_step_s"]), statistics.median(found["reporting_step_s"])
    return {"samples_per_s": nproc * batch / silent, "report_cost": reporting / silent - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=128)
    args = parser.parse_args()
    loops, cores = [], []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for repeat in range(args.repeats):
            loops.append(loop_run(args.nproc, args.steps, args.batch_size, work))
            cores.append(run_ddp_amp(["spawn", "-n", str(args.nproc), "--device", "cpu", "--amp", "off", "--steps",
                                      str(args.steps), "--task", f"{HERE / 'tasks.py'}:wide_regression",
                                      "--batch-size", str(args.batch_size), "--quiet"], work / f"core-{repeat}"))
    ratios = [a["samples_per_s"] / b["samples_per_s"] for a, b in zip(loops, cores)]
    print(f"peer MLP, batch {args.batch_size} per rank, {args.nproc} ranks, {args.steps} steps, {args.repeats} "
          "interleaved rounds (median [min-max])")
    print(f"  ddp_amp.loop   samples/s {spread([r['samples_per_s'] for r in loops], '.0f')}")
    print(f"  ddp-amp's loop samples/s {spread([r['samples_per_s'] for r in cores], '.0f')}")
    print(f"  loop / core: {spread(ratios, '.3f')}; report() every step costs "
          f"{spread([100 * r['report_cost'] for r in loops], '.2f')} % of a step")


if __name__ == "__main__":
    main()
