"""The checkpoint manager of one rank: `load` (resume agreement), `save` every --checkpoint-every steps,
`wait` for the write in flight and `close`. It is handed the run's stateful parts (train.parts: ddp-amp's own
loop's, or a script loop's named ones) at each save and load; what differs between the two formats is in
checkpoint.formats. ddp-amp's loop (rank.setup) and ddp_amp.loop both make one.

Saving gathers every rank's RNG state (a collective), copies the state to host memory and writes it from a
background thread (atomically, see storage.save_checkpoint), so training waits for the copy only; with
--no-async-checkpoint the loop writes it itself. Each save's blocked seconds, and whether it waited for the
previous write, go into the next metrics.jsonl line (`checkpoints`) and, averaged, into summary.json.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ddp_amp.checkpoint import storage
from ddp_amp.checkpoint.formats import FORMATS, NonFiniteState, format_marker, format_of
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv
from ddp_amp.errors import RankSetupError
from ddp_amp.files import writer_tag
from ddp_amp.train.parts import Parts, Restored


class CheckpointManager:
    """One rank's: every rank makes one at the same point (a sharded format makes its process group)."""

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
        self.format = FORMATS[config.checkpoint_format](config, env, run_dir)
        """How this run's checkpoints are staged and written (checkpoint.formats)."""

    def due(self, step: int) -> bool:
        return bool(self.config.checkpoint_every) and step % self.config.checkpoint_every == 0

    def saved(self, step: int) -> bool:
        return self.last_step == step

    def save(self, parts: Parts, step: int) -> None:
        started, waits = time.perf_counter(), self.waits
        try:
            self._save(parts, step)
        finally:
            self.blocked_s.append(time.perf_counter() - started)
            if self.env.writes_run_dir:
                self._unlogged.append({"step": step, "blocked_s": round(self.blocked_s[-1], 6),
                                       "waited": self.waits > waits})

    def model_weights(self, step: int) -> dict[str, torch.Tensor] | None:
        """The model's weights in this run's checkpoint of `step`, read in this process alone (checked against
        its checksum); None where no such checkpoint is left whole."""
        from ddp_amp.checkpoint.weights import WeightsError, read_weights

        for path in storage.checkpoints(self.run_dir):
            if storage.CHECKPOINT_NAME.match(path.name).group(1) == str(step):
                try:
                    return read_weights(path)
                except WeightsError:
                    continue
        return None

    def take_unlogged(self) -> dict[str, Any]:
        """The saves since the last metrics line, for the next one: {"checkpoints": [{step, blocked_s, waited}]}
        on the ranks that write the run dir (a save comes after its step's line), else nothing."""
        taken, self._unlogged = self._unlogged, []
        return {"checkpoints": taken} if taken else {}

    def _save(self, parts: Parts, step: int) -> None:
        checkpoint_format = self.format
        ranks = [None] * self.env.world_size
        held, own_bytes = checkpoint_format.held(parts)
        # A collective: every rank, every time. Each rank's RNG states, for iterable data its position, and
        # what it alone holds of the state (a sharded format splits the rest by it).
        dist.all_gather_object(ranks, (storage.rng_state(self.device), parts.rank_state(), own_bytes,
                                       self.env.writes_run_dir, writer_tag()))
        writers = [rank for rank, (*_, writes, _) in enumerate(ranks) if writes]
        self.last_step = step
        if checkpoint_format.every_rank_writes:
            self._note_wait()
        trained, local = checkpoint_format.stage(parts, held, writers, [r[2] for r in ranks])
        if not checkpoint_format.every_rank_writes:
            if not self.env.writes_run_dir:
                return
            self._note_wait()  # only now: two host copies of the state never coexist
        rng, data_ranks = [r[0] for r in ranks], [r[1] for r in ranks]
        state = {"step": step, "saved_at": time.time(), "trainer": storage.to_host(trained),
                 "rng": rng, **({"data_ranks": data_ranks} if any(d is not None for d in data_ranks) else {}),
                 "config": {**dataclasses.asdict(self.config), **parts.marker()}, "world_size": self.env.world_size,
                 **format_marker(type(checkpoint_format))}
        args = (state, storage.to_host(local), ranks[0][-1])
        if not self.config.async_checkpoint:
            self._write(*args)
            self.wait()  # its error, raised here
            return
        self._thread = threading.Thread(target=self._write, args=args, name="ddp-amp-checkpoint")
        self._thread.start()

    def _note_wait(self) -> None:
        """At most one write in flight: a save waits for the previous one, counted when it was still going."""
        if self._thread is not None and self._thread.is_alive():
            self.waits += 1
        self.wait()

    def save_at_stop(self, parts: Parts, stopped_at: int | None) -> None:
        """Keep the work of a run stopped by a signal: a checkpoint at the step the ranks stopped at, with
        --checkpoint-every or without (the stop is exactly when one is needed)."""
        if stopped_at is not None and not self.saved(stopped_at):
            self.save(parts, stopped_at)

    def _write(self, state: dict[str, Any], local: Any, tag: str) -> None:
        """In the background (or, --no-async-checkpoint, in the loop): a diverged state is never written."""
        started = time.perf_counter()
        try:
            path = self.format.write(state, local, tag)
            if path is not None:
                self.last_path = path
            self.write_s.append(time.perf_counter() - started)
        except NonFiniteState as skipped:
            if skipped.where is not None:
                print(f"warning: no checkpoint at step {state['step']}: inf/NaN in {skipped.where}", flush=True)
            self.nonfinite_steps.append(state["step"])
        except BaseException as exc:  # re-raised in the training thread, at the next save or at close
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
        """Wait for the write in flight; then the format's own resources (a sharded format's group), also when
        the write failed (its error is raised after)."""
        try:
            self.wait()
        finally:
            self.format.close()

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

    def load(self, parts: Parts, writers: list[int]) -> Restored | None:
        """Continue from the newest checkpoint this launch wrote (after torchrun restarted the workers, for a
        failure or because an elastic job's membership changed: torchrun does not count the latter as a
        restart), else from config.resume. Every rank ends up with the same state: the ranks agree on the
        newest checkpoint the run dir's writers found whole (checksums and all), and ranks that cannot read it
        (a node that joined later, without a shared file system) receive it from one that can. `writers`: the
        ranks that write the run dir. None for a fresh start."""
        config, env = self.config, self.env
        self.format.check_writers(writers)
        # The ranks that write the run dir check the checksums (every file of a sharded checkpoint: read by each
        # rank, it would be read world-size times); the others take their choice.
        found = checkpoint_to_continue(config, self.run_dir, skipped=self.skipped, verify=env.writes_run_dir)
        views = [None] * env.world_size
        dist.all_gather_object(views, (found[1]["step"] if found else None, env.writes_run_dir))
        checked = [step for step, writes in views if writes and step is not None]
        steps = checked or [step for step, _ in views if step is not None]
        if not steps:
            return None
        newest = max(steps)
        if any(step != newest for step, _ in views):
            source = next(rank for rank, (step, writes) in enumerate(views)
                          if step == newest and (writes or not checked))
            shipped = [found if env.rank == source else None]
            dist.broadcast_object_list(shipped, src=source)
            found = shipped[0]
        path, state = found
        if refusal := parts.refusal(state):
            raise RankSetupError(f"--resume {path}: {refusal}")
        differ = storage.mismatches(state["config"], dataclasses.asdict(config))
        if differ:
            raise RankSetupError(f"--resume {path}: this run differs from the checkpoint's: {'; '.join(differ)}")
        try:
            parts.load_extras(state["trainer"], state["world_size"], state.get("data_ranks"))
            format_of(state).load_weights(path, state, parts)  # the checkpoint's format, whatever this run's
        except RankSetupError as exc:
            raise RankSetupError(f"--resume {path}: {exc}") from None
        if env.rank < len(state["rng"]):  # an elastic job that grew: the new ranks keep their seeded streams
            storage.set_rng_state(state["rng"][env.rank], self.device)
        return Restored(Path(path), state["step"], state["world_size"])


def checkpoint_to_continue(config: TrainConfig, run_dir: Path, skipped: list[str] | None = None, *,
                           verify: bool = True) -> tuple[Path, dict] | None:
    """This rank's own view: (path, state) of the checkpoint it would continue from, or None. Each checkpoint
    passed over is warned of in the rank's log and added to `skipped`.

    Only this launch's checkpoints count (launch_time tells them apart), restart or not: the run dir may still
    hold an earlier run's (the one --resume continues, or one --overwrite replaced), which a restarted group
    must never pick up as its own. Before this launch wrote one, a restart continues from --resume, if given."""
    def warn(line: str) -> None:
        print(f"warning: {line}", flush=True)
        if skipped is not None:
            skipped.append(line.removeprefix("skipping checkpoint "))

    found = storage.newest_valid_checkpoint(
        run_dir, warn=warn, verify=verify,
        accept=lambda metadata: metadata["config"].get("launch_time") == config.launch_time)
    if found is not None or config.resume is None:
        return found
    path = Path(config.resume)
    try:
        return path, storage.load_checkpoint(path, verify=verify)
    except storage.CheckpointError as exc:
        if config.elastic:
            return None  # a node without the file: it receives the state from a rank that has it
        raise RankSetupError(f"--resume {exc}") from None
