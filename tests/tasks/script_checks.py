"""A user's training script for the launch tests: a loop of all-reduces over gloo, and ways to go wrong on one rank.

    --steps N            all-reduces (one per step), printing "rank R step S" after each
    --step-s S           seconds of sleep per step (a job that runs long enough to signal)
    --env-to DIR         write DIR/rank<R>.json: the environment, sys.argv, sys.path[0], cwd, __name__,
                         the start method of its own processes
    --fail-rank R        raise ValueError("rank R fails on purpose") on that rank at --fail-step
    --then-fail-rank R   raise RuntimeError on that rank 50 ms after --fail-rank raised (both ranks fail)
    --leave-rank R       end the script there on that rank (sys.exit(0)): the others' next all-reduce has no peer
    --hang-rank R        sleep for an hour on that rank at --fail-step instead of entering the all-reduce
    --signals-to DIR     on SIGTERM (or SIGUSR1), write DIR/rank<R>.<SIGNAL> and exit 128 + its number
    --slow-save-rank R   with --signals-to: that rank first ignores further stop signals and takes --save-s
    --save-s S           seconds (a checkpoint's write, which outlasts the other ranks' exits)
    --kill-once-rank R   SIGKILL itself on that rank at --fail-step, on the first attempt only (restart count 0)
    --timeout S          the process group's timeout (a hang fails after it)
"""

import argparse
import json
import multiprocessing
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from ddp_amp.files import atomic_write  # a reader never sees the pid file empty


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--step-s", type=float, default=0.0)
    parser.add_argument("--env-to")
    parser.add_argument("--fail-rank", type=int)
    parser.add_argument("--then-fail-rank", type=int)
    parser.add_argument("--hang-rank", type=int)
    parser.add_argument("--leave-rank", type=int)
    parser.add_argument("--kill-once-rank", type=int)
    parser.add_argument("--fail-step", type=int, default=2)
    parser.add_argument("--signals-to")
    parser.add_argument("--slow-save-rank", type=int)
    parser.add_argument("--save-s", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--os-exit", action="store_true", help="leave by os._exit(0) at the end")
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    if args.signals_to:
        def record(signum, frame):
            if rank == args.slow_save_rank:
                signal.signal(signal.SIGTERM, signal.SIG_IGN)
                time.sleep(args.save_s)
            atomic_write(Path(args.signals_to, f"rank{rank}.{signal.Signals(signum).name}"), str(os.getpid()).encode())
            sys.exit(128 + signum)

        signal.signal(signal.SIGTERM, record)
        signal.signal(signal.SIGUSR1, record)
    if args.env_to:
        Path(args.env_to).mkdir(parents=True, exist_ok=True)
        Path(args.env_to, f"rank{rank}.json").write_text(json.dumps({
            "env": dict(os.environ), "argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
            "threads": torch.get_num_threads(), "start_method": multiprocessing.get_start_method()}))
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    total = torch.zeros(1)
    for step in range(args.steps):
        if step == args.fail_step:
            if rank == args.fail_rank:
                raise ValueError(f"rank {rank} fails on purpose")
            if rank == args.then_fail_rank:
                time.sleep(0.05)
                raise RuntimeError(f"rank {rank} fails after the other")
            if rank == args.leave_rank:
                sys.exit(0)
            if rank == args.hang_rank:
                time.sleep(3600)
            if rank == args.kill_once_rank and restart == 0:
                os.kill(os.getpid(), signal.SIGKILL)
        value = torch.ones(1)
        dist.all_reduce(value)
        total += value
        print(f"rank {rank} step {step} sum {total.item():g} restart {restart}", flush=True)
        time.sleep(args.step_s)
    dist.destroy_process_group()
    if args.os_exit:  # as scripts that dodge a slow teardown do: no atexit, no return to the caller
        os._exit(0)


if __name__ == "__main__":
    main()
