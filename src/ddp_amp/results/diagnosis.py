"""Where the ranks parted: the flight records the ranks wrote (rank.flight_recorder) merged and read, for the
launcher's last line after a failure and for `ddp-amp diagnose RUN_DIR`. Torch-free.

Collectives are numbered per process group in the order each rank entered them (collective_seq_id), the same
on every rank of a correct program. So: the first number at which two ranks entered different collectives (op,
sizes or dtypes) is a mismatch; otherwise a rank whose last number is below the others' never entered the
collective they wait in.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.outputs import DUMP_DIR

DTYPE_BYTES = {"Float": 4, "Double": 8, "Half": 2, "BFloat16": 2, "Long": 8, "Int": 4, "Short": 2, "Char": 1,
               "Byte": 1, "Bool": 1}
TRAINING_GROUP = "default_pg"
"""The process group whose collectives are the training's (DDP's buckets, the log's all-reduce); the stop
agreement's own group is left out."""


def read_dumps(run_dir: Path) -> dict[int, dict[str, Any]]:
    """Every rank's record in RUN_DIR/flight_recorder, by rank (unreadable files left out)."""
    dumps = {}
    for path in sorted((run_dir / DUMP_DIR).glob("rank*.json")):
        try:
            record = json.loads(path.read_text())
            dumps[int(record["rank"])] = record
        except (OSError, ValueError, KeyError):
            continue
    return dumps


def training_collectives(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    entries = [e for e in record.get("entries", [])
               if (e.get("process_group") or [None, None])[1] == TRAINING_GROUP]
    return {e["collective_seq_id"]: e for e in entries}


def describe(entry: dict[str, Any]) -> str:
    """"all_reduce, 16.0 MiB" from an entry's op and input sizes and dtypes."""
    op = str(entry.get("profiling_name", "?")).split(":", 1)[-1]
    total = 0
    for shape, dtype in zip(entry.get("input_sizes") or [], entry.get("input_dtypes") or []):
        total += math.prod(shape) * DTYPE_BYTES.get(dtype, 4)
    return f"{op}, {_size(total)}"


def signature(entry: dict[str, Any]) -> tuple:
    return (entry.get("profiling_name"), json.dumps(entry.get("input_sizes")), json.dumps(entry.get("input_dtypes")))


def _size(count: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= scale:
            return f"{count / scale:.1f} {unit}"
    return f"{count} B"


def _ranks(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}"


def _where(record: dict[str, Any]) -> str:
    if record.get("where"):  # a user's script: its code's line
        return record["where"]
    position = record.get("position")
    return f"step {position['step']} ({position['phase']})" if position else "before training"


@dataclass
class Parting:
    line: str
    """One sentence: where the ranks parted, or that they did not part at a collective."""
    mismatch: bool = False


def where_ranks_parted(dumps: dict[int, dict[str, Any]], world_size: int | None = None) -> Parting | None:
    """The analysis of the dumps; None when there are none."""
    if not dumps:
        return None
    collectives = {rank: training_collectives(record) for rank, record in dumps.items()}
    missing = sorted(set(range(world_size)) - set(dumps)) if world_size else []
    shared = sorted(set.intersection(*(set(c) for c in collectives.values())))
    for number in shared:  # the first collective the ranks entered differently
        kinds: dict[tuple, list[int]] = {}
        for rank, entries in collectives.items():
            kinds.setdefault(signature(entries[number]), []).append(rank)
        if len(kinds) > 1:
            sides = "; ".join(f"{_ranks(ranks)} entered {describe(collectives[ranks[0]][number])}"
                              for ranks in sorted(kinds.values()))
            return Parting(f"the ranks called different collectives at #{number}, a mismatch: {sides}",
                           mismatch=True)
    last = {rank: max(entries, default=0) for rank, entries in collectives.items()}
    furthest = max(last.values())
    behind = [rank for rank, number in last.items() if number < furthest]
    left = f"; {_ranks(missing)} left no record" if missing else ""
    if not behind:
        return Parting(f"every rank with a record entered collective #{furthest}: the ranks did not part at a "
                       f"collective{left}")
    ahead = [rank for rank, number in last.items() if number == furthest]
    entry = collectives[ahead[0]][furthest]
    waited = max((dumps[rank]["dumped_at_ns"] - collectives[rank][furthest]["time_created_ns"]) / 1e9
                 for rank in ahead)
    laggards = "; ".join(f"rank {rank} was last in {_where(dumps[rank])}" for rank in behind)
    return Parting(f"{_ranks(behind)} never entered collective #{furthest} ({describe(entry)}); "
                   f"{_ranks(ahead)} waited in it for {waited:.0f} s; {laggards}{left}")


def timeline(dumps: dict[int, dict[str, Any]], last: int = 8) -> list[str]:
    """Each rank's last collectives, oldest first: "#57 all_reduce, 16.0 MiB, 12.3 s before its dump"."""
    lines = []
    for rank, record in sorted(dumps.items()):
        entries = sorted(training_collectives(record).items())[-last:]
        lines.append(f"rank {rank}: {record.get('reason', '')}; was in {_where(record)}")
        for number, entry in entries:
            age = (record["dumped_at_ns"] - entry["time_created_ns"]) / 1e9
            lines.append(f"  #{number} {describe(entry)}, entered {age:.1f} s before the record")
    return lines
