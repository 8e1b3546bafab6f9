"""Where each rank's time goes, interval by interval, and which rank holds the others back.

Each rank times its phases on the host (train.step.AmpStep.position: two clock reads per change, no device
sync). At a log interval its seconds per phase ride along in the log's all-reduce, one row per rank (a sum of
rows that are zero but one's), so every rank learns every rank's figures without a collective of their own.
The log phase's figure is the wait at the previous log's all-reduce: this one is not over when it is sent.

A rank is `slow` when its busy time over the last WINDOW intervals is SLOW_SHARE or more above the ranks'
median, by at least COSTS_AT_LEAST of the wall time. Busy: data, forward and the optimizer step. Backward is
left out: it holds DDP's gradient all-reduce, in which the fast ranks wait for the slow one, so every rank's
backward lasts as long as the slowest rank's step. (On a GPU the host times are those of launching the
kernels; a rank whose device is slow shows as a longer wait where the host meets the device: the loss read at
the log.)
"""

from __future__ import annotations

import statistics
from collections import deque

import torch

from ddp_amp.train.step import DATA, FORWARD, PHASES, STEP

SLOW_SHARE = 0.10
COSTS_AT_LEAST = 0.05
"""...and its excess is at least this share of the window's wall time: a rank 10% slower in a phase that is a
sliver of the step (a few ms of host time, easily noise) holds nobody back."""
WINDOW = 3
BUSY_PHASES = (DATA, FORWARD, STEP)


class StragglerWatch:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.recent: deque[list[float]] = deque(maxlen=WINDOW)
        """Each recent interval's busy seconds, per rank."""
        self.recent_wall: deque[float] = deque(maxlen=WINDOW)
        self.totals = [[0.0] * len(PHASES) for _ in range(world_size)]
        self.ever_slow: set[int] = set()
        self.slow: list[int] = []

    def pack(self, phase_s: list[float], device: torch.device) -> torch.Tensor:
        """This rank's row in a zero table of all ranks, flat, to be summed over the ranks."""
        table = torch.zeros(self.world_size, len(PHASES))
        table[self.rank] = torch.tensor(phase_s)
        return table.flatten().to(device)

    def unpack(self, values: list[float]) -> list[list[float]]:
        """Every rank's seconds per phase for the interval (from the summed table); updates who is slow."""
        rows = [values[r * len(PHASES):(r + 1) * len(PHASES)] for r in range(self.world_size)]
        for total, row in zip(self.totals, rows):
            for phase, seconds in enumerate(row):
                total[phase] += seconds
        self.recent.append([sum(row[phase] for phase in BUSY_PHASES) for row in rows])
        self.recent_wall.append(max(sum(row) for row in rows))
        busy = [sum(interval[r] for interval in self.recent) for r in range(self.world_size)]
        median, wall = statistics.median(busy), sum(self.recent_wall)
        self.slow = ([r for r, b in enumerate(busy)
                      if b >= (1 + SLOW_SHARE) * median and b - median >= COSTS_AT_LEAST * wall]
                     if self.world_size > 1 and len(self.recent) == WINDOW and median > 0 else [])
        self.ever_slow.update(self.slow)
        return rows

    def summary(self) -> dict[str, object]:
        return {"time_per_rank_s": {str(r): dict(zip(PHASES, (round(s, 4) for s in row)))
                                for r, row in enumerate(self.totals)},
                "slow_ranks": sorted(self.ever_slow)}
