"""torch's flight recorder on every rank: the last collectives each rank entered, kept in memory for free and
written out when a run goes wrong, so the launcher (and `ddp-amp diagnose`) can say where the ranks parted.

torch records them for gloo as well as nccl once TORCH_FR_BUFFER_SIZE is set before the process group is made.
A rank writes RUN_DIR/flight_recorder/rank<N>.json when it fails (a collective's --timeout included) and, from
its heartbeat thread, when its loop has stood still for the stall time: a rank stuck in a collective or in
user code cannot act, but its heartbeat thread can.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from ddp_amp.outputs import DUMP_DIR

BUFFER_VAR = "TORCH_FR_BUFFER_SIZE"
BUFFER_SIZE = 200
"""Collectives kept per rank: a step of DDP makes a few (one per bucket, plus the log's): dozens of steps."""
KEPT_FIELDS = ("collective_seq_id", "profiling_name", "input_sizes", "input_dtypes", "output_sizes", "state",
               "time_created_ns", "pg_id", "process_group")


def enable() -> None:
    """Before the process group is made; a value the user set is kept (0 turns the recorder off)."""
    os.environ.setdefault(BUFFER_VAR, str(BUFFER_SIZE))


def dump_path(run_dir: Path, rank: int) -> Path:
    return run_dir / DUMP_DIR / f"rank{rank}.json"


def forget(run_dir: Path, rank: int) -> None:
    """At a rank's start: a dump of an earlier launch in this run dir would be taken for this one's."""
    dump_path(run_dir, rank).unlink(missing_ok=True)


def entries() -> list[dict[str, Any]] | None:
    """The collectives torch has recorded on this rank so far, oldest first; None where it records nothing (the
    recorder off, or an API this torch lacks)."""
    try:
        import torch

        raw = torch._C._distributed_c10d._dump_fr_trace_json(includeCollectives=True)
        return json.loads(raw).get("entries", [])
    except (AttributeError, RuntimeError, ValueError):
        return None


def dump(run_dir: Path, rank: int, reason: str, position: tuple[int, int, str] | None,
         recorded: list[dict[str, Any]] | None = None, where: str | None = None) -> Path | None:
    """This rank's record now (or `recorded`, read already), with why and where its loop was (step from 1,
    micro-step, phase) or, for a user's script, `where` its code was (file:line in function); None where torch
    records nothing."""
    if recorded is None:
        recorded = entries()
        if recorded is None:
            return None
    record: dict[str, Any] = {
        "rank": rank, "reason": reason, "dumped_at_ns": time.time_ns(),
        "position": None if position is None else {"step": position[0], "micro": position[1], "phase": position[2]},
        "entries": [{key: entry.get(key) for key in KEPT_FIELDS} for entry in recorded],
    }
    if where is not None:
        record["where"] = where
    from ddp_amp.files import atomic_write

    path = dump_path(run_dir, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(record).encode())
    return path
