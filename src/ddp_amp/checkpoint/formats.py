"""The two checkpoint formats (--checkpoint-format), each one object with what differs between them: what a rank
stages at a save, how the staged state is written, and how a checkpoint's model and optimizer are loaded back.
The checkpoint manager does the rest (when to save, the random states, the background write, the resume
agreement) the same for both.

single   step-<N>.pt: the whole state gathered on the run dir's writers and written by each (storage).
sharded  step-<N>/: a torch.distributed.checkpoint directory, every rank writing its part (checkpoint.sharded), on
         a gloo group of its own, so that the background writes' collectives never interleave with the training's.

A run resumes from either format whatever its own: the checkpoint says which format reads it (format_of).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from ddp_amp.checkpoint import sharded, storage
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, SideGroup
from ddp_amp.errors import RankUsageError
from ddp_amp.train.parts import Parts


class NonFiniteState(Exception):
    """The staged state holds inf/NaN: nothing written (pruning would otherwise delete the last good checkpoints
    for it). `where`: what to name in this rank's warning, None where another rank warns."""

    def __init__(self, where: str | None) -> None:
        super().__init__(where)
        self.where = where


class CheckpointFormat:
    """What a format does; every method but write() and close() runs on the training thread."""

    name: ClassVar[str]
    """Its --checkpoint-format name."""
    every_rank_writes: ClassVar[bool]
    """Every rank writes (and waits for its previous write before staging); else only the run dir's writers do,
    and the others return after staging."""
    libraries: ClassVar[tuple[str, ...]] = ()
    """The torch.distributed modules it uses, imported before the memory baseline (rank.setup)."""

    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: Path) -> None:
        self.config, self.env, self.run_dir = config, env, run_dir

    def held(self, parts: Parts) -> tuple[Any, int]:
        """(what stage() needs of this rank's state, the bytes of it that no other rank holds), before the
        manager's gather of every rank's random state and these bytes."""
        raise NotImplementedError

    def stage(self, parts: Parts, held: Any, writers: list[int], owns: list[int]) -> tuple[Any, Any]:
        """(the checkpoint's trainer part, None where this rank writes none; this rank's own part) on the
        device, before the copy to host memory. `owns`: every rank's bytes from held()."""
        raise NotImplementedError

    def write(self, state: dict[str, Any], local: Any, tag: str) -> Path | None:
        """In the background: the checkpoint written (its path where this rank wrote it whole, else None);
        NonFiniteState where it holds inf/NaN."""
        raise NotImplementedError

    def check_writers(self, writers: list[int]) -> None:
        """Refuse, before resuming, a run this format cannot checkpoint (`writers`: the ranks that write the run
        dir, one per node without a shared file system)."""

    @staticmethod
    def load_weights(path: Path, state: dict[str, Any], parts: Parts) -> None:
        """Every rank: the model and the optimizer from a checkpoint of this format (after the other parts)."""
        raise NotImplementedError

    def close(self) -> None:
        """After the last write (the manager waits for it first)."""


class SingleFile(CheckpointFormat):
    name: ClassVar[str] = "single"
    every_rank_writes: ClassVar[bool] = False

    def held(self, parts: Parts) -> tuple[Any, int]:
        return None, 0  # the writers write it all: nothing to split

    def stage(self, parts: Parts, held: Any, writers: list[int], owns: list[int]) -> tuple[Any, Any]:
        """Collective: sharded state (--shard optimizer or full) is gathered whole on the writers."""
        return parts.whole_state(writers), None

    def write(self, state: dict[str, Any], local: Any, tag: str) -> Path:
        """In the background: the finiteness check runs on the host copy, off the training thread."""
        if bad := storage.nonfinite_tensors(state["trainer"]):
            raise NonFiniteState(bad[0].lstrip("."))
        return storage.save_checkpoint(self.run_dir, state, keep=self.config.keep, protect_step=_best_step(state))

    @staticmethod
    def load_weights(path: Path, state: dict[str, Any], parts: Parts) -> None:
        """From the checkpoint's whole state, each rank taking what it holds in this run's parallel mode (any
        mode's checkpoint)."""
        parts.load_whole(state["trainer"])


class ShardedDirectory(CheckpointFormat):
    name: ClassVar[str] = "sharded"
    every_rank_writes: ClassVar[bool] = True
    libraries: ClassVar[tuple[str, ...]] = ("torch.distributed.checkpoint", "torch.distributed.checkpoint.state_dict")

    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: Path) -> None:
        super().__init__(config, env, run_dir)
        self._side: SideGroup | None = SideGroup()  # made by every rank together, as the manager is

    def held(self, parts: Parts) -> tuple[Any, int]:
        """Views of this rank's part of the model and the optimizer, and the bytes of its own tensors (those
        that are not replicated): every rank's count decides the split of what all ranks hold."""
        views = sharded.local_state(*parts.weights())
        return views, sharded.own_bytes(views, parts.replicated())

    def stage(self, parts: Parts, held: Any, writers: list[int], owns: list[int]) -> tuple[Any, Any]:
        """(the extras on the writers; this rank's share of the tensors); no collective."""
        extras = parts.extras() if self.env.rank in writers else None
        return extras, sharded.own_share(held, parts.replicated(), self.env.rank, owns)

    def write(self, state: dict[str, Any], local: Any, tag: str) -> Path | None:
        """On every rank, in the background (collectives on the format's own group): no rank writes when any
        rank's part holds inf/NaN; else each writes its part, and rank 0 the extras, renames the directory into
        place, writes the sidecar and prunes (it returns the path; the others None)."""
        group = self._side.group
        bad = torch.tensor([float(sharded.nonfinite(local))])
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=group)
        if bad.item():
            raise NonFiniteState("the model or optimizer" if self.env.rank == 0 else None)
        directory = storage.checkpoint_dir(self.run_dir)
        if self.env.rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
        path = sharded.write(directory, state["step"], tag, local, state if self.env.rank == 0 else None, group)
        if path is not None:
            storage.write_sidecar(path, state)
            storage.drop_other_format(path)
            storage.prune(self.run_dir, self.config.keep, self.config.launch_time, _best_step(state))
        return path

    def check_writers(self, writers: list[int]) -> None:
        if len(writers) > 1:
            raise RankUsageError("--checkpoint-format sharded needs a run directory that every node shares (each "
                                 "rank writes its part of every checkpoint there), and this job's nodes each "
                                 "have their own; drop the flag to write whole checkpoints on every node")

    @staticmethod
    def load_weights(path: Path, state: dict[str, Any], parts: Parts) -> None:
        """Every rank reads its part (a node without the directory fails here, as it must), after the extras."""
        sharded.load_local_state(path, *parts.weights())
        parts.after_sharded_load()

    def close(self) -> None:
        if self._side is not None:
            self._side.close()
            self._side = None


FORMATS: dict[str, type[CheckpointFormat]] = {cls.name: cls for cls in (SingleFile, ShardedDirectory)}


def format_of(state: dict[str, Any]) -> type[CheckpointFormat]:
    """The format that reads a checkpoint, from its state ("format": "sharded"; none is single)."""
    return FORMATS[state.get("format", SingleFile.name)]


def format_marker(checkpoint_format: type[CheckpointFormat]) -> dict[str, str]:
    """What a checkpoint's state says of its format (nothing for single, as before formats were named)."""
    return {} if checkpoint_format is SingleFile else {"format": checkpoint_format.name}


def _best_step(state: dict[str, Any]) -> int | None:
    """The step of the best evaluation so far (--keep-best): its checkpoint is never pruned."""
    return (state["trainer"].get("best") or {}).get("step")
