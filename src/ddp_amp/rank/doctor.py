"""`ddp-amp doctor`, a rank's side: what this rank and its links can do, measured in seconds on the job's own
backend before a long job, gathered on rank 0 into RUN_DIR/doctor.json (read by ddp_amp.checkup).

- all-reduce latency (one number) and bus bandwidth at a few sizes, every rank at once, as training does;
- this rank's matmul rate at the run's precision, one rank at a time so that ranks sharing cores do not
  measure each other;
- on a GPU, the host-to-device copy rate from pinned memory.
"""

from __future__ import annotations

import socket
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.dist import DistEnv
from ddp_amp.precision import Precision

SIZES_MIB = (1, 16, 256)
LATENCY_REPEATS = 50
MATMUL_SIDE = {"cpu": 1024, "cuda": 8192}
MATMUL_SECONDS = 0.5


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def all_reduce_figures(world_size: int, device: torch.device) -> dict[str, Any]:
    one = torch.zeros(1, device=device)
    for _ in range(5):
        dist.all_reduce(one)
    latency = statistics.median(_timed(lambda: dist.all_reduce(one), device) for _ in range(LATENCY_REPEATS))
    sizes = []
    for mib in SIZES_MIB:
        tensor = torch.zeros(mib * 2**20 // 4, device=device)
        dist.all_reduce(tensor)  # the first one sets up the buffers
        repeats = 3 if mib <= 16 else 2
        seconds = statistics.median(_timed(lambda t=tensor: dist.all_reduce(t), device) for _ in range(repeats))
        algorithm_bandwidth = mib * 2**20 / seconds
        # What each link carries in a ring all-reduce: 2(n-1)/n of the data (nccl-tests' "bus bandwidth").
        bus = algorithm_bandwidth * 2 * (world_size - 1) / world_size if world_size > 1 else algorithm_bandwidth
        sizes.append({"mib": mib, "seconds": seconds, "bus_gb_per_s": bus / 1e9})
        del tensor
    return {"latency_us": latency * 1e6, "sizes": sizes}


def matmul_gflops(device: torch.device, precision: Precision) -> float:
    side = MATMUL_SIDE[device.type]
    dtype = precision.torch_dtype() if precision.enabled else torch.float32
    a = torch.randn(side, side, device=device, dtype=dtype)
    b = torch.randn(side, side, device=device, dtype=dtype)
    a @ b  # warm-up
    count, started = 0, time.perf_counter()
    while True:
        a @ b
        count += 1
        _sync(device)
        elapsed = time.perf_counter() - started
        if elapsed >= MATMUL_SECONDS:
            return 2 * side**3 * count / elapsed / 1e9


def host_to_device_gb_per_s(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    seconds = statistics.median(_timed(lambda: target.copy_(host, non_blocking=True), device) for _ in range(5))
    return host.numel() / seconds / 1e9


def checkup(env: DistEnv, device: torch.device, precision: Precision, ready_at: float,
            launch_time: float) -> list[dict[str, Any]] | None:
    """Every rank's figures, on rank 0 (None elsewhere). `ready_at`: when this rank's process group was made."""
    links = all_reduce_figures(env.world_size, device)
    mine: dict[str, Any] = {"rank": env.rank, "host": socket.gethostname(), "local_rank": env.local_rank,
                            "rendezvous_s": ready_at - launch_time, "device": str(device)}
    for turn in range(env.world_size):  # one rank at a time: ranks sharing cores must not slow each other
        if turn == env.rank:
            mine["matmul_gflops"] = matmul_gflops(device, precision)
        dist.barrier()
    mine["host_to_device_gb_per_s"] = host_to_device_gb_per_s(device)
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, {**mine, "all_reduce": links})
    return gathered if env.rank == 0 else None
