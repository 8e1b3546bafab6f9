"""A user's script launched by ddp-amp against torchrun, and what capturing its output costs; interleaved rounds,
medians of the per-round ratios.

    .venv/bin/python benchmarks/script_launch.py [--repeats 5] [--nproc 2] [--steps 300]

1. Time to the script's first step, from the launching command's start: `ddp-amp run -n N script.py` against
   `torchrun --standalone --nproc-per-node N script.py` (goal: ratio <= 1.0).
2. The output capture's cost per line: the script's steps alternate, in blocks, between printing a line each and
   printing nothing; within each run, the median printing step against the median silent one (the same
   processes, so no run-to-run noise), as a share of the step. Printing costs something under any launcher; the
   capture's cost is ddp-amp's figure less torchrun's (its workers write to the pipe themselves), per round
   (goal: <= 2%).
The script is benchmarks/script_step.py (DDP over an MLP, AdamW, batch 64 per rank, CPU ranks).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import spread

SCRIPT = Path(__file__).resolve().parent / "script_step.py"


def launch(runner: str, nproc: int, steps: int, work: Path) -> dict:
    out = work / f"{runner}-{time.monotonic_ns()}.json"
    script = [str(SCRIPT), "--steps", str(steps), "--out", str(out)]
    if runner == "torchrun":
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    else:
        command = [sys.executable, "-m", "ddp_amp", "run", "-n", str(nproc), "--log-format", "plain",
                   "--run-dir", str(work / f"run-{time.monotonic_ns()}")]
    started = time.time()
    # Both in TMPDIR=work, which goes at the end: torchrun leaves its log directories (torchelastic_*) there.
    result = subprocess.run([*command, *script], capture_output=True, text=True,
                            env={**os.environ, "TMPDIR": str(work)})
    if result.returncode != 0:
        raise SystemExit(f"{runner} failed:\n{result.stderr[-3000:]}")
    measured = json.loads(out.read_text())
    return {"first_step_s": measured["first_step_at"] - started, "step_s": measured["silent_step_s"],
            "line_cost": measured["printing_step_s"] / measured["silent_step_s"] - 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    figures: dict[str, list[dict]] = {"ddp-amp run": [], "torchrun": []}
    with tempfile.TemporaryDirectory() as work:
        for _ in range(args.repeats):
            for runner in figures:
                figures[runner].append(launch(runner.split()[0], args.nproc, args.steps, Path(work)))
    print(f"{args.nproc} ranks, {args.steps} steps, {args.repeats} interleaved rounds (median [min-max])")
    for runner, runs in figures.items():
        print(f"{runner:12s} first step {spread([r['first_step_s'] for r in runs])} s   silent step "
              f"{spread([r['step_s'] * 1e3 for r in runs])} ms   a line per step costs "
              f"{spread([r['line_cost'] * 100 for r in runs], '+.2f')} % of the step")
    first = [a["first_step_s"] / b["first_step_s"] for a, b in zip(figures["ddp-amp run"], figures["torchrun"])]
    print(f"time to first step, ddp-amp run / torchrun: {spread(first)} (goal <= 1.0)")
    # Printing costs something under any launcher (the line, the write); the capture's own cost is what printing
    # costs under ddp-amp beyond what it costs with torchrun's workers writing to a pipe themselves.
    extra = [(a["line_cost"] - b["line_cost"]) * 100 for a, b in zip(figures["ddp-amp run"], figures["torchrun"])]
    print(f"ddp-amp's output capture, beyond a plain pipe: {spread(extra, '+.2f')} % of a step per line "
          "(goal <= 2%)")


if __name__ == "__main__":
    main()
