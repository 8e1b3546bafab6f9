"""Where the ranks parted, from torch's flight recorder on real 2-rank gloo runs: a hung rank and a collective
mismatch named in the launcher's last line, the records kept, and `ddp-amp diagnose` reading them again."""

import json
import re

import pytest
from helpers import last_line, run_cli

pytestmark = pytest.mark.slow

HANG = ["--device", "cpu", "--steps", "50", "--log-every", "1", "--timeout", "6", "--log-format", "plain"]


def test_a_hung_rank_is_marked_stalled_and_named_with_the_collective_the_others_waited_in(tmp_path, helper_task):
    result = run_cli("spawn", "-n", "2", "--task", helper_task("hang_on_rank1"), *HANG, "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    # The live output marked it while the run still waited, then the last line names it, not rank 0.
    assert "[rank 1] stalled: no progress for" in result.stdout and "in step 5 (forward)" in result.stdout
    assert "[rank 0] stalled" not in result.stdout
    verdict = last_line(result.stderr)
    parted = re.search(r"rank 1 never entered collective #(\d+) \(all_reduce, 36 B\); rank 0 waited in it for "
                       r"(\d+) s; rank 1 was last in step 5 \(forward\)", verdict)
    assert parted, verdict
    assert int(parted.group(2)) >= 6  # --timeout 6
    assert verdict.startswith("ddp-amp: error: rank 1 stalled in step 5 (forward); the other ranks gave up "
                              "waiting after --timeout 6s"), verdict
    records = {rank: json.loads((tmp_path / "flight_recorder" / f"rank{rank}.json").read_text()) for rank in (0, 1)}
    number = int(parted.group(1))
    assert max(e["collective_seq_id"] for e in records[0]["entries"] if e["pg_id"] == 0) == number
    assert records[1]["position"] == {"step": 5, "micro": 0, "phase": "forward"}
    diagnosis = run_cli("diagnose", str(tmp_path))
    assert diagnosis.returncode == 0, diagnosis.stderr
    lines = diagnosis.stdout.splitlines()
    assert lines[0] == parted.group(0)
    assert f"  #{number} all_reduce, 36 B" in "\n".join(lines)  # rank 0's timeline ends in it
    assert any(line.startswith("rank 1: no progress for") for line in lines)


def test_a_collective_mismatch_is_named_with_both_sides(tmp_path, helper_task):
    """Rank-dependent control flow: rank 1 broadcasts where rank 0 all-reduces, the same 36 bytes."""
    result = run_cli("spawn", "-n", "2", "--task", helper_task("broadcast_instead_on_rank1"), *HANG,
                     "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert re.match(r"ddp-amp: error: the ranks called different collectives at #\d+, a mismatch: rank 0 entered "
                    r"all_reduce, 36 B; rank 1 entered broadcast, 36 B \(", verdict), verdict


def test_a_rank_that_sleeps_each_step_is_marked_slow(tmp_path, helper_task):
    """Rank 1 sleeps 20 ms in each forward: it is marked slow in the live view's lines, metrics.jsonl and
    summary.json; rank 0, which waits for it in backward's all-reduce, is not."""
    from helpers import read_metrics, read_summary

    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", helper_task("rank1_sleeps_each_step"),
                     "--steps", "40", "--log-every", "5", "--log-format", "plain", "--run-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert any(line.startswith("[rank 1] step 40/40") and line.endswith("slow (holds the others back)")
               for line in lines), result.stdout
    assert not any(line.startswith("[rank 0]") and "slow" in line for line in lines)
    summary = read_summary(tmp_path)
    assert summary["slow_ranks"] == [1]
    times = summary["time_per_rank_s"]
    assert times["1"]["forward"] >= 40 * 0.02  # the sleeps
    assert times["0"]["backward"] > times["1"]["backward"]  # rank 0 waited there for rank 1
    records = read_metrics(tmp_path)
    assert all(len(record["time_per_rank_s"]) == 2 and len(record["time_per_rank_s"][0]) == 5 for record in records)
    assert records[-1]["slow_ranks"] == [1] and records[0]["slow_ranks"] == []  # a window of 3 intervals first


def test_a_collective_of_another_size_is_named_from_the_aborted_ranks_log(tmp_path, helper_task):
    """Gloo aborts the rank that receives a collective of another size (C++ terminate, SIGABRT): no record of
    its own, but the last line carries what it printed as it died."""
    result = run_cli("spawn", "-n", "2", "--task", helper_task("extra_all_reduce_on_rank1"), *HANG,
                     "--run-dir", str(tmp_path))
    assert result.returncode == 1, result.stderr
    verdict = last_line(result.stderr)
    assert verdict.startswith("ddp-amp: error: rank 0 exited with signal SIGABRT: "), verdict
    assert verdict.endswith("Is there a distributed collective mismatch in your code?"), verdict
