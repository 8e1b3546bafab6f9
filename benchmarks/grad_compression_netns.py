"""Gradient compression between two "machines": network namespaces joined by a veth pair that `tc` limits to
--rate (default 1 Gbit/s) each way, one rank each, `ddp-amp multinode`; --grad-compression none vs fp16,
interleaved rounds, medians. Also checks that fp16 compression trains the same: the final loss of each fp16 run
within --loss-tolerance (relative) of the uncompressed run of its round.

    sudo .venv/bin/python benchmarks/grad_compression_netns.py [--repeats 3] [--steps 40] [--rate 1gbit]

Needs root (it creates two network namespaces and a veth pair, and removes them at the end); the traffic stays
inside them. Model: the 1024-4096-1024-1024 regression of benchmarks/tasks.py (38 MB of fp32 gradients per
step), batch 128 per rank, fp32, AdamW.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import spread

HERE = Path(__file__).parent
NAMESPACES = ("ddpbench-a", "ddpbench-b")
ADDRESSES = ("10.78.0.1", "10.78.0.2")


def sh(*command: str) -> None:
    subprocess.run(command, check=True, capture_output=True)


def make_hosts(rate: str) -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover of an interrupted run
        sh("ip", "netns", "add", ns)
    sh("ip", "link", "add", "vddpbench-a", "type", "veth", "peer", "name", "vddpbench-b")
    for ns, address, dev in zip(NAMESPACES, ADDRESSES, ("vddpbench-a", "vddpbench-b")):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{address}/24", "dev", dev)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        # Egress shaping on both ends: each direction of the "wire" carries at most `rate`.
        sh("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate", rate,
           "burst", "512kb", "latency", "50ms")


def remove_hosts() -> None:
    for ns in NAMESPACES:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def run_pair(mode: str, steps: int, port: int, root: Path) -> dict:
    jobs = []
    for index, ns in enumerate(NAMESPACES):
        command = ["ip", "netns", "exec", ns, sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2",
                   "--nproc-per-node", "1", "--endpoint", f"{ADDRESSES[0]}:{port}", "--device", "cpu",
                   "--amp", "off", "--task", f"{HERE / 'tasks.py'}:wide_regression", "--batch-size", "128",
                   "--steps", str(steps), "--grad-compression", mode, "--rdzv-timeout", "60", "--quiet",
                   "--run-dir", str(root / f"{mode}-{port}-{index}")]
        jobs.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    for job in jobs:
        _, err = job.communicate(timeout=1800)
        if job.returncode != 0:
            raise SystemExit(f"a {mode} run failed:\n{err}")
    return json.loads((root / f"{mode}-{port}-0" / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--rate", default="1gbit", help="tc rate of each direction of the link")
    parser.add_argument("--loss-tolerance", type=float, default=0.02)
    args = parser.parse_args()
    if os.geteuid() != 0:
        print("grad_compression_netns.py needs root: it creates network namespaces and shapes them with tc",
              file=sys.stderr)
        raise SystemExit(2)
    make_hosts(args.rate)
    results: dict[str, list[dict]] = {"none": [], "fp16": []}
    port = 29700
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for _ in range(args.repeats):
                for mode in results:  # interleaved
                    port += 1
                    results[mode].append(run_pair(mode, args.steps, port, Path(tmp)))
    finally:
        remove_hosts()
    print(f"two namespaces, veth limited to {args.rate} each way, 1 rank each, {args.steps} steps, "
          f"{args.repeats} rounds")
    for mode, runs in results.items():
        print(f"{mode:<5} samples/s {spread([r['samples_per_s'] for r in runs], '.1f')}  "
              f"final loss {spread([r['final_loss'] for r in runs], '.5f')}")
    ratios = [c["samples_per_s"] / n["samples_per_s"] for n, c in zip(results["none"], results["fp16"])]
    gaps = [abs(c["final_loss"] - n["final_loss"]) / n["final_loss"] for n, c in zip(results["none"], results["fp16"])]
    print(f"fp16/none throughput {spread(ratios, '.2f')} (median of per-round ratios); "
          f"final loss relative gap {spread(gaps, '.4f')} (tolerance {args.loss_tolerance})")
    if max(gaps) > args.loss_tolerance:
        raise SystemExit(f"fp16 compression moved the final loss by {max(gaps):.4f} > {args.loss_tolerance}")
    print(f"median ratio {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
