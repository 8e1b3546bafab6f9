"""The checkpoint manager of one rank: `load` (resume agreement), `save` every --checkpoint-every steps,
`wait` for the write in flight and `close`.

Saving gathers every rank's RNG state (a collective), copies the state to host memory and writes it from a
background thread (atomically, see fileformat.save_checkpoint), so training waits for the copy only; with
--no-async-checkpoint the loop writes it itself. Each save's blocked seconds, and whether it waited for the
previous write, go into the next metrics.jsonl line (`checkpoints`) and, averaged, into summary.json.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from ddp_amp import outputs
from ddp_amp.checkpoint import fileformat, sharded
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, SideGroup
from ddp_amp.errors import RankSetupError, RankUsageError
from ddp_amp.files import writer_tag

if TYPE_CHECKING:
    from ddp_amp.train.trainer import Trainer


class CheckpointManager:
    def __init__(self, config: TrainConfig, env: DistEnv, run_dir: Path, device: torch.device) -> None:
        self.config, self.env, self.run_dir, self.device = config, env, run_dir, device
        self.last_path: Path | None = None
        """The newest checkpoint written (after wait()); never one that held inf/NaN."""
        self.last_step: int | None = None
        self.nonfinite_steps: list[int] = []
        """Steps whose state held inf/NaN: no checkpoint written (it would have replaced a good one)."""
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.blocked_s: list[float] = []
        """Per checkpoint, the seconds the training loop waited (gathering the state, waiting for the previous
        write if it was still going, copying to host memory): what a save costs the loop."""
        self.write_s: list[float] = []
        """Per checkpoint written, the background write's seconds (pickling, temporary file, fsync, rename)."""
        self.waits = 0
        """Saves that had to wait for the previous checkpoint's write (at most one is ever in flight)."""
        self.skipped: list[str] = []
        """Why load() passed over each checkpoint it could not continue from ("PATH: why"): after a restart the
        launcher says them, as its preflight does for --resume auto."""
        self._unlogged: list[dict[str, Any]] = []
        self.sharded = config.checkpoint_format == "sharded"
        """Every rank writes its part of each checkpoint (checkpoint.sharded), on a gloo group of its own: the
        background writes' collectives never interleave with the training's."""
        self._side = SideGroup() if self.sharded else None

    def due(self, step: int) -> bool:
        return bool(self.config.checkpoint_every) and step % self.config.checkpoint_every == 0

    def saved(self, step: int) -> bool:
        return self.last_step == step

    def save(self, trainer: Trainer, step: int) -> None:
        started, waits = time.perf_counter(), self.waits
        try:
            self._save(trainer, step)
        finally:
            self.blocked_s.append(time.perf_counter() - started)
            if self.env.writes_run_dir:
                self._unlogged.append({"step": step, "blocked_s": round(self.blocked_s[-1], 6),
                                       "waited": self.waits > waits})

    def take_unlogged(self) -> dict[str, Any]:
        """The saves since the last metrics line, for the next one: {"checkpoints": [{step, blocked_s, waited}]}
        on the ranks that write the run dir (a save comes after its step's line), else nothing."""
        taken, self._unlogged = self._unlogged, []
        return {"checkpoints": taken} if taken else {}

    def _save(self, trainer: Trainer, step: int) -> None:
        ranks = [None] * self.env.world_size
        views = sharded.local_state(trainer.module, trainer.optimizer) if self.sharded else None
        replicated = trainer.strategy.replicated_parts  # written by one rank each
        # A collective: every rank, every time. Each rank's RNG states and, for iterable data, its position
        # (and, sharded, the bytes of its own state, for the split of what all ranks hold).
        dist.all_gather_object(ranks, (fileformat.rng_state(self.device), trainer.data.rank_state(),
                                       sharded.own_bytes(views, replicated) if views else 0,
                                       self.env.writes_run_dir, writer_tag()))
        writers = [rank for rank, (*_, writes, _) in enumerate(ranks) if writes]
        self.last_step = step
        if self.sharded:  # every rank writes its part: every rank waits for its previous write, then stages
            self._note_wait()
            extras = trainer.state_dict(writers, whole=False)
            local = fileformat.to_host(sharded.own_share(views, replicated, self.env.rank, [r[2] for r in ranks]))
        else:  # sharded state (--shard optimizer or full) is gathered whole on the writers: collective too
            trained = trainer.state_dict(writers)
            if not self.env.writes_run_dir:
                return
            self._note_wait()
        rng, data_ranks = [r[0] for r in ranks], [r[1] for r in ranks]
        trainer = fileformat.to_host(extras if self.sharded else trained)
        state = {"step": step, "saved_at": time.time(), "trainer": trainer,
                 "rng": rng, **({"data_ranks": data_ranks} if any(d is not None for d in data_ranks) else {}),
                 "config": dataclasses.asdict(self.config), "world_size": self.env.world_size,
                 **({"format": "sharded"} if self.sharded else {})}
        write, args = (self._write_sharded, (state, local, ranks[0][-1])) if self.sharded else (self._write, (state,))
        if not self.config.async_checkpoint:
            write(*args)
            self.wait()  # its error, raised here
            return
        self._thread = threading.Thread(target=write, args=args, name="ddp-amp-checkpoint")
        self._thread.start()

    def _note_wait(self) -> None:
        """At most one write in flight: a save waits for the previous one, counted when it was still going."""
        if self._thread is not None and self._thread.is_alive():
            self.waits += 1
        self.wait()

    def save_at_stop(self, trainer: Trainer) -> None:
        """Keep the work of a run stopped by a signal: a checkpoint at the step the ranks stopped at, with
        --checkpoint-every or without (the stop is exactly when one is needed)."""
        if trainer.stopped_at is not None and not self.saved(trainer.stopped_at):
            self.save(trainer, trainer.stopped_at)

    def _write(self, state: dict[str, Any]) -> None:
        """In the background: the finiteness check runs on the host copy, off the training thread, and a
        diverged state is never written (pruning would otherwise delete the last good checkpoints for it)."""
        started = time.perf_counter()
        try:
            if bad := fileformat.nonfinite_tensors(state["trainer"]):
                print(f"warning: no checkpoint at step {state['step']}: inf/NaN in {bad[0].lstrip('.')}", flush=True)
                self.nonfinite_steps.append(state["step"])
                return
            best = (state["trainer"].get("best") or {}).get("step")
            self.last_path = fileformat.save_checkpoint(self.run_dir, state, keep=self.config.keep, protect_step=best)
            self.write_s.append(time.perf_counter() - started)
        except BaseException as exc:  # re-raised in the training thread, at the next save or at close
            self._error = exc

    def _write_sharded(self, state: dict[str, Any], local: dict[str, Any], tag: str) -> None:
        """On every rank, in the background (collectives on the checkpoint's own process group, apart from the
        training's): no rank writes when any rank's part holds inf/NaN; else each writes its part, and rank 0
        the extras, renames the directory into place, writes the sidecar and prunes."""
        started = time.perf_counter()
        try:
            bad = torch.tensor([float(sharded.nonfinite(local))])
            dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._side.group)
            if bad.item():
                if self.env.rank == 0:
                    print(f"warning: no checkpoint at step {state['step']}: inf/NaN in the model or optimizer",
                          flush=True)
                self.nonfinite_steps.append(state["step"])
                return
            directory = fileformat.checkpoint_dir(self.run_dir)
            if self.env.rank == 0:
                directory.mkdir(parents=True, exist_ok=True)
            path = sharded.write(directory, state["step"], tag, local, state if self.env.rank == 0 else None,
                                 self._side.group)
            if path is not None:
                fileformat.write_sidecar(path, state)
                fileformat.drop_other_format(path)
                best = (state["trainer"].get("best") or {}).get("step")
                fileformat.prune(self.run_dir, self.config.keep, self.config.launch_time, best)
                self.last_path = path
            self.write_s.append(time.perf_counter() - started)
        except BaseException as exc:
            self._error = exc

    def wait(self) -> None:
        """Until the write in flight is on disk; its error, if it failed, is raised here."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def close(self) -> None:
        """Wait for the write in flight; a sharded checkpoint's group torn down after it."""
        self.wait()
        if self._side is not None:
            self._side.close()
            self._side = None

    def figures(self) -> dict[str, Any]:
        """summary.json's account of the saves (after close): the loop's blocked seconds per checkpoint (mean and
        most), the background writes' seconds (mean), and how many saves waited for the previous write."""
        if not self.blocked_s:
            return {}
        figures = {"checkpoint_blocked_s": sum(self.blocked_s) / len(self.blocked_s),
                   "checkpoint_blocked_max_s": max(self.blocked_s), "checkpoint_waits": self.waits}
        if self.write_s:
            figures["checkpoint_write_s"] = sum(self.write_s) / len(self.write_s)
        return figures

    def load(self, trainer: Trainer) -> str | None:
        """Continue from the newest checkpoint this launch wrote (after torchrun restarted the workers, for a
        failure or because an elastic job's membership changed: torchrun does not count the latter as a
        restart), else from config.resume. Every rank ends up with the same state: the ranks agree on the
        newest checkpoint any of them can read, and ranks that cannot read it (a node that joined later,
        without a shared file system) receive it from one that can. Returns the checkpoint's path when it
        resumed."""
        config, env = self.config, self.env
        if self.sharded and len(trainer.writers) > 1:
            raise RankUsageError("--checkpoint-format sharded needs a run directory that every node shares (each "
                                 "rank writes its part of every checkpoint there), and this job's nodes each "
                                 "have their own; drop the flag to write whole checkpoints on every node")
        found = checkpoint_to_continue(config, self.run_dir, skipped=self.skipped)
        views = [None] * env.world_size
        dist.all_gather_object(views, found[1]["step"] if found else None)
        steps = [step for step in views if step is not None]
        if not steps:
            if env.writes_run_dir:
                # From the beginning: lines there are an earlier attempt's (a restart, or a membership change,
                # which torchrun does not count as one); a new run's directory has none (see prepare_run_dir).
                (self.run_dir / outputs.METRICS_FILE).unlink(missing_ok=True)
            return None
        newest = max(steps)
        if any(step != newest for step in views):
            source = views.index(newest)
            shipped = [found if env.rank == source else None]
            dist.broadcast_object_list(shipped, src=source)
            found = shipped[0]
        path, state = found
        differ = fileformat.mismatches(state["config"], dataclasses.asdict(config))
        if differ:
            raise RankSetupError(f"--resume {path}: this run differs from the checkpoint's: {'; '.join(differ)}")
        from_shards = state.get("format") == "sharded"
        if from_shards:  # every rank reads its part (a node without the directory fails here, as it must)
            sharded.load_local_state(path, trainer.module, trainer.optimizer)
        trainer.load_state_dict(state["trainer"], state["step"], saved_world_size=state["world_size"],
                                data_ranks=state.get("data_ranks"), weights_loaded=from_shards)
        if env.rank < len(state["rng"]):  # an elastic job that grew: the new ranks keep their seeded streams
            fileformat.set_rng_state(state["rng"][env.rank], self.device)
        if env.writes_run_dir:  # each step logged once, in order: cut back to where this group continues
            outputs.cut_metrics(self.run_dir, trainer.start_step)
        return str(path)


def checkpoint_to_continue(config: TrainConfig, run_dir: Path, skipped: list[str] | None = None
                           ) -> tuple[Path, dict] | None:
    """This rank's own view: (path, state) of the checkpoint it would continue from, or None. Each checkpoint
    passed over is warned of in the rank's log and added to `skipped`.

    Only this launch's checkpoints count (launch_time tells them apart), restart or not: the run dir may still
    hold an earlier run's (the one --resume continues, or one --overwrite replaced), which a restarted group
    must never pick up as its own. Before this launch wrote one, a restart continues from --resume, if given."""
    def warn(line: str) -> None:
        print(f"warning: {line}", flush=True)
        if skipped is not None:
            skipped.append(line.removeprefix("skipping checkpoint "))

    found = fileformat.newest_valid_checkpoint(
        run_dir, warn=warn,
        accept=lambda metadata: metadata["config"].get("launch_time") == config.launch_time)
    if found is not None or config.resume is None:
        return found
    path = Path(config.resume)
    try:
        return path, fileformat.load_checkpoint(path)
    except fileformat.CheckpointError as exc:
        if config.elastic:
            return None  # a node without the file: it receives the state from a rank that has it
        raise RankSetupError(f"--resume {exc}") from None
