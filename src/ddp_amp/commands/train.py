"""spawn, run and multinode: parse, build the launch (launch.preflight, launch.session, launch.multinode), run it
with its progress shown."""

from __future__ import annotations

from pathlib import Path

from ddp_amp.commands.config_file import config_toml, with_config_file
from ddp_amp.commands.options import (
    TRAINING_OPTIONS,
    DryRun,
    EmitOneNodeSlurm,
    MaxRestarts,
    Module,
    MonitorInterval,
    NprocPerNode,
    RequeueSignal,
    ScriptWords,
    training_args,
    with_k8s_options,
    with_node_options,
    with_output_options,
    with_training_options,
)
from ddp_amp.commands.panels import with_full_help
from ddp_amp.commands.torchrun_names import with_torchrun_flags


@with_full_help
@with_torchrun_flags("spawn")
@with_config_file
@with_training_options
@with_output_options
def spawn(
    train: dict,
    output: dict,
    resolved: dict,
    nproc_per_node: NprocPerNode = "1",
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch N ranks on this machine, forked from a warm fork server: ddp-amp's training loop, or your SCRIPT."""
    from ddp_amp.launch.session import spawn_launch

    program = user_script(script, module, train)
    show(spawn_launch(train, output, nproc_per_node, script=program), output, resolved)


@with_full_help
@with_torchrun_flags("run")
@with_config_file
@with_training_options
@with_output_options
def run(
    train: dict,
    output: dict,
    resolved: dict,
    nproc_per_node: NprocPerNode = "1",
    max_restarts: MaxRestarts = 0,
    monitor_interval: MonitorInterval = 0.1,
    dry_run: DryRun = False,
    emit_slurm: EmitOneNodeSlurm = None,
    requeue_signal: RequeueSignal = "USR1",
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch N ranks on this machine through torchrun (standalone rendezvous on loopback): ddp-amp's training
    loop, or your SCRIPT."""
    from ddp_amp.launch.session import standalone_launch

    program = user_script(script, module, train)
    if emit_slurm is not None:
        from ddp_amp.launch.slurm import emit_one_node_sbatch

        emit_one_node_sbatch(emit_slurm, train, training_args(train), output, nproc_per_node=nproc_per_node,
                             max_restarts=max_restarts, monitor_interval=monitor_interval,
                             requeue_signal=requeue_signal, script=program)
        return
    show(standalone_launch(train, output, nproc_per_node, max_restarts=max_restarts, monitor_interval=monitor_interval,
                           dry_run=dry_run, script=program), output, resolved)


@with_full_help
@with_torchrun_flags("multinode")
@with_config_file
@with_training_options
@with_output_options
@with_node_options
@with_k8s_options
def multinode(
    train: dict,
    output: dict,
    resolved: dict,
    node: dict,
    k8s: dict,
    nproc_per_node: NprocPerNode = "1",
    max_restarts: MaxRestarts = 0,
    monitor_interval: MonitorInterval = 0.1,
    dry_run: DryRun = False,
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch this node's ranks through torchrun with c10d rendezvous across machines: ddp-amp's training loop,
    or your SCRIPT."""
    from ddp_amp.launch.multinode import multinode_launch

    program = user_script(script, module, train)
    launch = multinode_launch(train, output, node, k8s, as_flags=training_args, script=program,
                              nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                              monitor_interval=monitor_interval, dry_run=dry_run)
    show(launch, output, resolved)


def show(launch, output: dict, resolved: dict) -> None:
    """Run `launch` (nothing when the command's work is done without one: a dry run, an emitted file) with its
    progress shown: a training launch's, or the ranks' output of a user's script as it comes."""
    if launch is None:
        return
    with launch.stops_told():  # a stop before the ranks start says what the launch changed on disk
        if launch.script is not None:
            from ddp_amp.launch.session import run_launch
            from ddp_amp.progress.display import make_display

            run_launch(launch, make_display(output["log_format"], quiet=output["quiet"], script=True))
            return
        launch_training(launch, output, resolved)


RUN_DIR_ACTIONS = ("overwrite", "resume")
"""What a launch did to its run dir, left out of RUN_DIR/config.toml: `--config` of it repeats the run, and must
never clear or continue another run's directory (its own, the run_dir it records, above all) unasked."""


def launch_training(launch, output: dict, resolved: dict) -> None:
    """A training launch with its progress shown; config.toml first (the options as given and resolved, but
    RUN_DIR_ACTIONS: `--config RUN_DIR/config.toml` repeats the run), the profile's top operators last."""
    from ddp_amp.files import atomic_write
    from ddp_amp.launch.session import run_launch
    from ddp_amp.outputs import read_summary
    from ddp_amp.progress.display import make_display

    config = launch.plan.config
    recipe = {name: value for name, value in resolved.items() if name not in RUN_DIR_ACTIONS}
    atomic_write(launch.plan.config_path.parent / "config.toml", config_toml(recipe).encode())
    run_launch(launch, make_display(output["log_format"], quiet=output["quiet"]))
    if config.profile and not output["quiet"]:
        if profile := read_summary(Path(config.run_dir)).profile:
            from rich.console import Console

            from ddp_amp.results.report import profile_table

            Console(stderr=output["log_format"] == "json").print(profile_table(profile))


def user_script(words: list[str] | None, module: bool, train: dict):
    """SCRIPT [ARGS] (or -m MODULE [ARGS]) as a launch.script.Script, checked, with no option of ddp-amp's loop
    beside it; None when the command trains a task."""
    from ddp_amp.launch.script import refuse_loop_options, script_from_command_line

    program = script_from_command_line(words, module)
    if program is not None:
        refuse_loop_options([name for name, value in train.items()
                             if value != TRAINING_OPTIONS[name][0] and (value or TRAINING_OPTIONS[name][0])], program,
                            dtype=train.get("dtype"), resume=train.get("resume"))
    return program
