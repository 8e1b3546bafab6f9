"""`ddp-amp diagnose` on flight records that are damaged or of the wrong shape: each named in one warning, and
no verdict claimed about the ranks whose records could not be read."""

import json

import pytest
from helpers import one_line, run_main

from ddp_amp.results.diagnosis import read_records, where_ranks_parted

NOW = 10**18


def record(rank: int, last: int) -> dict:
    return {"rank": rank, "reason": "no progress for 5s", "dumped_at_ns": NOW,
            "position": {"step": 3, "micro": 0, "phase": "forward"},
            "entries": [{"collective_seq_id": number, "profiling_name": "gloo:all_reduce", "input_sizes": [[9]],
                         "input_dtypes": ["Float"], "output_sizes": [[9]], "state": "scheduled",
                         "time_created_ns": NOW - 7 * 10**9, "pg_id": 0, "process_group": ["0", "default_pg"]}
                        for number in range(1, last + 1)]}


@pytest.fixture
def run_dir(tmp_path):
    """Three ranks' records; rank 1 never entered collective #2."""
    (tmp_path / "flight_recorder").mkdir()
    for rank, last in ((0, 2), (1, 1), (2, 2)):
        (tmp_path / "flight_recorder" / f"rank{rank}.json").write_text(json.dumps(record(rank, last)))
    return tmp_path


def test_intact_records_name_the_rank_that_never_entered(run_dir, capsys):
    code, out, err = run_main(["diagnose", str(run_dir)], capsys)
    assert code == 0 and err == ""
    assert out.splitlines()[0].startswith("rank 1 never entered collective #2 (all_reduce, 36 B); ranks 0,2 waited")


DAMAGED = {
    "truncated": (lambda text: text[:100].encode(), "not complete JSON"),
    "empty object": (lambda text: b"{}", "no integer 'rank'"),
    "not UTF-8": (lambda text: b"\xff\xfe" + text.encode("utf-16-le")[:50], "not UTF-8 text"),
    "a list": (lambda text: b"[1, 2]", "a JSON list, not a flight record's object"),
    "entries not a list": (lambda text: b'{"rank": 1, "dumped_at_ns": 5, "entries": 5}', "no 'entries' list"),
    "no dump time": (lambda text: b'{"rank": 1, "entries": 5}', "no 'dumped_at_ns' time"),
    "entry not an object": (lambda text: json.dumps({**json.loads(text), "entries": [3]}).encode(),
                            "an entry is not an object"),
    "another rank's": (lambda text: json.dumps({**json.loads(text), "rank": 0}).encode(), "says rank 0"),
}


@pytest.mark.parametrize("damage", DAMAGED)
def test_a_damaged_record_is_named_and_no_verdict_is_claimed_without_it(run_dir, capsys, damage):
    path = run_dir / "flight_recorder" / "rank1.json"
    spoil, why = DAMAGED[damage]
    path.write_bytes(spoil(path.read_text()))
    code, out, err = run_main(["diagnose", str(run_dir)], capsys)
    assert code == 0 and "Traceback" not in err
    [warning] = err.splitlines()
    assert warning.startswith(f"ddp-amp: warning: skipped the damaged flight record {path}: ") and why in warning
    verdict = out.splitlines()[0]
    assert verdict == ("ranks 0,2 entered collective #2, but rank 1's record is damaged: no verdict on where the "
                       "ranks parted"), verdict
    assert "did not part" not in out and not any(line.startswith("rank 1:") for line in out.splitlines())


def test_a_verdict_from_the_readable_records_says_whom_it_covers(run_dir):
    (run_dir / "flight_recorder" / "rank0.json").write_text("{}")
    dumps, damaged = read_records(run_dir)
    assert sorted(dumps) == [1, 2] and [path.name for path in damaged] == ["rank0.json"]
    line = where_ranks_parted(dumps, damaged=damaged).line
    assert line.startswith("rank 1 never entered collective #2 (all_reduce, 36 B); rank 2 waited in it for 7 s")
    assert line.endswith("; rank 0's record is damaged: this covers ranks 1,2 only"), line


def test_a_rank_that_left_no_record_leaves_no_verdict_either(run_dir):
    (run_dir / "flight_recorder" / "rank1.json").unlink()
    dumps, damaged = read_records(run_dir)
    assert where_ranks_parted(dumps, 3, damaged).line == (
        "ranks 0,2 entered collective #2, but rank 1 left no record: no verdict on where the ranks parted")



def test_diagnose_names_a_rank_that_left_no_record_of_the_world_size_the_run_recorded(run_dir, capsys):
    """The command's analysis is the launcher's: a rank that failed before it wrote a record (before its first
    collective) leaves no verdict, rather than "every rank with a record entered collective #2"."""
    (run_dir / "flight_recorder" / "rank1.json").unlink()
    (run_dir / "summary.json").write_text(json.dumps({"world_size": 3, "outcome": "failed"}))
    code, out, err = run_main(["diagnose", str(run_dir)], capsys)
    assert code == 0 and err == ""
    assert out.splitlines()[0] == (
        "ranks 0,2 entered collective #2, but rank 1 left no record: no verdict on where the ranks parted")

def test_no_readable_record_at_all_is_one_line_exit_2(run_dir, capsys):
    for rank in range(3):
        (run_dir / "flight_recorder" / f"rank{rank}.json").write_text("[1, 2]")
    code, out, err = run_main(["diagnose", str(run_dir)], capsys)
    line = one_line(err)
    assert code == 2 and out == ""
    assert line.startswith("ddp-amp: error: diagnose: no flight record in ") and "rank0.json: a JSON list" in line
