"""`ddp-amp doctor`, the launcher's side: the ranks' figures (RUN_DIR/doctor.json, from rank.doctor) read
and judged. Torch-free.

A rank whose matmul rate is SLOW_SHARE or more below the ranks' median is an outlier: a throttled GPU, a busy
core, a node with another job on it. One such rank sets the pace of every step of a data-parallel job.

A node whose link is LINK_FACTOR times worse than the median node's is an outlier too: every all-reduce runs
at the pace of the slowest link in the ring. A node's figures are its best over the pairs it was measured in
(its shortest round trip, its fastest transfer each way): a node with a bad link has no good pair, while a
healthy node has a good pair with every other healthy node. So with three or more nodes, one node's slow link
is told from its peers'. With two, both ends share every figure: a long round trip names neither, and a slow
direction names both ends (the sender for its sends, the receiver for its receives).
"""

from __future__ import annotations

import statistics
from typing import Any

SLOW_SHARE = 0.10
LINK_FACTOR = 2.0
LATENCY_FLOOR_US = 500.0
"""...and a round trip at least this much longer than the median: below it, a difference is the host's own
scheduling. A node under a CPU quota of half a core measured 274 us against a median of 132 us over healthy
veths (its compute is what is slow, and doctor names that); a slow link adds milliseconds."""


def slow_ranks(ranks: list[dict[str, Any]]) -> list[int]:
    """The ranks whose matmul rate is at least SLOW_SHARE below the median of all ranks."""
    rates = [r["matmul_gflops"] for r in ranks]
    median = statistics.median(rates)
    return [r["rank"] for r in ranks if r["matmul_gflops"] <= (1 - SLOW_SHARE) * median]


def per_node(report: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per node (torchrun's node rank): its address, how many ranks, their median matmul rate, their slowest
    rendezvous, and with several nodes its best round trip and transfer rates to the other nodes."""
    members: dict[int, list[dict[str, Any]]] = {}
    for rank in report["ranks"]:
        members.setdefault(rank.get("node", 0), []).append(rank)
    nodes = {node: {"host": ranks[0]["host"], "address": ranks[0].get("address", ranks[0]["host"]),
                    "ranks": len(ranks), "matmul_gflops": statistics.median(r["matmul_gflops"] for r in ranks),
                    "rendezvous_s": max(r["rendezvous_s"] for r in ranks)} for node, ranks in sorted(members.items())}
    for node, figures in nodes.items():
        pairs = [pair for pair in report.get("node_links", []) if node in pair["nodes"]]
        if not pairs:
            continue
        sends = [rate for pair in pairs for way, rate in pair["gb_per_s"].items() if way.startswith(f"{node}->")]
        receives = [rate for pair in pairs for way, rate in pair["gb_per_s"].items() if way.endswith(f"->{node}")]
        figures.update(round_trip_us=min(pair["round_trip_us"] for pair in pairs), send_gb_per_s=max(sends),
                       receive_gb_per_s=max(receives))
    return nodes


def slow_links(nodes: dict[int, dict[str, Any]]) -> dict[int, list[str]]:
    """node -> what is wrong with its link, for nodes LINK_FACTOR times worse than the median node."""
    measured = {node: figures for node, figures in nodes.items() if "round_trip_us" in figures}
    if len(measured) < 2:
        return {}
    slow: dict[int, list[str]] = {}
    median_trip = statistics.median(f["round_trip_us"] for f in measured.values())
    for node, figures in measured.items():
        trip = figures["round_trip_us"]
        if trip >= LINK_FACTOR * median_trip and trip - median_trip >= LATENCY_FLOOR_US:
            slow.setdefault(node, []).append(f"round trip {_us(trip)} (median {_us(median_trip)})")
    for way in ("send", "receive"):
        median_rate = statistics.median(f[f"{way}_gb_per_s"] for f in measured.values())
        for node, figures in measured.items():
            rate = figures[f"{way}_gb_per_s"]
            if rate * LINK_FACTOR <= median_rate:
                slow.setdefault(node, []).append(f"{way}s at {rate:.2f} GB/s (median {median_rate:.2f})")
    return dict(sorted(slow.items()))


def _us(microseconds: float) -> str:
    return f"{microseconds / 1e3:.1f} ms" if microseconds >= 1000 else f"{microseconds:.0f} us"


def judge(report: dict[str, Any]) -> dict[str, Any]:
    """The verdict beside the figures: outliers, and one line that says whether the job can go."""
    ranks = report["ranks"]
    slow = slow_ranks(ranks)
    nodes = per_node(report)
    links = slow_links(nodes)
    median = statistics.median(r["matmul_gflops"] for r in ranks)
    warnings = []
    if slow:
        # Where host names repeat (containers, namespaces), the node's address tells the nodes apart.
        where = "address" if len(nodes) > 1 else "host"
        detail = ", ".join(f"rank {r['rank']} ({r.get(where, r['host'])}) {r['matmul_gflops']:.0f}" for r in ranks
                           if r["rank"] in slow)
        warnings.append(f"slow compute, {SLOW_SHARE:.0%} or more below the median {median:.0f} GFLOP/s: {detail}")
    if links:
        detail = "; ".join(f"node {node} ({nodes[node]['address']}): {', '.join(problems)}"
                           for node, problems in links.items())
        warnings.append(f"slow link, {LINK_FACTOR:g}x or more worse than the median node: {detail}")
    all_reduce = ranks[0]["all_reduce"]
    largest = all_reduce["sizes"][-1]
    verdict = (f"{len(ranks)} rank(s) on {len(nodes)} node(s) ready: all-reduce latency "
               f"{all_reduce['latency_us']:.0f} us, bus bandwidth {largest['bus_gb_per_s']:.2f} GB/s at "
               f"{largest['mib']} MiB, matmul {median:.0f} GFLOP/s per rank")
    if warnings:
        verdict += f"; {len(warnings)} warning(s)"
    return {"slow_ranks": slow, "slow_nodes": sorted(links), "warnings": warnings, "verdict": verdict,
            "nodes": nodes}
