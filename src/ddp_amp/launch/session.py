"""One launch, from warm start to verdict, the same for every command that starts ranks.

    warm_start(train)  the cheap checks (nothing started if a flag is wrong), then the fork server
    preflight(...)     the expensive checks, the run directory, config.json (launch.preflight)
    Launch.spawn / Launch.standalone / Launch.node    how the ranks start: spawn, or torchrun's agent
    run_launch(launch, display)    the ranks under the live progress view, then the verdict: the outcome, the
                       stop report, the failure explained (stalls, flight records), the recovery line

Training (spawn, run, multinode) shows its progress; the commands that measure (bench, bench --max-batch,
doctor) run the same launch quietly and read the run directory afterwards. Status lines go to stderr: stdout
carries the progress itself (JSON lines with --log-format json). No typer, no rich here.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddp_amp.config import JobKind, TrainConfig
from ddp_amp.errors import RunFailed
from ddp_amp.launch.preflight import LaunchPlan
from ddp_amp.launch.torchrun import ElasticJob
from ddp_amp.launch.verdict import check_outcome, record_failure, report_recovery, report_stop, say, with_resume_hint
from ddp_amp.parallel import MODES
from ddp_amp.process import StopSignal, stop_signals_raise


def warm_start(train: dict[str, Any], *, start_ranks_soon: bool = True) -> TrainConfig:
    """The cheap checks first, so a bad flag starts nothing; then the fork server, which imports torch for the
    ranks while this process imports it for the checks that follow (the two imports overlap)."""
    from ddp_amp.tasks import precheck_task

    config = TrainConfig(**train)
    precheck_task(config.task)
    if start_ranks_soon:
        from ddp_amp.launch.forkserver import start_forkserver

        start_forkserver()
    return config


@dataclass
class Launch:
    """A prepared launch: its plan (the config in its run directory), its ranks on this node, what they do, and
    how they start: spawn (no `job`) or torchrun's agent running `job`."""

    plan: LaunchPlan
    nproc: int
    kind: JobKind = "train"
    job: ElasticJob | None = None
    store: Any = field(default=None, repr=False)
    """The rendezvous store this launcher serves on loopback for a standalone job, alive as long as the launch."""
    script: Any = None
    """A launch.script.Script: the ranks run the user's script instead of ddp-amp's loop."""
    started: bool = False
    """The ranks were started (start() was called)."""

    @property
    def agent_log(self) -> Path:
        return self.plan.config_path.parent / "logs" / "agent.log"

    @classmethod
    def standalone(cls, plan: LaunchPlan, nproc: int, *, max_restarts: int = 0, monitor_interval: float = 0.1,
                   kind: JobKind = "train", script=None) -> Launch:
        """torchrun's agent on one node, its rendezvous store served by this launcher on loopback only."""
        from ddp_amp.dist import loopback_store
        from ddp_amp.launch import torchrun

        store = loopback_store(timeout_s=plan.config.timeout)
        job = torchrun.standalone_job(nproc_per_node=nproc, max_restarts=max_restarts,
                                      monitor_interval=monitor_interval, device_type=plan.device_type,
                                      store_port=store.port, script=script is not None)
        return cls(plan, nproc, kind, job, store, script)

    @contextmanager
    def stops_told(self) -> Iterator[None]:
        """A stop signal raised inside, before the ranks started, says what the launch changed on disk (the
        plan's changed_on_disk); after they started it says nothing of the start-up (cli.main)."""
        try:
            yield
        except StopSignal as exc:
            exc.startup = None if self.started else self.plan.changed_on_disk
            raise

    def start(self, session) -> None:
        """The ranks, to completion, under `session` (a progress.live.LiveProgress)."""
        self.started = True
        config = self.plan.config
        if self.job is None:
            from ddp_amp.launch.spawn import spawn

            spawn(config, self.nproc, extra_env=session.environment(), kind=self.kind, script=self.script)
            return
        from ddp_amp.launch.agent import run_agent

        run_agent(self.job, self.plan.config_path, session.environment(), self.agent_log,
                  rank_pids=session.rank_pids, stop_timeout=config.stop_timeout, kind=self.kind, script=self.script)


def spawn_launch(train: dict[str, Any], output: dict[str, Any], nproc_per_node: str, script=None) -> Launch:
    """`ddp-amp spawn`: warm start, preflight, and the Launch of --nproc-per-node ranks (a number, or gpu, cpu,
    auto as torchrun takes it) forked on this machine."""
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.preflight import preflight, preflight_script

    # A count (or a bad word: one line) before the fork server starts; gpu, cpu and auto take torch's answer.
    nproc = torchrun.nproc_before_torch(nproc_per_node)
    config = warm_start(train)
    nproc = nproc or torchrun.parse_nproc(nproc_per_node)
    common = {"nproc_per_node": nproc, "flag": "--nproc-per-node", "overwrite": output["overwrite"],
              "run_dir": output["run_dir"]}
    plan = preflight_script(config, script, **common) if script is not None else preflight(config, **common)
    return Launch(plan, nproc, script=script)


def standalone_launch(train: dict[str, Any], output: dict[str, Any], nproc_per_node: str, *, max_restarts: int,
                      monitor_interval: float, dry_run: bool, script=None) -> Launch | None:
    """`ddp-amp run`: warm start, preflight, and the Launch through torchrun's agent on one node; None after a
    dry run, which prints torchrun's command instead."""
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.preflight import preflight, preflight_script, stops_say

    torchrun.check_restart_options(max_restarts, monitor_interval)
    config = warm_start(train, start_ranks_soon=not dry_run)
    nproc = torchrun.parse_nproc(nproc_per_node)
    restarts = {"max_restarts": max_restarts, "monitor_interval": monitor_interval}
    if script is not None and dry_run:  # nothing to check before printing: the script's ranks check their device
        job = torchrun.standalone_job(nproc_per_node=nproc, device_type="cpu", script=True, **restarts)
        print(job.torchrun_command(Path(), script=script).shell())
        return None
    common = {"nproc_per_node": nproc, "flag": "--nproc-per-node", "overwrite": output["overwrite"],
              "run_dir": output["run_dir"], "dry_run": dry_run}
    plan = preflight_script(config, script, **common) if script is not None else preflight(config, **common)
    if not dry_run:
        with stops_say(plan.changed_on_disk):  # the store starts: until show() takes over, the stop says it
            return Launch.standalone(plan, nproc, script=script, **restarts)
    # A dry run's preflight wrote this launch's config.json and nothing else (no lock, no earlier run set aside:
    # launch.run_dir.check_dry_run): the command reads it.
    job = torchrun.standalone_job(nproc_per_node=nproc, device_type=plan.device_type, **restarts)
    print(job.torchrun_command(plan.config_path).shell())
    return None


def run_launch(launch: Launch, display, *, announce: bool = True) -> None:
    """Start the ranks while the live progress view renders their events to `display`; then the verdict, raised as
    RunFailed when the run did not finish. `announce`: the start line first, and a recovery line after a run
    that torchrun restarted (the training commands; the measuring ones are quiet)."""
    with launch.stops_told():
        if launch.script is not None:
            return run_script_launch(launch, display)
        try:
            _run_and_judge(launch, display, announce)
        finally:
            from ddp_amp.launch.run_dir import settle_overwritten, with_earlier_launches

            with_earlier_launches(launch.plan)
            settle_overwritten(launch.plan)


def _run_and_judge(launch: Launch, display, announce: bool) -> None:
    from ddp_amp.progress.live import LiveProgress

    plan, config = launch.plan, launch.plan.config
    if announce:
        _announce(launch)
    started = time.time()
    failure = _start_ranks(launch, LiveProgress(display, plan.config_path.parent))
    if failure is not None and failure.exit_code <= 128:
        if launch.kind != "train":
            raise failure
        failure = with_resume_hint(failure, Path(config.run_dir))
        record_failure(plan, failure, time.time() - started, None if config.job_id else launch.nproc)
        raise failure
    if failure is not None:
        # This launcher was signalled and passed the signal on to its ranks: raises, unless the run had
        # finished before the stop took effect; ranks killed before they stopped wrote no record: this is it.
        try:
            report_stop(Path(config.run_dir), config, signalled=str(failure), exit_code=failure.exit_code,
                        resumable=launch.kind == "train")
        except RunFailed as stopped:
            if launch.kind == "train":
                record_failure(plan, stopped, time.time() - started, None if config.job_id else launch.nproc)
            raise
    check_outcome(Path(config.run_dir), config, resumable=launch.kind == "train")
    if announce and launch.job is not None:
        report_recovery(config, launch.agent_log, display.view)


def _start_ranks(launch: Launch, session) -> RunFailed | None:
    """The ranks, to completion, under `session`; how they failed (explained: stalls, flight records), or the
    stop signal this launcher passed on to them (exit code > 128); None when every rank finished."""
    config = launch.plan.config
    try:
        with session, stop_signals_raise():
            launch.start(session)
    except RunFailed as exc:
        from ddp_amp.launch.verdict import explained_failure, first_failure_named, with_ranks_that_ended

        if session.failure_shown():
            exc.details = ""  # the display has shown the failing rank's traceback already
        if exc.exit_code > 128:
            return exc
        exc = with_ranks_that_ended(first_failure_named(exc, session), session)
        if session.failed_for_usage():
            exc = exc.as_usage_error()
        # One node's records only under multinode (the others are on their hosts): no "left no record" there.
        return explained_failure(exc, session, config, None if config.job_id else launch.nproc)
    return None


def run_script_launch(launch: Launch, display) -> None:
    """A launch of the user's script: its ranks under the live progress view, which captures their output, then the
    verdict (the script finished on every rank, a rank failed, or a stop ended it) and the run's record in
    summary.json (launch.script.script_record), which `ddp-amp show` lists."""
    from ddp_amp.launch import script as scripts
    from ddp_amp.launch.run_dir import settle_overwritten, trained_since, with_earlier_launches
    from ddp_amp.launch.verdict import script_restart_causes
    from ddp_amp.outputs import write_summary
    from ddp_amp.progress.live import LiveProgress

    plan, config, script = launch.plan, launch.plan.config, launch.script
    run_dir = Path(config.run_dir)
    if launch.job is not None:
        say(f"ddp-amp: torchrun's agent in-process, as "
            f"{launch.job.torchrun_command(plan.config_path, script=script).shell()}")
    say(f"ddp-amp: {launch.nproc} rank(s) running {' '.join(script.argv())}, run dir {run_dir} (each rank's "
        f"output in {run_dir / 'logs'})")
    started = time.time()
    failure = _start_ranks(launch, LiveProgress(display, run_dir, capture_output=True))
    view = display.view
    if failure is not None and failure.exit_code > 128:  # None where the loop had run every step first
        failure = scripts.stop_after_the_loop(run_dir, view, started, failure)
    if failure is None and (stopped := scripts.loop_stop_signal(view)) is not None:
        # a stop signal reached a rank, not this launcher: the loop stopped every rank at one step, as ddp-amp's
        # own loop does, and the launch ends as a stop does (128 + the signal)
        failure = RunFailed(f"stopped by {stopped.name}", exit_code=128 + stopped.value)
    record = scripts.script_record(script, run_dir, launch=launch, view=view, started=started, failure=failure)
    if causes := script_restart_causes(launch, view):
        record["restart_causes"] = causes
        for cause in causes:
            seen = f" (last seen in step {cause['last_seen_step']})" if cause.get("last_seen_step") else ""
            say(f"ddp-amp: restart {cause['restart']}: rank {cause['rank']} {cause['cause']}{seen}")
    if failure is not None and failure.exit_code <= 128 and (kept := scripts.newest_checkpoint(run_dir)):
        # a loop script's checkpoints: where its work is, whatever failed (a full disk: the one before the write)
        failure = RunFailed(f"{failure}; the newest complete checkpoint is {kept} (continue with --resume auto "
                            f"--run-dir {run_dir})", exit_code=failure.exit_code, details=failure.details)
    if failure is not None and failure.exit_code > 128:
        failure = RunFailed(scripts.script_stop_line(record, run_dir, str(failure), view), exit_code=failure.exit_code)
    with_earlier_launches(plan, record)
    try:
        write_summary(run_dir, record)
    except OSError as exc:  # a full disk, as a rank may have found: the verdict below still comes through
        say(f"ddp-amp: warning: {run_dir / 'summary.json'} could not be written: {exc.strerror}")
    # A script that finished, or that wrote what training writes (metrics, a checkpoint, model.pt, loop.json),
    # trained: under --overwrite the earlier run is gone. One that failed or was stopped before it wrote any gets
    # the earlier run back, and this launch's record (summary.json, logs) is set aside (run_dir.FAILED_LAUNCH_DIR).
    settle_overwritten(plan, trained=failure is None or trained_since(run_dir, plan.output_before))
    if failure is not None:
        raise failure
    restarts = f" after {view.restarts} restart{'s' if view.restarts > 1 else ''}" if view.restarts else ""
    say(f"ddp-amp: the script finished on every rank{restarts} in {time.time() - started:.1f}s; summary "
        f"{run_dir / 'summary.json'}")


def _announce(launch: Launch) -> None:
    plan, config = launch.plan, launch.plan.config
    if launch.job is not None:
        say(f"ddp-amp: torchrun's agent in-process, as {launch.job.torchrun_command(plan.config_path).shell()}")
    tf32 = f", tf32 {config.tf32}" if config.tf32 and plan.device_type == "cuda" else ""
    why = f" (--amp {config.amp}: {plan.precision.reason})" if plan.precision.reason else ""
    name = "measured at start-up" if plan.precision.measured else plan.precision.name  # a line follows
    sharding = MODES[config.shard].launch_words
    say(f"ddp-amp: {launch.nproc} rank(s) on {plan.device_type}, precision {name}{why}{tf32}{sharding}, "
        f"task {config.task}, run dir {config.run_dir}")
    if plan.precision.warning:
        say(f"ddp-amp: warning: {plan.precision.warning}")
    if plan.fields_left_out:
        names = ", ".join(plan.fields_left_out)
        say(f"ddp-amp: batch field{'s' if len(plan.fields_left_out) > 1 else ''} {names} not passed to the model "
            "(its forward does not name them): the loss and the metrics still get the whole batch "
            "(Task.pass_every_field passes them)")
    if config.resume is not None:  # the checkpoint --resume chose (any it skipped was named above)
        say(f"ddp-amp: resuming from {config.resume}")
    if plan.init is not None:
        if config.resume is not None:
            say(f"ddp-amp: --init-from {config.init_from} is not used: --resume continues from {config.resume}")
        else:
            say(f"ddp-amp: initial weights from {config.init_from}: {plan.init['loaded']} tensors"
                + (f" ({plan.init['missing']} of the model's missing, {plan.init['unexpected']} of the file's "
                   "unexpected: --no-init-strict)" if plan.init["missing"] or plan.init["unexpected"] else ""))


def quiet_display(stream=None):
    """What the measuring commands show of their ranks: a failing rank's error only (on stderr, or `stream`)."""
    from ddp_amp.progress.display import PlainDisplay

    return PlainDisplay(stream or sys.stderr, quiet=True, final_summary=False)


def launch_quietly(run_options: dict[str, Any], run_dir: Path, *, nproc: int, launcher: str, kind: JobKind,
                   multinode: tuple[int, str, Any] | None = None, errors=None) -> LaunchPlan:
    """One launch for a command that measures (bench, bench --max-batch, doctor) and reads the run directory
    afterwards: the same launch and verdict as training, without its progress; its plan. `multinode`: (world
    size, job id, this node's torchrun job for a device type) to run this node's ranks of a multi-node job
    (every node runs the same command; each keeps its own run directory). `errors`: where a failing rank's
    error goes (stderr)."""
    from ddp_amp.launch.preflight import preflight

    config = warm_start(run_options)
    if multinode is not None:
        world_size, job_id, node_job = multinode
        plan = preflight(config, nproc_per_node=nproc, flag="--nproc-per-node", run_dir=str(run_dir),
                         extra={"job_id": job_id}, lock_run_dir=False, world_size=world_size, batch_check=False)
        launch = Launch(plan, nproc, kind, node_job(plan.device_type))
    else:
        plan = preflight(config, nproc_per_node=nproc, flag="--nproc-per-node", run_dir=str(run_dir),
                         batch_check=False)
        launch = Launch(plan, nproc, kind) if launcher == "spawn" else Launch.standalone(plan, nproc, kind=kind)
    run_launch(launch, quiet_display(errors), announce=False)
    return plan
