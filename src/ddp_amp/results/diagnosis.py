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


def read_records(run_dir: Path) -> tuple[dict[int, dict[str, Any]], dict[Path, str]]:
    """Every rank's record in RUN_DIR/flight_recorder, by rank, and each file that could not be read, with why."""
    dumps: dict[int, dict[str, Any]] = {}
    damaged: dict[Path, str] = {}
    for path in sorted((run_dir / DUMP_DIR).glob("rank*.json")):
        try:
            record = json.loads(path.read_bytes().decode("utf-8"))
        except OSError as exc:
            damaged[path] = f"cannot be read ({exc.strerror or exc})"
            continue
        except UnicodeDecodeError:
            damaged[path] = "not UTF-8 text"
            continue
        except ValueError as exc:
            damaged[path] = f"not complete JSON ({exc})"
            continue
        why = record_problem(record, file_rank(path))
        if why is None:
            dumps[record["rank"]] = record
        else:
            damaged[path] = why
    return dumps, damaged


def file_rank(path: Path) -> int | None:
    """The rank a record's file name gives (rank<N>.json), None for another name."""
    digits = path.name[len("rank"):-len(".json")]
    return int(digits) if digits.isdigit() else None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _entry_problem(entry: Any) -> str | None:
    if not isinstance(entry, dict):
        return "an entry is not an object"
    group = entry.get("process_group")
    if group is not None and not (isinstance(group, list) and len(group) >= 2):
        return "an entry's process_group is not a [id, name] pair"
    if (group or [None, None])[1] != TRAINING_GROUP:
        return None
    if not isinstance(entry.get("collective_seq_id"), int) or not _number(entry.get("time_created_ns")):
        return "an entry lacks an integer collective_seq_id or a time_created_ns"
    sizes, dtypes = entry.get("input_sizes"), entry.get("input_dtypes")
    if sizes is not None and not (isinstance(sizes, list) and all(
            isinstance(shape, list) and all(isinstance(n, int) for n in shape) for shape in sizes)):
        return "an entry's input_sizes is not a list of shapes"
    if dtypes is not None and not (isinstance(dtypes, list) and all(isinstance(d, str) for d in dtypes)):
        return "an entry's input_dtypes is not a list of names"
    return None


def record_problem(record: Any, rank: int | None) -> str | None:
    """Why a parsed record cannot be used (the shape rank.flight_recorder.dump writes), None when it can."""
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not a flight record's object"
    if not isinstance(record.get("rank"), int) or isinstance(record.get("rank"), bool):
        return "no integer 'rank'"
    if rank is not None and record["rank"] != rank:
        return f"says rank {record['rank']}, its name rank {rank}"
    if not _number(record.get("dumped_at_ns")):
        return "no 'dumped_at_ns' time"
    if not isinstance(record.get("entries"), list):
        return "no 'entries' list"
    position = record.get("position")
    if position is not None and not (isinstance(position, dict) and {"step", "phase"} <= set(position)):
        return "its 'position' is not a step and phase"
    if not isinstance(record.get("where") or "", str) or not isinstance(record.get("reason") or "", str):
        return "its 'where' or 'reason' is not text"
    return next(filter(None, map(_entry_problem, record["entries"])), None)


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


def _unknown(dumps: dict[int, Any], world_size: int | None, damaged: dict[Path, str]) -> str:
    """The ranks the records leave out: "rank 1's record is damaged and rank 3 left no record"; "" for none."""
    bad = sorted({file_rank(path) for path in damaged} - {None} - set(dumps))
    odd = sorted(path.name for path in damaged if file_rank(path) is None)
    missing = sorted(set(range(world_size)) - set(dumps) - set(bad)) if world_size else []
    parts = [f"{_ranks(bad)}'{'' if len(bad) > 1 else 's'} record{'s are' if len(bad) > 1 else ' is'} damaged"
             ] if bad else []
    parts += [f"{', '.join(odd)} {'are' if len(odd) > 1 else 'is'} damaged"] if odd else []
    parts += [f"{_ranks(missing)} left no record"] if missing else []
    return " and ".join(parts)


def where_ranks_parted(dumps: dict[int, dict[str, Any]], world_size: int | None = None,
                       damaged: dict[Path, str] | None = None) -> Parting | None:
    """The analysis of the dumps; None when there are none. Ranks whose record is missing (of `world_size`) or
    `damaged` are named: a verdict covers only the ranks whose records were read."""
    if not dumps:
        return None
    collectives = {rank: training_collectives(record) for rank, record in dumps.items()}
    unknown = _unknown(dumps, world_size, damaged or {})
    covers = f"; {unknown}: this covers {_ranks(dumps)} only" if unknown else ""
    shared = sorted(set.intersection(*(set(c) for c in collectives.values())))
    for number in shared:  # the first collective the ranks entered differently
        kinds: dict[tuple, list[int]] = {}
        for rank, entries in collectives.items():
            kinds.setdefault(signature(entries[number]), []).append(rank)
        if len(kinds) > 1:
            sides = "; ".join(f"{_ranks(ranks)} entered {describe(collectives[ranks[0]][number])}"
                              for ranks in sorted(kinds.values()))
            return Parting(f"the ranks called different collectives at #{number}, a mismatch: {sides}{covers}",
                           mismatch=True)
    last = {rank: max(entries, default=0) for rank, entries in collectives.items()}
    furthest = max(last.values())
    behind = [rank for rank, number in last.items() if number < furthest]
    if not behind and unknown:  # the missing ones may be the ranks that parted: no verdict
        return Parting(f"{_ranks(dumps)} entered collective #{furthest}, but {unknown}: no verdict on where "
                       "the ranks parted")
    if not behind:
        return Parting(f"every rank with a record entered collective #{furthest}: the ranks did not part at a "
                       "collective")
    ahead = [rank for rank, number in last.items() if number == furthest]
    entry = collectives[ahead[0]][furthest]
    waited = max((dumps[rank]["dumped_at_ns"] - collectives[rank][furthest]["time_created_ns"]) / 1e9
                 for rank in ahead)
    laggards = "; ".join(f"rank {rank} was last in {_where(dumps[rank])}" for rank in behind)
    return Parting(f"{_ranks(behind)} never entered collective #{furthest} ({describe(entry)}); "
                   f"{_ranks(ahead)} waited in it for {waited:.0f} s; {laggards}{covers}")


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
