"""A launch's verdict, said on stderr once its ranks have ended: the outcome of a run whose ranks all finished
(a divergence still fails it), the stop report, the recovery line of a restarted run; and a failed launch
explained from what the launcher saw: which rank raised first (the ranks' own error events), which ranks
stalled, and where the ranks' flight records say they parted. No torch here."""

from __future__ import annotations

import signal as signals
import sys
from pathlib import Path
from typing import Any

from ddp_amp.config import TrainConfig
from ddp_amp.errors import RunFailed
from ddp_amp.outputs import read_summary


def say(line: str) -> None:
    """One status line of the launcher's, on stderr (stdout carries the progress itself)."""
    print(line, file=sys.stderr, flush=True)


def first_failure_named(exc: RunFailed, session) -> RunFailed:
    """The launchers name the rank whose process ended first; of two ranks that raised, the first to raise but
    the slower to exit (its flight record written) was named second, with its peer's error ("rank 0 ... (after
    rank 1 failed)" on screen, rank 0 in the verdict). The ranks' error events, all read now that the session is
    closed, say which raised first."""
    from ddp_amp.errors import exception_line, failure_line, is_peer_symptom

    first = session.first_failure()
    if exc.rank is None or first is None or first[0] == exc.rank or is_peer_symptom(first[1]):
        return exc
    if exc.rank not in {state.rank for state in session.display.view.failures()}:
        return exc  # the named rank exited or was killed without raising: that is the cause the others saw
    return exc.retold(first[0], f"failed: {failure_line(exception_line(first[1]))}")


def with_ranks_that_ended(exc: RunFailed, session) -> RunFailed:
    """A script's rank failed only because a peer vanished ("Connection closed by peer", a timeout) while a
    peer's script had already ended, exit 0 (an early return or sys.exit on some ranks): the verdict names the
    ranks that ended, the cause the failed one could not see."""
    from ddp_amp.errors import is_peer_symptom

    view, first = session.display.view, session.first_failure()
    if not view.script or first is None or not is_peer_symptom(first[1]):
        return exc
    ended = sorted(state.rank for state in view.ranks.values() if state.status == "done" and state.exit_code == 0)
    if not ended:
        return exc
    return RunFailed(f"rank {', '.join(map(str, ended))} ended early (its script exited 0) while the other ranks "
                     f"still ran collectives ({exc})", exit_code=exc.exit_code, details=exc.details)


def with_resume_hint(failure: RunFailed, run_dir: Path) -> RunFailed:
    """A failed training run's verdict, with where its work is when it kept a checkpoint (a rank killed, a full
    disk), as a loop script's says: the newest checkpoint and the command that continues from it."""
    from ddp_amp.launch.script import newest_checkpoint

    if failure.exit_code != 1 or (kept := newest_checkpoint(run_dir)) is None:
        return failure
    return RunFailed(f"{failure}; the newest complete checkpoint is {kept} (continue with --resume auto --run-dir "
                     f"{run_dir})", exit_code=failure.exit_code, details=failure.details)


def record_failure(plan, failure: RunFailed, wall_s: float, world_size: int | None) -> None:
    """A launch of ddp-amp's loop that failed after it trained (a rank killed, or raising) leaves no summary.json
    of its ranks: the launcher writes one holding its verdict (launch_failure), so that `show` says why the run
    did not finish and a resume counts this launch (run_dir.with_earlier_launches). A launch that trained nothing
    writes none: its run dir stays free for the next launch, as before."""
    from ddp_amp.launch.run_dir import trained_since
    from ddp_amp.launch.script import newest_checkpoint
    from ddp_amp.outputs import SUMMARY_FILE, write_summary

    run_dir = Path(plan.config.run_dir)
    if (run_dir / SUMMARY_FILE).exists() or not trained_since(run_dir, plan.output_before):
        return
    record: dict[str, Any] = {"launch_failure": str(failure), "exit_code": failure.exit_code,
                              "wall_s": round(wall_s, 3)}
    if world_size:
        record["world_size"] = world_size
    if kept := newest_checkpoint(run_dir):
        record["checkpoint"] = str(kept)
    try:
        write_summary(run_dir, record)
    except OSError:  # a full disk, as a rank may have found: the verdict still comes through, on the terminal
        pass


def explained_failure(exc: RunFailed, session, config: TrainConfig, world_size: int | None) -> RunFailed:
    """A failed run's error; when ranks stalled, it names them (the rank that failed is usually one that timed
    out waiting, and the cause is the one it waited for), and where the ranks' flight records say they parted."""
    from ddp_amp.results.diagnosis import DUMP_DIR, read_records, where_ranks_parted

    run_dir = Path(config.run_dir)
    dumps, damaged = read_records(run_dir)
    parting = where_ranks_parted(dumps, world_size, damaged)
    collectives = (f"; {parting.line} (flight records: {run_dir / DUMP_DIR}; ddp-amp diagnose {run_dir})"
                   if parting is not None else "")
    if parting is not None and parting.mismatch:
        return RunFailed(f"{parting.line} ({exc}; flight records: {run_dir / DUMP_DIR}; ddp-amp diagnose "
                         f"{run_dir})", exit_code=exc.exit_code, details=exc.details)
    script = session.display.view.script
    if (stalled := session.stalled()) and exc.exit_code == 1 and script and parting is None:
        first = stalled[0]
        return RunFailed(f"rank {', '.join(str(state.rank) for state in stalled)} stalled at {first.position[3]}; "
                         f"the other ranks gave up waiting for it ({exc})", exit_code=exc.exit_code,
                         details=exc.details)
    if stalled and exc.exit_code == 1 and not script:
        first = stalled[0]
        ranks = ", ".join(str(state.rank) for state in stalled)
        return RunFailed(f"rank {ranks} stalled in step {first.position[0] + 1} ({first.position[3]}); the "
                         f"other ranks gave up waiting after --timeout {config.timeout:g}s ({exc}){collectives}",
                         exit_code=exc.exit_code, details=exc.details)
    if collectives and "Timed out" in str(exc):
        return RunFailed(f"{exc}{collectives}", exit_code=exc.exit_code, details=exc.details)
    return exc


def script_restart_causes(launch, view) -> list[dict[str, Any]]:
    """Each restart torchrun's agent made of a script's ranks: which rank ended the attempt and how (its exit
    code or signal, from the agent's log; an exception's line, from the display), and the step it was last seen
    in (a ddp_amp.loop script's reports)."""
    from ddp_amp.launch import torchrun

    if not view.restarts or launch.job is None:
        return []
    log = launch.agent_log.read_text(errors="replace") if launch.agent_log.exists() else ""
    logged = torchrun.restart_causes(log)
    from ddp_amp.errors import is_peer_symptom

    # A rank's own exception, never a peer's symptom of it (a killed rank's "Connection reset by peer").
    raised: dict[int, tuple[int, str]] = {}
    for attempt, rank, line in view.recovered:  # each attempt's first failure first
        if not is_peer_symptom(line):
            raised.setdefault(attempt, (rank, line))
    causes = []
    for attempt in range(view.restarts):
        if attempt in raised:
            rank, what = raised[attempt][0], f"failed: {raised[attempt][1]}"
        elif attempt < len(logged):
            local_rank, what = logged[attempt]
            rank = view.ranks_before_restart.get(local_rank, local_rank)
        else:
            continue
        cause = {"restart": attempt + 1, "rank": rank, "cause": what}
        if attempt == view.restarts - 1 and view.steps_before_restart.get(rank, 0) > 1:  # a loop script's step
            cause["last_seen_step"] = view.steps_before_restart[rank]
        causes.append(cause)
    return causes


def report_stop(run_dir: Path, config: TrainConfig, *, signalled: str | None = None, exit_code: int = 1,
                resumable: bool = True) -> None:
    """After a stop signal (to this launcher, `signalled`, or to a rank alone): one line saying at which step
    the ranks stopped and where their work is, raised with exit code 128 + the signal's number. A run that
    had already finished (model.pt written) when the stop took effect returns instead: exit 0. A measuring
    launch (bench, doctor: not `resumable`) is not continued: its line names no checkpoint and no --resume."""
    record = read_summary(run_dir)
    name = record.stopped_by or (signalled or "").removeprefix("stopped by ")
    step = record.stopped_at_step
    if record.model_path and step is None:
        say(f"ddp-amp: {name} came after the run had finished; {record.model_path} is written")
        return
    if step is None:  # killed mid-step, or in the stop's checkpoint write: the newest whole one is the work kept
        from ddp_amp.launch.script import newest_checkpoint

        kept = newest_checkpoint(run_dir) if resumable else None
        where = (f"the newest complete checkpoint is {kept} (continue with --resume auto --run-dir {run_dir})" if kept
                 else "nothing of this run kept" if resumable else f"the measurement in {run_dir} is incomplete")
        raise RunFailed(f"{signalled}: the ranks did not stop within --stop-timeout {config.stop_timeout:g}s and "
                        f"were killed; {where}", exit_code=exit_code)
    if name in signals.Signals.__members__:
        exit_code = 128 + signals.Signals[name].value
    if not resumable:
        raise RunFailed(f"stopped by {name} at step {step}; the measurement in {run_dir} is incomplete",
                        exit_code=exit_code)
    if record.checkpoint:
        raise RunFailed(f"stopped by {name} at step {step}; checkpoint {record.checkpoint} (continue with "
                        f"--resume auto --run-dir {run_dir})", exit_code=exit_code)
    raise RunFailed(f"stopped by {name} at step {step}; no checkpoint kept", exit_code=exit_code)


def check_outcome(run_dir: Path, config: TrainConfig, resumable: bool = True) -> None:
    """Every rank finished; a run that diverged or whose evaluation raised still fails the command."""
    record = read_summary(run_dir)
    if record.stopped_at_step is not None:  # a stop signal reached a rank, not this launcher
        report_stop(run_dir, config, resumable=resumable)
    if failure := record.failure(run_dir):
        raise RunFailed(failure, exit_code=2 if record.keep_best_error else 1)
    if skipped := record.resumed_skipping_items:
        step = record.resumed_from_step
        say(f"ddp-amp: resumed at step {step}: skipped the {skipped} items trained before step {step} (the data set "
            "has no state_dict/load_state_dict, so its stream was read again from the start)")
    if (ended := record.data_ended_at_step) is not None:
        say(f"ddp-amp: the data ran out at step {ended}: every rank stopped there"
            + (f"; {record.model_path} written" if record.model_path else ""))


def report_recovery(config: TrainConfig, log_path: Path, view) -> None:
    """A run that torchrun restarted and that then succeeded ends with one line saying what it recovered from."""
    from ddp_amp.launch import torchrun

    record = read_summary(config.run_dir)
    if not record.restarts:
        return
    restarts = record.restarts
    for skipped in record.checkpoints_skipped:  # the rank's warning, which only its log holds
        say(f"ddp-amp: warning: the restart skipped checkpoint {skipped}")
    line = f"ddp-amp: recovered after {restarts} restart{'s' if restarts > 1 else ''}"
    causes = torchrun.restart_causes(log_path.read_text(errors="replace")) if log_path.exists() else []
    if causes:
        local_rank, what = causes[0]
        rank = view.ranks_before_restart.get(local_rank, local_rank)  # on another node local != global
        step = view.steps_before_restart.get(rank)
        line += f": rank {rank} {what}" + (f" (last seen in step {step})" if step is not None else "")
    resumed = record.resumed_from_step
    line += f"; resumed from step {resumed}" if resumed else "; restarted from the beginning (no checkpoint)"
    say(line)
