"""A user's own training script in a launch: what each rank runs instead of ddp-amp's loop, and the training
options such a script takes from the command line when it trains with ddp_amp.loop. Plain data, no torch."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

LOOP_OPTIONS = ("amp", "dtype", "grad_accum", "clip_grad", "shard", "checkpoint_every", "keep", "checkpoint_format",
                "async_checkpoint", "resume", "log_every", "seed", "device", "tensorboard", "tracker",
                "tracker_project", "tracker_run_name", "tracker_tag")
"""The training options that a script using ddp_amp.loop takes from the command line (the launcher accepts them
for such a script only): each means for the script's loop what it means for ddp-amp's own."""


@dataclass(frozen=True)
class Script:
    """A user's own training script, launched instead of ddp-amp's loop (ddp_amp.launch.script checks it,
    ddp_amp.rank.script runs it on each rank): what each rank runs, as `python TARGET ARGS` (or `python -m
    TARGET ARGS` with `module`) would."""

    target: str
    """The script's path as given (its sys.argv[0]), or the module's dotted name."""
    args: tuple[str, ...] = ()
    module: bool = False
    path: str | None = None
    """The script's absolute path (None for a module): the ranks run this file whatever their working directory."""
    cwd: str = "."
    """The launcher's working directory: the ranks' own, as under torchrun."""

    def argv(self) -> list[str]:
        """The command line after `python`: what the run record and torchrun's form show."""
        return [*(["-m"] if self.module else []), self.target, *self.args]

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "args": list(self.args)}

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> Script:
        return cls(**{**values, "args": tuple(values["args"])})
