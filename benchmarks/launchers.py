"""Wall time and time to first step of `ddp-amp spawn` vs `ddp-amp run` vs `ddp-amp multinode` (two nodes on
loopback, one rank each; and one node with every rank, `multinode-1`), interleaved, medians.

    .venv/bin/python benchmarks/launchers.py [--repeats 3] [--nproc 2] [-- extra training flags]

Each launch is a fresh process (two for multinode), as a user starts it; figures come from each run's
summary.json (wall_s and time_to_first_step_s are measured from the launcher's start; multinode: node 0's).
Goal: run and multinode reach the first step within 1.15x of spawn's time (median of per-round ratios).
"""

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import run_ddp_amp, spread


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multinode(nproc: int, run_dir: Path, extra: list[str], nodes: int = 2) -> dict:
    """`nodes` "nodes" on this machine, `nproc // nodes` ranks each, through the c10d store on loopback."""
    import json

    started = time.perf_counter()
    port = free_port()
    jobs = [subprocess.Popen([sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", str(nodes),
                              "--nproc-per-node", str(max(1, nproc // nodes)), "--endpoint", f"127.0.0.1:{port}",
                              "--device", "cpu", *extra, "--run-dir", str(run_dir / f"node{index}")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True) for index in range(nodes)]
    for job in jobs:
        _, err = job.communicate(timeout=600)
        if job.returncode != 0:
            raise SystemExit(f"multinode failed:\n{err}")
    summary = json.loads((run_dir / "node0" / "summary.json").read_text())
    summary["process_wall_s"] = time.perf_counter() - started
    return summary


def launch(launcher: str, nproc: int, run_dir: Path, extra: list[str]) -> dict:
    if launcher == "multinode":
        return multinode(nproc, run_dir, extra)
    if launcher == "multinode-1":  # one node's path alone: what each machine of a real cluster runs
        return multinode(nproc, run_dir, extra, nodes=1)
    flag = "--gpus" if launcher == "spawn" else "--nproc-per-node"
    return run_ddp_amp([launcher, flag, str(nproc), "--device", "cpu", *extra], run_dir)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("extra", nargs="*", help="training flags passed to every launcher")
    args = parser.parse_args()
    launchers = ("spawn", "run", "multinode", "multinode-1")
    results: dict[str, list[dict]] = {launcher: [] for launcher in launchers}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for launcher in launchers:  # interleaved, so machine drift hits all alike
                results[launcher].append(launch(launcher, args.nproc, Path(tmp) / f"{launcher}{repeat}", args.extra))
    print(f"{'launcher':<10} {'wall_s (process)':>18} {'time_to_first_step_s':>22} {'samples/s':>10}"
          "   (median [min-max])")
    for launcher, runs in results.items():
        print(f"{launcher:<10} {spread([r['process_wall_s'] for r in runs]):>18} "
              f"{spread([r['time_to_first_step_s'] for r in runs]):>22} "
              f"{statistics.median(r['samples_per_s'] for r in runs):>10.0f}")
    for launcher in launchers[1:]:
        ratios = [r["time_to_first_step_s"] / s["time_to_first_step_s"]
                  for r, s in zip(results[launcher], results["spawn"])]
        print(f"{launcher}/spawn time to first step: {spread(ratios)} (goal <= 1.15)")


if __name__ == "__main__":
    main()
