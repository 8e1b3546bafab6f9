"""What a script's loop is told: the options of the ddp-amp command line that apply to it (config.json in the run
directory, written by the launcher), over the defaults the script gives `setup()`; outside ddp-amp (plain
torchrun, or `python script.py`) the script's defaults alone."""

from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from ddp_amp.config import TrainConfig
from ddp_amp.config.script import LOOP_OPTIONS
from ddp_amp.errors import UsageError
from ddp_amp.precision import (
    BF16_TRUE,
    FP8_RECIPES,
    Precision,
    cuda_devices_have_native_bf16,
    resolve_precision,
)

RUN_DIR_VAR = "DDP_AMP_RUN_DIR"
"""Set by ddp-amp for a script's ranks (rank.script): the run directory, which holds config.json."""
DEFAULT_RUN_DIR = "ddp-amp-loop"
"""Outside ddp-amp, where a script that names no run_dir keeps its checkpoints and metrics."""


class LoopError(Exception):
    """A call of ddp_amp.loop used wrongly, or a checkpoint that cannot be continued: one line, the cause named."""


@dataclasses.dataclass(frozen=True)
class LoopSettings:
    amp: str = "auto"
    dtype: str = "auto"
    grad_accum: int = 1
    clip_grad: float | None = None
    shard: str = "none"
    checkpoint_every: int = 0
    keep: int = 2
    checkpoint_format: str = "single"
    async_checkpoint: bool = True
    resume: str | None = None
    log_every: int = 10
    seed: int = 0
    device: str = "auto"
    tensorboard: bool = False
    tracker: tuple[str, ...] = ()
    tracker_project: str | None = None
    tracker_run_name: str | None = None
    tracker_tag: tuple[str, ...] = ()
    run_dir: str = DEFAULT_RUN_DIR
    launch_time: float = dataclasses.field(default_factory=time.time)
    under_ddp_amp: bool = False
    """Launched by ddp-amp (a launcher reads the ranks' progress and holds config.json)."""

    @classmethod
    def resolve(cls, defaults: dict[str, Any]) -> LoopSettings:
        """The script's `defaults` (setup's keyword arguments), then the command line's options from config.json
        where ddp-amp launched the script; checked as the command line's are."""
        unknown = sorted(set(defaults) - {f.name for f in dataclasses.fields(cls)} - {"under_ddp_amp"})
        if unknown:
            raise LoopError(f"setup(): unknown setting{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                            f"the settings are {', '.join(LOOP_OPTIONS)} and run_dir")
        values = {**defaults}
        run_dir = os.environ.get(RUN_DIR_VAR)
        if run_dir:
            values.update(_command_line(Path(run_dir)), run_dir=run_dir, under_ddp_amp=True)
        try:  # checked as the command line's options are (setup(grad_accum=0) is --grad-accum 0)
            TrainConfig(**{key: values[key] for key in LOOP_OPTIONS if key in values})
        except UsageError as exc:
            raise LoopError(f"setup(): {exc}") from None
        for name in ("tracker", "tracker_tag"):  # config.json holds them as lists
            values[name] = tuple(values.get(name) or ())
        return cls(**values)

    def check_run_dir(self) -> None:
        """Outside ddp-amp (plain torchrun, python), the rule ddp-amp's launcher applies before it starts a loop
        script: a run dir that holds an earlier run is continued only when asked (resume, or a restart by
        torchrun's agent or Slurm), never started over from step 0 beside the earlier metrics and checkpoints."""
        from ddp_amp.outputs import earlier_run

        restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0 or \
            int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0
        if self.under_ddp_amp or self.resume is not None or restarted:
            return
        if earlier := earlier_run(Path(self.run_dir)):
            raise LoopError(f"setup(): {self.run_dir} holds an earlier run ({', '.join(earlier)}); continue it "
                            "with setup(resume='auto'), or give another run_dir (setup(run_dir=...))")

    def precision(self, device: torch.device) -> Precision:
        """--amp/--dtype by the core's rules; --amp auto on a CPU (which the core decides by measuring the task's
        own step) is fp32 for a script's loop."""
        if self.dtype == BF16_TRUE or self.dtype in FP8_RECIPES:  # refused on the command line; setup() comes here
            raise LoopError(f"setup(): dtype={self.dtype!r} is for ddp-amp's own loop (its fp32 master weights, its "
                            "fp8 layers); a script's loop takes dtype='bf16' (autocast)")
        try:
            chosen = resolve_precision(device.type, self.amp, self.dtype, cuda_bf16=device.type == "cuda" and
                                       cuda_devices_have_native_bf16([device.index]))
        except UsageError as exc:  # e.g. --dtype bf16 on GPUs without it
            raise LoopError(f"setup(): {exc}") from None
        if chosen.warning and int(os.environ.get("RANK", "0")) == 0:
            print(f"ddp-amp loop: warning: {chosen.warning}", flush=True)
        return chosen


def _command_line(run_dir: Path) -> dict[str, Any]:
    """The loop options the command line gave (those that differ from their defaults), and the launch time."""
    try:
        record = json.loads((run_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    defaults = dataclasses.asdict(TrainConfig())
    given = {key: record[key] for key in LOOP_OPTIONS if key in record and record[key] != defaults[key]}
    if record.get("launch_time"):
        given["launch_time"] = record["launch_time"]
    return given
