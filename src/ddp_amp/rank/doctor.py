"""`ddp-amp doctor`, a rank's side: what this rank and its links can do, measured in seconds on the job's own
backend before a long job, gathered on every rank and written to each node's RUN_DIR/doctor.json (read by
ddp_amp.measure.doctor).

- all-reduce latency (one number) and bus bandwidth at a few sizes, every rank at once, as training does;
- this rank's matmul rate at the run's precision, one rank at a time so that ranks sharing cores do not
  measure each other, the best of MATMUL_ROUNDS rounds taken in turn, so that a burst of load elsewhere on a
  shared host, which falls on one rank's window, does not mark that rank slow;
- on a GPU, the host-to-device copy rate from pinned memory;
- with several nodes, each node's own link: its first rank and every other node's first rank, one pair at a
  time, measure their round trip and the bandwidth each way. An all-reduce over all ranks only shows the
  slowest link; the pairs tell which node it belongs to (see ddp_amp.measure.doctor.slow_links).
"""

from __future__ import annotations

import os
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
SIZE_BUDGET_S = 5.0
"""A larger all-reduce size is measured only if it would take less than this: doctor takes seconds."""
MATMUL_SIDE = {"cpu": 1024, "cuda": 8192}
MATMUL_SECONDS = 0.5
"""Per rank, over all its rounds."""
MATMUL_ROUNDS = 3
PAIR_MIB = 16
"""One transfer of the per-node link probe: big enough to reach a link's rate, small enough for a slow link."""
PAIR_ROUND_TRIPS = 20
PAIR_TRANSFERS = 3


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    started = time.perf_counter()
    fn()
    _sync(device)
    return time.perf_counter() - started


def _repeats(mib: int) -> int:
    return 3 if mib <= 16 else 2


def all_reduce_figures(world_size: int, device: torch.device) -> dict[str, Any]:
    one = torch.zeros(1, device=device)
    for _ in range(5):
        dist.all_reduce(one)
    latency = statistics.median(_timed(lambda: dist.all_reduce(one), device) for _ in range(LATENCY_REPEATS))
    sizes = []
    for index, mib in enumerate(SIZES_MIB):
        tensor = torch.zeros(mib * 2**20 // 4, device=device)
        dist.all_reduce(tensor)  # the first one sets up the buffers
        seconds = statistics.median(_timed(lambda t=tensor: dist.all_reduce(t), device)
                                    for _ in range(_repeats(mib)))
        # The slowest rank's time, so that every rank makes the same choice below (a collective follows).
        agreed = torch.tensor([seconds], device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
        seconds = agreed.item()
        algorithm_bandwidth = mib * 2**20 / seconds
        # What each link carries in a ring all-reduce: 2(n-1)/n of the data (nccl-tests' "bus bandwidth").
        bus = algorithm_bandwidth * 2 * (world_size - 1) / world_size if world_size > 1 else algorithm_bandwidth
        sizes.append({"mib": mib, "seconds": seconds, "bus_gb_per_s": bus / 1e9})
        del tensor
        following = SIZES_MIB[index + 1] if index + 1 < len(SIZES_MIB) else None
        if following is not None and seconds * following / mib * (1 + _repeats(following)) > SIZE_BUDGET_S:
            break  # a slow link: the larger sizes would take minutes, and the smaller ones have shown it
    return {"latency_us": latency * 1e6, "sizes": sizes}


def matmul_gflops(device: torch.device, precision: Precision, seconds: float = MATMUL_SECONDS) -> float:
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
        if elapsed >= seconds:
            return 2 * side**3 * count / elapsed / 1e9


def host_to_device_gb_per_s(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    host = torch.empty(256 * 2**20, dtype=torch.uint8).pin_memory()
    target = torch.empty_like(host, device=device)
    target.copy_(host, non_blocking=True)
    seconds = statistics.median(_timed(lambda: target.copy_(host, non_blocking=True), device) for _ in range(5))
    return host.numel() / seconds / 1e9


def node_address(env: DistEnv) -> str:
    """The address this node reaches the job's store from: what tells nodes apart where host names repeat
    (containers, network namespaces)."""
    from ddp_amp.network import route_source_address

    try:
        return route_source_address(env.master_addr, env.master_port)
    except OSError:
        return socket.gethostname()


def _exchange_s(peer: int, leading: bool, there: torch.Tensor, back: torch.Tensor) -> float:
    """The leading side sends `there` to `peer` and receives `back`; the other side the reverse. Its time."""
    started = time.perf_counter()
    if leading:
        dist.send(there, peer)
        dist.recv(back, peer)
    else:
        dist.recv(there, peer)
        dist.send(back, peer)
    return time.perf_counter() - started


def pair_figures(peer: int, first: bool, device: torch.device) -> tuple[float, float]:
    """(round trip, bandwidth of what this rank sends) between this rank and `peer`: both call it, `first` on
    one of them. Each direction is timed by its sender, until the receiver's token is back: that holds one
    small message, half a round trip, which is taken off."""
    token = torch.zeros(1, device=device)
    for _ in range(3):
        _exchange_s(peer, first, token, token)
    round_trip = statistics.median(_exchange_s(peer, first, token, token) for _ in range(PAIR_ROUND_TRIPS))
    payload = torch.zeros(PAIR_MIB * 2**20 // 4, device=device)
    sent_s = []
    for sender_is_first in (True, False):
        sending = first == sender_is_first
        times = [_exchange_s(peer, sending, payload, token) for _ in range(PAIR_TRANSFERS + 1)][1:]
        if sending:
            sent_s = times
    seconds = max(statistics.median(sent_s) - round_trip / 2, 1e-9)
    return round_trip, PAIR_MIB * 2**20 / seconds / 1e9


def node_links(env: DistEnv, nodes: list[int], device: torch.device) -> list[dict[str, Any]]:
    """Every pair of nodes measured by their first ranks, one pair at a time (a barrier after each, so no two
    pairs share the network while measured); the same list on every rank. `nodes`: each rank's node."""
    leaders = {node: nodes.index(node) for node in sorted(set(nodes))}
    pairs = [(a, b) for a in leaders for b in leaders if a < b]
    mine = []  # (pair, this leader's node, round trip, what it sent at)
    for a, b in pairs:
        if env.rank in (leaders[a], leaders[b]):
            first = env.rank == leaders[a]
            round_trip, sent = pair_figures(leaders[b] if first else leaders[a], first, device)
            mine.append(((a, b), a if first else b, round_trip, sent))
        dist.barrier()
    gathered: list[Any] = [None] * env.world_size
    dist.all_gather_object(gathered, mine)
    links: dict[tuple[int, int], dict[str, Any]] = {}
    for (a, b), sender, round_trip, sent in (entry for rank_entries in gathered for entry in rank_entries):
        link = links.setdefault((a, b), {"nodes": [a, b], "gb_per_s": {}})
        if sender == a:
            link["round_trip_us"] = round_trip * 1e6  # the first's figure: both sides measured the same trips
        link["gb_per_s"][f"{sender}->{b if sender == a else a}"] = sent
    return [links[pair] for pair in sorted(links)]


def measure(env: DistEnv, device: torch.device, precision: Precision, ready_at: float,
            launch_time: float) -> dict[str, Any]:
    """Every rank's figures and the links between nodes, the same on every rank. `ready_at`: when this
    rank's process group was made."""
    links = all_reduce_figures(env.world_size, device)
    node = int(os.environ.get("GROUP_RANK", "0"))  # torchrun's node rank (spawn sets 0)
    mine: dict[str, Any] = {"rank": env.rank, "node": node, "host": socket.gethostname(),
                            "address": node_address(env), "local_rank": env.local_rank,
                            "rendezvous_s": ready_at - launch_time, "device": str(device)}
    rates = []
    for _ in range(MATMUL_ROUNDS):
        for turn in range(env.world_size):  # one rank at a time: ranks sharing cores must not slow each other
            if turn == env.rank:
                rates.append(matmul_gflops(device, precision, MATMUL_SECONDS / MATMUL_ROUNDS))
            dist.barrier()
    mine["matmul_gflops"] = max(rates)  # what the rank can do: a cap (a quota, a slower GPU) holds in every round
    mine["host_to_device_gb_per_s"] = host_to_device_gb_per_s(device)
    ranks: list[Any] = [None] * env.world_size
    dist.all_gather_object(ranks, {**mine, "all_reduce": links})
    return {"ranks": ranks, "node_links": node_links(env, [r["node"] for r in ranks], device)}
