"""ddp-amp doctor without launching: the judgement of measured figures (slow ranks, nodes and links), and bad
input. Real ranks measured: tests/system/test_doctor_runs.py."""

import pytest
from helpers import run_cli

from ddp_amp.measure.doctor import judge, per_node, slow_links, slow_ranks


def rank(number, gflops, host="a"):
    return {"rank": number, "host": host, "matmul_gflops": gflops, "rendezvous_s": 1.0,
            "all_reduce": {"latency_us": 100.0, "sizes": [{"mib": 1, "seconds": 0.01, "bus_gb_per_s": 0.2}]}}


def test_a_rank_ten_percent_below_the_median_is_named():
    ranks = [rank(0, 100.0), rank(1, 100.0), rank(2, 90.0, host="b"), rank(3, 95.0, host="b")]
    assert slow_ranks(ranks) == []  # the median is 97.5: 90 is only 7.7% below it
    assert slow_ranks([rank(0, 100.0), rank(1, 100.0), rank(2, 89.0), rank(3, 100.0)]) == [2]
    assert slow_ranks([rank(0, 100.0), rank(1, 91.0), rank(2, 100.0)]) == []
    judgement = judge({"ranks": [rank(0, 100.0), rank(1, 100.0), rank(2, 80.0, host="b")]})
    assert judgement["slow_ranks"] == [2]
    assert judgement["warnings"] == ["slow compute, 10% or more below the median 100 GFLOP/s: rank 2 (b) 80"]
    assert judgement["nodes"] == {0: {"host": "a", "address": "a", "ranks": 3, "matmul_gflops": 100.0,
                                      "rendezvous_s": 1.0}}  # no node rank recorded: one node
    assert judgement["verdict"].startswith("3 rank(s) on 1 node(s) ready") and "1 warning(s)" in judgement["verdict"]


def pair(a, b, round_trip_us, a_to_b, b_to_a):
    return {"nodes": [a, b], "round_trip_us": round_trip_us, "gb_per_s": {f"{a}->{b}": a_to_b, f"{b}->{a}": b_to_a}}


def nodes_with(*pairs):
    ranks = [{**rank(node, 100.0, host=f"h{node}"), "node": node, "address": f"10.0.0.{node + 1}"} for node in range(3)]
    return per_node({"ranks": ranks, "node_links": list(pairs)})


def test_a_node_whose_every_pair_is_slow_is_named_and_its_peers_are_not():
    """Node 2 delays what it sends: both of its pairs have a long round trip, while nodes 0 and 1 each have
    one good pair. Their best figures tell them apart."""
    nodes = nodes_with(pair(0, 1, 300.0, 1.0, 1.0), pair(0, 2, 20300.0, 0.9, 0.8), pair(1, 2, 20300.0, 0.9, 0.8))
    assert [nodes[n]["round_trip_us"] for n in range(3)] == [300.0, 300.0, 20300.0]
    assert slow_links(nodes) == {2: ["round trip 20.3 ms (median 300 us)"]}
    # A rate limit on what node 2 sends: its round trips are fine, its sends are slow, its receives are not.
    nodes = nodes_with(pair(0, 1, 300.0, 1.0, 1.0), pair(0, 2, 320.0, 0.9, 0.05), pair(1, 2, 310.0, 0.95, 0.04))
    assert slow_links(nodes) == {2: ["sends at 0.05 GB/s (median 1.00)"]}
    # Jitter is not a slow link: twice the median but within LATENCY_FLOOR_US of it.
    assert slow_links(nodes_with(pair(0, 1, 40.0, 1, 1), pair(0, 2, 90.0, 1, 1), pair(1, 2, 90.0, 1, 1))) == {}


def test_with_two_nodes_a_slow_direction_names_both_of_its_ends():
    ranks = [{**rank(node, 100.0), "node": node, "address": f"10.0.0.{node + 1}"} for node in range(2)]
    slow_round_trip = per_node({"ranks": ranks, "node_links": [pair(0, 1, 20000.0, 1.0, 1.0)]})
    assert slow_links(slow_round_trip) == {}  # the same figure for both ends: which one is slow is unknowable
    # 1->0 is slow: node 1's sending or node 0's receiving, both named for what they were measured doing.
    limited = per_node({"ranks": ranks, "node_links": [pair(0, 1, 300.0, 1.0, 0.1)]})
    assert slow_links(limited) == {0: ["receives at 0.10 GB/s (median 0.55)"],
                                   1: ["sends at 0.10 GB/s (median 0.55)"]}
    assert judge({"ranks": ranks, "node_links": [pair(0, 1, 300.0, 1.0, 0.1)]})["slow_nodes"] == [0, 1]


@pytest.mark.parametrize("args, line", [
    (["--nnodes", "2"], "doctor: --nnodes and --endpoint go together (the nodes meet at the endpoint)"),
    (["--endpoint", "127.0.0.1:29400"], "doctor: --nnodes and --endpoint go together (the nodes meet at the endpoint)"),
    (["--nnodes", "0", "--endpoint", "127.0.0.1"], "--nnodes must be >= 1, got 0"),
    (["--nnodes", "1:2", "--endpoint", "127.0.0.1"], "--nnodes 1:2: doctor measures the nodes it is started on, "
                                                      "not an elastic range; give their number (--nnodes N)"),
    (["--nnodes", "two", "--endpoint", "127.0.0.1"], "--nnodes 'two' is not a number of nodes"),
    (["--nnodes", "2", "--endpoint", "127.0.0.1", "--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
])
def test_doctor_bad_multinode_input_is_one_line_exit_2(tmp_path, args, line):
    result = run_cli("doctor", *args, "--device", "cpu", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [f"ddp-amp: error: {line}"]
    assert not (tmp_path / "run").exists()
