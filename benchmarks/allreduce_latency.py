"""The latency of one small all-reduce between two local gloo ranks: what an agreement per step or per piece
costs on this machine, and what the flight recorder adds to each collective.

    .venv/bin/python benchmarks/allreduce_latency.py [--count 2000] [--rounds 3]

Each round, interleaved: two ranks run `count` all-reduces of one number (each followed by `.item()`, as an
agreement reads it) with TORCH_FR_BUFFER_SIZE=0 and then 200.
"""

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time

RANK = """
import os, sys, time, torch, torch.distributed as dist
rank, port, count = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
torch.set_num_threads(1)
dist.init_process_group("gloo", rank=rank, world_size=2)
flag = torch.zeros(1)
for _ in range(200):
    dist.all_reduce(flag)
started = time.perf_counter()
for _ in range(count):
    dist.all_reduce(flag)
    flag.item()
if rank == 0:
    print((time.perf_counter() - started) / count * 1e6)
dist.destroy_process_group()
"""


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def latency_us(count: int, buffer: str) -> float:
    port, env = free_port(), {**os.environ, "TORCH_FR_BUFFER_SIZE": buffer}
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(r), port, str(count)], env=env,
                              stdout=subprocess.PIPE, text=True) for r in (0, 1)]
    out = [p.communicate()[0] for p in ranks]
    return float(out[0].strip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    results: dict[str, list[float]] = {"off": [], "recorder": []}
    for _ in range(args.rounds):
        results["off"].append(latency_us(args.count, "0"))
        results["recorder"].append(latency_us(args.count, "200"))
        time.sleep(0.1)
    for mode, values in results.items():
        print(f"{mode:<9} {', '.join(f'{v:.0f}' for v in values)} us per all-reduce (median "
              f"{statistics.median(values):.0f})")


if __name__ == "__main__":
    main()
