"""What --tracker costs a run: `spawn` of the mlp task with --log-every 10, without a tracker, with MLflow (a real
tracking server on loopback, SQLite backend, started here) and with W&B in offline mode, interleaved.

    .venv/bin/python benchmarks/tracker_cost.py [--repeats 5] [--steps 400]

Figures per interleaved round, against the run without a tracker: the training throughput (summary.json's
samples/s: the loop, where a tracker's cost per log step would show) and the launch's wall time (which also holds
the tracker run's opening and the end's flush and file upload). Goal (issue #47): >= 0.99 throughput at
--log-every 10.
"""

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import run_ddp_amp, spread


def start_mlflow(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1",
                               "--port", str(port), "--workers", "1", "--backend-store-uri",
                               f"sqlite:///{root / 'runs.db'}", "--default-artifact-root", str(root / "artifacts")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                              env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{uri}/health", timeout=2):
                return server, uri
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise RuntimeError("the MLflow server did not start") from None
            time.sleep(0.3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=400)
    args = parser.parse_args()
    base = ["spawn", "-n", "2", "--device", "cpu", "--task", "mlp", "--steps", str(args.steps), "--log-every", "10",
            "--quiet"]
    with tempfile.TemporaryDirectory() as tmp:
        server, uri = start_mlflow(Path(tmp))
        modes = {"none": ([], {}), "mlflow": (["--tracker", "mlflow"], {"MLFLOW_TRACKING_URI": uri}),
                 "wandb": (["--tracker", "wandb"], {"WANDB_MODE": "offline"})}
        figures: dict[str, dict[str, list[float]]] = {mode: {"samples_per_s": [], "wall_s": [], "thread_share": [],
                                                             "machine_cpu_s": []} for mode in modes}
        try:
            for repeat in range(args.repeats):
                for mode, (flags, env) in modes.items():
                    summary = run_ddp_amp(base + flags, Path(tmp) / f"{mode}{repeat}", env={**os.environ, **env})
                    if mode != "none":
                        sent = summary["trackers"][mode]
                        assert sent["unsent_steps"] == 0 and sent["sent_steps"] > 0, sent
                        # The trackers' thread's CPU time against the training loop's wall time on rank 0.
                        figures[mode]["thread_share"].append(sent["sending_cpu_s"] / summary["train_s"])
                        figures[mode].setdefault("thread_cpu_s", []).append(sent["thread_cpu_s"])
                    figures[mode]["machine_cpu_s"].append(summary["machine_cpu_s"])
                    figures[mode]["samples_per_s"].append(summary["samples_per_s"])
                    figures[mode]["wall_s"].append(summary["process_wall_s"])
        finally:
            os.killpg(server.pid, signal.SIGKILL)
    print(f"{args.repeats} interleaved rounds, {args.steps} steps at --log-every 10, 2 ranks, mlp task")
    for mode in modes:
        print(f"{mode:<7} throughput {spread(figures[mode]['samples_per_s'], '.0f')} samples/s, launch wall "
              f"{spread(figures[mode]['wall_s'])} s")
    for mode in ("mlflow", "wandb"):
        speed = [a / b for a, b in zip(figures[mode]["samples_per_s"], figures["none"]["samples_per_s"])]
        wall = [a / b for a, b in zip(figures[mode]["wall_s"], figures["none"]["wall_s"])]
        cpu = [a - b for a, b in zip(figures[mode]["machine_cpu_s"], figures["none"]["machine_cpu_s"])]
        share = spread(figures[mode]["thread_share"], ".4f")
        print(f"{mode}/none: throughput {spread(speed, '.3f')}, launch wall {spread(wall, '.3f')} (per round); the "
              f"trackers' thread's CPU while the loop ran, over the loop's time on rank 0: {share} (in all, import, "
              f"opening and uploads included: {spread(figures[mode]['thread_cpu_s'])} s); the machine's CPU seconds "
              f"more per launch: {spread(cpu, '.1f')} (the MLflow server's included)")


if __name__ == "__main__":
    main()
