"""What --shard optimizer's step adds on gloo: two local ranks time (medians of `--repeats`) the broadcasts
that end ZeroRedundancyOptimizer's step on the wide MLP (each rank's flat parameter bucket: 20 and 18 MB) against
DDP's all-reduce of its 38 MB gradient, one thread per rank.

    .venv/bin/python benchmarks/zero_broadcast.py [--repeats 12]
"""

import argparse
import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

MB = 2**20 // 4  # fp32 elements per MB
BUCKETS_MB = (20, 18)
"""Rank 0's and rank 1's buckets: the 1024x4096 matrix and a bias on one, the 4096x1024 and 1024x1024 on the other."""


def rank_main(rank: int, port: int, repeats: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    buckets = [torch.randn(size * MB) for size in BUCKETS_MB]
    gradient = torch.randn(sum(BUCKETS_MB) * MB)

    def broadcasts() -> None:
        for handle in [dist.broadcast(bucket, owner, async_op=True) for owner, bucket in enumerate(buckets)]:
            handle.wait()

    for name, collective in (("broadcast of each rank's bucket", broadcasts),
                             ("all-reduce of the gradient", lambda: dist.all_reduce(gradient))):
        times = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            collective()
            times.append(time.perf_counter() - start)
        if rank == 0:
            print(f"{name}: {statistics.median(times) * 1000:.1f} ms [{min(times) * 1000:.1f}-"
                  f"{max(times) * 1000:.1f}]", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(rank_main, args=(port, args.repeats), nprocs=2)


if __name__ == "__main__":
    main()
