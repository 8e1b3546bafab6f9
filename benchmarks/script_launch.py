"""A user's script launched by ddp-amp against torchrun, and what capturing its output costs; interleaved rounds,
medians of the per-round ratios.

    .venv/bin/python benchmarks/script_launch.py [--repeats 5] [--nproc 2] [--steps 300]

1. Time to the script's first step, from the launching command's start: `ddp-amp run -n N script.py` against
   `torchrun --standalone --nproc-per-node N script.py` (goal: ratio <= 1.0).
2. The output capture's cost per line: the same script under `ddp-amp run`, printing a line every step or not
   at all; the difference of the mean step times, as a share of the step (goal: <= 2%). torchrun printing to a
   pipe is shown beside it.
The script is benchmarks/script_step.py (DDP over an MLP, AdamW, batch 64 per rank, CPU ranks).
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import spread

SCRIPT = Path(__file__).resolve().parent / "script_step.py"


def launch(runner: str, nproc: int, steps: int, printing: bool, work: Path) -> dict:
    out = work / f"{runner}-{time.monotonic_ns()}.json"
    script = [str(SCRIPT), "--steps", str(steps), "--out", str(out), *(["--print"] if printing else [])]
    if runner == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    else:
        command = [sys.executable, "-m", "ddp_amp", "run", "-n", str(nproc), "--log-format", "plain",
                   "--run-dir", str(work / f"run-{time.monotonic_ns()}")]
    started = time.time()
    result = subprocess.run([*command, *script], capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{runner} failed:\n{result.stderr[-3000:]}")
    measured = json.loads(out.read_text())
    return {"first_step_s": measured["first_step_at"] - started, "step_s": measured["mean_step_s"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    modes = {"ddp-amp run": ("ddp-amp", False), "torchrun": ("torchrun", False),
             "ddp-amp run, a line per step": ("ddp-amp", True), "torchrun, a line per step": ("torchrun", True)}
    figures: dict[str, list[dict]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            for mode, (runner, printing) in modes.items():
                figures[mode].append(launch(runner, args.nproc, args.steps, printing, Path(work)))
    print(f"{args.nproc} ranks, {args.steps} steps, {args.repeats} interleaved rounds (median [min-max])")
    for mode, runs in figures.items():
        print(f"{mode:30s} first step {spread([r['first_step_s'] for r in runs])} s   "
              f"step {spread([r['step_s'] * 1e3 for r in runs])} ms")
    first = [a["first_step_s"] / b["first_step_s"] for a, b in zip(figures["ddp-amp run"], figures["torchrun"])]
    print(f"time to first step, ddp-amp run / torchrun: {spread(first)} (goal <= 1.0)")
    for runner in ("ddp-amp run", "torchrun"):
        cost = [(a["step_s"] - b["step_s"]) / b["step_s"] * 100
                for a, b in zip(figures[f"{runner}, a line per step"], figures[runner])]
        print(f"{runner}: a line per step costs {spread(cost, '+.2f')} % of the step "
              f"(goal for ddp-amp's capture <= 2%)")
    plain = statistics.median(r["step_s"] for r in figures["ddp-amp run"])
    print(f"median step without printing: {plain * 1e3:.2f} ms")


if __name__ == "__main__":
    main()
