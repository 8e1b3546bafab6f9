"""`ddp-amp doctor`, the launcher's side: the ranks' figures (RUN_DIR/doctor.json, from rank.doctor) read
and judged. Torch-free.

A rank whose matmul rate is SLOW_SHARE or more below the ranks' median is an outlier: a throttled GPU, a busy
core, a node with another job on it. One such rank sets the pace of every step of a data-parallel job.
"""

from __future__ import annotations

import statistics
from typing import Any

SLOW_SHARE = 0.10


def slow_ranks(ranks: list[dict[str, Any]]) -> list[int]:
    """The ranks whose matmul rate is at least SLOW_SHARE below the median of all ranks."""
    rates = [r["matmul_gflops"] for r in ranks]
    median = statistics.median(rates)
    return [r["rank"] for r in ranks if r["matmul_gflops"] <= (1 - SLOW_SHARE) * median]


def per_node(ranks: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per host: how many ranks, their median matmul rate and their slowest rendezvous."""
    hosts: dict[str, list[dict[str, Any]]] = {}
    for rank in ranks:
        hosts.setdefault(rank["host"], []).append(rank)
    return {host: {"ranks": len(members), "matmul_gflops": statistics.median(m["matmul_gflops"] for m in members),
                   "rendezvous_s": max(m["rendezvous_s"] for m in members)} for host, members in hosts.items()}


def judge(report: dict[str, Any]) -> dict[str, Any]:
    """The verdict beside the figures: outliers, and one line that says whether the job can go."""
    ranks = report["ranks"]
    slow = slow_ranks(ranks)
    median = statistics.median(r["matmul_gflops"] for r in ranks)
    warnings = []
    if slow:
        detail = ", ".join(f"rank {r['rank']} ({r['host']}) {r['matmul_gflops']:.0f}" for r in ranks
                           if r["rank"] in slow)
        warnings.append(f"slow compute, {SLOW_SHARE:.0%} or more below the median {median:.0f} GFLOP/s: {detail}")
    links = ranks[0]["all_reduce"]
    largest = links["sizes"][-1]
    verdict = (f"{len(ranks)} rank(s) on {len(per_node(ranks))} node(s) ready: all-reduce latency "
               f"{links['latency_us']:.0f} us, bus bandwidth {largest['bus_gb_per_s']:.2f} GB/s at "
               f"{largest['mib']} MiB, matmul {median:.0f} GFLOP/s per rank")
    if warnings:
        verdict += f"; {len(warnings)} warning(s)"
    return {"slow_ranks": slow, "warnings": warnings, "verdict": verdict, "nodes": per_node(ranks)}
