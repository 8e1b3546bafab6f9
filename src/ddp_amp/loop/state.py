"""A script loop's checkpoints: the state restore() registered (models and optimizers whole, in the plain formats
whatever the parallel mode, so that a run continues in another mode or on another world size; schedulers, the
scaler, the loader's position, anything with a state_dict) and every rank's random state, in the core's file
format (checkpoint.fileformat: atomic, pruned to --keep, weights-only loading, a sidecar to choose by)."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ddp_amp.checkpoint import fileformat
from ddp_amp.loop.settings import LoopError
from ddp_amp.outputs import cut_metrics

SCALER_KEY = "_scaler"
"""The gradient scaler's state (fp16's loss scale), beside the registered names."""


def launch_identity(settings: Any) -> str:
    """Which launch a checkpoint belongs to, the same across torchrun's restarts of it: under ddp-amp its launch
    time (config.json's); under plain torchrun its run id; else this process's start."""
    if settings.under_ddp_amp:
        return f"ddp-amp:{settings.launch_time!r}"
    return f"torchrun:{os.environ['TORCHELASTIC_RUN_ID']}" if "TORCHELASTIC_RUN_ID" in os.environ else \
        f"process:{settings.launch_time!r}"


class Checkpoints:
    def __init__(self, run: Any) -> None:  # the ddp_amp.loop.Loop it serves
        self.run = run
        self.registered: dict[str, Any] = {}
        self.last_step: int | None = None
        self.last_path: Path | None = None
        self.resumed_from: Path | None = None
        """The checkpoint restore() continued from, and its step (loop.json)."""
        self.resumed_from_step: int | None = None

    def restore(self, state: dict[str, Any]) -> int:
        for name, value in state.items():
            if not (hasattr(value, "state_dict") and hasattr(value, "load_state_dict")):
                raise LoopError(f"restore(): {name}={type(value).__name__} has no state_dict()/load_state_dict() to "
                                "save and load")
        self.registered = dict(state)
        chosen = self._resume_choice()
        if chosen is None:
            return 0
        path, saved = chosen
        self._load(path, saved)
        step = int(saved["step"])
        if self.run.rank == 0:
            cut_metrics(self.run.run_dir, step)  # the steps after it are reported again
        self.last_step = step
        self.resumed_from, self.resumed_from_step = path, step
        if self.run.rank == 0:
            print(f"ddp-amp loop: resumed from {path} (step {step})", flush=True)
        return step

    def _resume_choice(self) -> tuple[Path, dict[str, Any]] | None:
        """The checkpoint to continue from, the same on every rank (rank 0 chooses): after a restart by torchrun's
        agent or a Slurm requeue the newest valid one this run wrote, else --resume PATH; --resume auto the newest
        valid one; None for a fresh start."""
        chosen: list[Any] = [self._choose() if self.run.rank == 0 else None]
        if self.run.world_size > 1:
            dist.broadcast_object_list(chosen, src=0)
        if chosen[0] is None:
            return None
        path = Path(chosen[0])
        try:  # every rank reads the one rank 0 chose (newest_valid_checkpoint checked it already)
            saved = fileformat.load_checkpoint(path)
        except fileformat.CheckpointError as exc:
            raise LoopError(f"--resume {exc}") from None
        if bad := fileformat.nonfinite_tensors(saved["trainer"]):
            raise LoopError(f"--resume {path}: refused, it holds inf/NaN (in {bad[0].lstrip('.')})")
        return path, saved

    def _choose(self) -> str | None:
        """Rank 0's choice: a checkpoint's path, or None for a fresh start. The core's rule
        (checkpoint.manager.checkpoint_to_continue): after a restart by torchrun's agent, this launch's newest
        checkpoint, and before this launch wrote one, what --resume chose (never a newer one of an earlier run
        that --resume PATH passed over); --resume auto, or a Slurm requeue (a new launch continuing the job's
        work), the newest valid one."""
        resume = self.run.settings.resume
        if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0) > 0:
            mine = launch_identity(self.run.settings)
            found = fileformat.newest_valid_checkpoint(
                self.run.run_dir, warn=self._warn, accept=lambda metadata: metadata["config"].get("launch") == mine)
            if found is not None:
                return str(found[0])
        if resume == "auto" or int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0) > 0:
            found = fileformat.newest_valid_checkpoint(self.run.run_dir, warn=self._warn)
            if found is not None:
                return str(found[0])
            if resume == "auto":
                print(f"ddp-amp loop: --resume auto: no checkpoint in {fileformat.checkpoint_dir(self.run.run_dir)}: "
                      "starting from the beginning", flush=True)
        return None if resume is None or resume == "auto" else resume

    def _warn(self, line: str) -> None:
        if self.run.rank == 0:
            print(f"ddp-amp loop: {line}", flush=True)

    def _load(self, path: Path, saved: dict[str, Any]) -> None:
        """Every registered name from the checkpoint, checked first: nothing is loaded when a name is missing or
        a model's weights do not fit."""
        held = saved["trainer"]
        if int(saved.get("world_size", self.run.world_size)) != self.run.world_size:  # an elastic restart's
            raise LoopError(f"--resume {path}: written by {saved['world_size']} ranks and this run has "
                            f"{self.run.world_size}: the loop continues on the world size that saved it")
        missing = sorted(set(self.registered) - set(held))
        if missing or saved.get("config", {}).get("loop") is not True:
            what = f"no {', '.join(missing)} in it" if missing else "it is not a checkpoint of ddp_amp.loop"
            names = ", ".join(sorted(key for key in held if key != SCALER_KEY))
            raise LoopError(f"--resume {path}: {what} (it holds {names})")
        strategy = self.run.strategy
        for name, value in self.registered.items():  # the models first: an optimizer's load needs its model's
            if (module := self.run._modules.get(id(value))) is not None:
                try:
                    strategy.load_model_state(module, held[name])
                except RuntimeError as exc:
                    raise LoopError(f"--resume {path}: its {name} does not fit the model given for it: "
                                    f"{' '.join(str(exc).split())[:300]}") from None
        for name, value in self.registered.items():
            if (owner := self.run._owner.get(id(value))) is not None:
                strategy.load_optimizer_state(self.run._modules[id(owner)], value, held[name])
            elif id(value) not in self.run._modules:
                value.load_state_dict(held[name])
        if held.get(SCALER_KEY):
            self.run.scaler.load_state_dict(held[SCALER_KEY])
        rng = saved["rng"]
        fileformat.set_rng_state(rng[self.run.rank % len(rng)], self.run.device)

    def save(self, step: int) -> Path | None:
        """Every rank (gathering the random states, and a sharded model's weights, are collective)."""
        if not self.registered:
            raise LoopError("save(): nothing to save; register the state with restore(model=..., optimizer=...) first")
        run = self.run
        rngs: list[Any] = [None] * run.world_size
        dist.all_gather_object(rngs, fileformat.rng_state(run.device))
        held = self._state_dicts()
        self.last_step = step
        if run.rank != 0:
            return None
        if bad := fileformat.nonfinite_tensors(held):
            print(f"ddp-amp loop: warning: no checkpoint at step {step}: inf/NaN in {bad[0].lstrip('.')}", flush=True)
            return None
        config = {**{key: getattr(run.settings, key) for key in ("amp", "dtype", "grad_accum", "shard", "seed")},
                  "launch_time": run.settings.launch_time, "launch": launch_identity(run.settings), "loop": True}
        state = {"step": step, "saved_at": time.time(), "world_size": run.world_size, "config": config,
                 "trainer": fileformat.to_host(held), "rng": rngs}
        self.last_path = fileformat.save_checkpoint(run.run_dir, state, keep=run.settings.keep)
        return self.last_path

    def _state_dicts(self) -> dict[str, Any]:
        """Each registered name's state, whole on rank 0 ({} for the models and optimizers elsewhere)."""
        run, held = self.run, {}
        for name, value in self.registered.items():
            if (module := run._modules.get(id(value))) is not None:
                held[name] = run.strategy.full_state(module, None, [0])[0]
            elif (owner := run._owner.get(id(value))) is not None:
                held[name] = run.strategy.full_state(run._modules[id(owner)], value, [0])[1]
            else:
                held[name] = value.state_dict()
        held[SCALER_KEY] = run.scaler.state_dict()
        return held
