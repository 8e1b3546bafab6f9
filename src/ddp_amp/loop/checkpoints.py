"""A script loop's checkpoints: the core's checkpoint manager (checkpoint.manager, what ddp-amp's own loop uses)
over the state restore() registered, by the script's names (train.parts.NamedParts). So a script's loop has what
the built-in one has: single files or sharded directories (--checkpoint-format), asynchronous writes
(--async-checkpoint), --keep, torn or unreadable checkpoints skipped for the next newest, a resume onto another
world size (each sample of the epoch once), and one resume rule."""

from __future__ import annotations

import atexit
import dataclasses
import dis
import os
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch.distributed as dist

from ddp_amp.checkpoint import storage
from ddp_amp.checkpoint.manager import CheckpointManager
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv
from ddp_amp.errors import RankSetupError, RankUsageError
from ddp_amp.loop.settings import LoopError, LoopSettings
from ddp_amp.outputs import cut_metrics
from ddp_amp.rank.script import at_script_return, forget_at_script_return
from ddp_amp.train.parts import NamedParts

CONFIG_KEYS = ("amp", "dtype", "grad_accum", "shard", "seed", "checkpoint_every", "keep", "checkpoint_format",
               "async_checkpoint")
"""The loop's settings that are the core's options for its checkpoints (and recorded in each one's config)."""


def launch_time(settings: LoopSettings) -> float:
    """Which launch a checkpoint belongs to, the same on every rank and across torchrun's restarts of the ranks:
    under ddp-amp its launch time (config.json's); under plain torchrun the start of rank 0's agent (the ranks'
    parent, which outlives their restarts); else this process's start. Every rank takes rank 0's."""
    chosen = settings.launch_time
    if not settings.under_ddp_amp and "TORCHELASTIC_RUN_ID" in os.environ:
        chosen = _parent_start_time() or chosen
    if dist.get_world_size() > 1:
        shared = [chosen]
        dist.broadcast_object_list(shared, src=0)
        chosen = shared[0]
    return chosen


def _parent_start_time() -> float | None:
    """The parent process's start (seconds since the epoch), from /proc; None where that cannot be read."""
    try:
        fields = Path(f"/proc/{os.getppid()}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of stat(5): starttime, in ticks
    except (OSError, ValueError, IndexError, StopIteration):
        return None


class LoopCheckpoints:
    """Made in setup(), by every rank at once (a sharded format makes a process group of its own)."""

    def __init__(self, run: Any) -> None:  # the ddp_amp.loop.Loop it serves
        self.run = run
        settings = run.settings
        config = TrainConfig(**{key: getattr(settings, key) for key in CONFIG_KEYS}, compile=False,
                             launch_time=launch_time(settings))
        env = DistEnv(run.rank, run.local_rank, run.world_size, int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
                      os.environ.get("MASTER_ADDR", ""), int(os.environ.get("MASTER_PORT", "0") or 0),
                      shares_run_dir_with_rank0=run.rank != 0)  # rank 0 alone writes (the run dir is shared)
        self.manager = CheckpointManager(config, env, run.run_dir, run.device)
        self.parts: NamedParts | None = None
        self.resumed_from: Path | None = None
        """The checkpoint restore() continued from, and its step (loop.json)."""
        self.resumed_from_step: int | None = None

    @property
    def last_path(self) -> Path | None:
        return self.manager.last_path

    @property
    def last_step(self) -> int | None:
        return self.manager.last_step

    def restore(self, state: dict[str, Any]) -> int:
        for name, value in state.items():
            if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise LoopError(f"restore(): {name}={type(value).__name__} has no state_dict()/load_state_dict() to "
                                "save and load")
        run = self.run
        models = {name: run._modules[id(value)] for name, value in state.items() if id(value) in run._modules}
        optimizers = {name: (run._modules[id(run._owner[id(value)])], value) for name, value in state.items()
                      if id(value) in run._owner}
        others = {name: value for name, value in state.items() if name not in models and name not in optimizers}
        self.parts = NamedParts(run.strategy, run.scaler, models, optimizers, others)
        manager = self.manager
        manager.config = dataclasses.replace(manager.config, resume=self._resume_path())
        try:
            restored = manager.load(self.parts, writers=[0])
        except (RankSetupError, RankUsageError) as exc:
            raise LoopError(str(exc)) from None
        if restored is None:
            if run.rank == 0:  # from the beginning: an earlier attempt's lines go, as the core drops them
                cut_metrics(run.run_dir, 0)
            return 0
        manager.last_step = restored.step  # a stop at this very step saves nothing new
        self.resumed_from, self.resumed_from_step = restored.path, restored.step
        if run.rank == 0:
            cut_metrics(run.run_dir, restored.step)  # the steps after it are reported again
            print(f"ddp-amp loop: resumed from {restored.path} (step {restored.step})", flush=True)
        return restored.step

    def _resume_path(self) -> str | None:
        """What --resume names for the manager, the same on every rank (rank 0 chooses): --resume auto, or a
        Slurm requeue (a new launch continuing the job's work), the newest valid checkpoint; else --resume PATH.
        After a restart by torchrun's agent the manager continues from this launch's newest checkpoint first."""
        resume = self.run.settings.resume
        if resume != "auto" and not int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0):
            return resume
        chosen: list[Any] = [None]
        if self.run.rank == 0:
            found = storage.newest_valid_checkpoint(self.run.run_dir, warn=self._warn)
            chosen = [str(found[0]) if found else None]
            if found is None and resume == "auto":
                print(f"ddp-amp loop: --resume auto: no checkpoint in {storage.checkpoint_dir(self.run.run_dir)}: "
                      "starting from the beginning", flush=True)
        if self.run.world_size > 1:
            dist.broadcast_object_list(chosen, src=0)
        return chosen[0] if chosen[0] is not None or resume == "auto" else resume

    def _warn(self, line: str) -> None:
        print(f"warning: {line}", flush=True)

    def save(self, step: int) -> Path | None:
        """Every rank (gathering the random states, and a sharded model's weights, are collective); the path on
        rank 0, which writes it (in the background: there once the write is done)."""
        if self.parts is None:
            raise LoopError("save(): nothing to save; register the state with restore(model=..., optimizer=...) first")
        self.manager.save(self.parts, step)
        if self.run.rank != 0:
            return None
        name = f"step-{step}" if self.manager.config.checkpoint_format == "sharded" else f"step-{step}.pt"
        return storage.checkpoint_dir(self.run.run_dir) / name

    def close(self) -> None:
        """The write in flight finished (its error raised here), the format's resources released."""
        self.manager.close()


class UnfinishedCheck:
    """When the script ends without finish(): the checkpoint write in flight waited for (its error raised under
    ddp-amp, which then reports the rank failed; under python or torchrun, where an error in an atexit handler
    changes no exit status, said and the process ended with status 1), and rank 0 says what was not written.
    It holds the checkpoint manager alone, not the loop: a script's models are not kept alive by it."""

    def __init__(self, manager: CheckpointManager, rank: int, under_ddp_amp: bool) -> None:
        self.manager, self.rank, self.under_ddp_amp = manager, rank, under_ddp_amp
        self.main_frame = None
        if under_ddp_amp:
            at_script_return(self.at_return)
        else:
            self.main_frame = _main_module_frame()
            atexit.register(self.at_exit)

    def cancel(self) -> None:
        """finish() was called: nothing to check."""
        forget_at_script_return(self.at_return) if self.under_ddp_amp else atexit.unregister(self.at_exit)
        self.main_frame = None

    def at_return(self, exit_code: int | None) -> None:
        """`exit_code` None: the script ended by SystemExit, its status unknown here (atexit is not told it)."""
        self.manager.wait()
        if self.rank != 0 or exit_code not in (0, None):
            return
        if exit_code == 0:
            print(f"{UNFINISHED} (call run.finish(model=model) once, after the loop)", file=sys.stderr, flush=True)
        else:  # said as it is: sys.exit(3) may be a failure, not a clean end that forgot finish()
            print("ddp_amp.loop: the script exited by sys.exit or SystemExit without finish(): no model.pt and no "
                  "loop.json written", file=sys.stderr, flush=True)

    def at_exit(self) -> None:
        try:  # an uncaught exception left sys.last_value before atexit's handlers run: said already
            self.at_return(1 if hasattr(sys, "last_value") else _exit_code(self.main_frame))
        except BaseException as exc:  # the process must not exit 0 past a lost checkpoint
            print(f"ddp_amp.loop: the checkpoint write in flight failed: {type(exc).__name__}: {exc}",
                  file=sys.stderr, flush=True)
            os._exit(1)


UNFINISHED = "ddp_amp.loop: the script ended without finish(): no model.pt and no loop.json written"
RETURNS = {dis.opmap[name] for name in ("RETURN_VALUE", "RETURN_CONST") if name in dis.opmap}


def _main_module_frame() -> FrameType | None:
    """The frame that runs the __main__ module (`python script.py`, `python -m module`, torchrun's ranks), or None
    (an interactive session, setup() in a thread). Kept, so that at exit its last instruction tells whether the
    script ran to its end or left it by SystemExit, whose status atexit's handlers are not told."""
    main = sys.modules.get("__main__")
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and main is not None
                                     and frame.f_globals is vars(main)):
        frame = frame.f_back
    return frame


def _exit_code(main_frame: FrameType | None) -> int | None:
    """0 where the __main__ module ran to its end (its last instruction a return), or where its frame was not
    found; None where it was left by SystemExit (sys.exit(3), raise SystemExit("msg"): the status is not known
    here)."""
    if main_frame is None:  # not found (setup() in a thread, an interactive session): said as before, an end
        return 0
    if main_frame.f_lasti < 0:
        return None
    return 0 if main_frame.f_code.co_code[main_frame.f_lasti] in RETURNS else None
