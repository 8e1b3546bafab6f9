"""spawn, run and multinode (and multinode --emit-slurm): parse, build the launch, run it with progress."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from ddp_amp.commands.options import (
    TRAINING_OPTIONS,
    DryRun,
    Endpoint,
    Ifname,
    IsHost,
    LocalAddr,
    MaxRestarts,
    Module,
    MonitorInterval,
    NprocPerNode,
    RdzvId,
    RdzvTimeout,
    ScriptWords,
    check_rendezvous_timeout,
    config_toml,
    with_config_file,
    with_k8s_options,
    with_output_options,
    with_training_options,
)
from ddp_amp.errors import UsageError


@with_config_file
@with_training_options
@with_output_options
def spawn(
    train: dict,
    output: dict,
    resolved: dict,
    nproc: Annotated[int, typer.Option("--gpus", "--nproc", "-n",
                                       help="Ranks to start: one per GPU with CUDA, CPU processes otherwise.")] = 1,
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch N ranks on this machine, forked from a warm fork server: ddp-amp's training loop, or your SCRIPT."""
    from ddp_amp.launch.preflight import preflight, preflight_script
    from ddp_amp.launch.session import Launch, warm_start

    program = user_script(script, module, train)
    config = warm_start(train, start_ranks_soon=nproc >= 1)
    if program is not None:
        plan = preflight_script(config, program, nproc_per_node=nproc, flag="--gpus", overwrite=output["overwrite"],
                                run_dir=output["run_dir"])
        launch_script(Launch(plan, nproc, script=program), output)
        return
    plan = preflight(config, nproc_per_node=nproc, flag="--gpus", overwrite=output["overwrite"],
                     run_dir=output["run_dir"])
    launch_training(Launch(plan, nproc), output, resolved)


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
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch N ranks on this machine through torchrun (standalone rendezvous on loopback): ddp-amp's training
    loop, or your SCRIPT."""
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.preflight import preflight, preflight_script
    from ddp_amp.launch.session import Launch, settle_overwritten, warm_start

    check_torchrun_numbers(max_restarts, monitor_interval)
    program = user_script(script, module, train)
    config = warm_start(train, start_ranks_soon=not dry_run)
    nproc = torchrun.parse_nproc(nproc_per_node)
    if program is not None:
        if dry_run:
            job = torchrun.standalone_job(nproc_per_node=nproc, max_restarts=max_restarts,
                                          monitor_interval=monitor_interval, device_type="cpu", script=True)
            typer.echo(job.torchrun_command(Path(), script=program).shell())
            return
        plan = preflight_script(config, program, nproc_per_node=nproc, flag="--nproc-per-node",
                                overwrite=output["overwrite"], run_dir=output["run_dir"])
        launch_script(Launch.standalone(plan, nproc, max_restarts=max_restarts, monitor_interval=monitor_interval,
                                        script=program), output)
        return
    plan = preflight(config, nproc_per_node=nproc, flag="--nproc-per-node", overwrite=output["overwrite"],
                     run_dir=output["run_dir"])
    if dry_run:
        settle_overwritten(plan, trained=False)  # a dry run starts nothing: an --overwrite takes nothing away
        job = torchrun.standalone_job(nproc_per_node=nproc, max_restarts=max_restarts,
                                      monitor_interval=monitor_interval, device_type=plan.device_type)
        typer.echo(job.torchrun_command(plan.config_path).shell())
        return
    launch_training(Launch.standalone(plan, nproc, max_restarts=max_restarts, monitor_interval=monitor_interval),
                    output, resolved)


@with_config_file
@with_training_options
@with_output_options
@with_k8s_options
def multinode(
    train: dict,
    output: dict,
    resolved: dict,
    k8s: dict,
    nnodes: Annotated[str | None, typer.Option("--nnodes", help="Nodes: N, or MIN:MAX for an elastic range.")] = None,
    endpoint: Endpoint = None,
    from_env: Annotated[bool, typer.Option("--from-env", help="Read --nnodes, --endpoint, --node-rank and "
                                           "--nproc-per-node from what a TrainJob, PyTorchJob or ddp-amp's JobSet "
                                           "injects (PET_*, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK).")] = False,
    nproc_per_node: NprocPerNode = "1",
    node_rank: Annotated[int | None, typer.Option("--node-rank", help="This node's rank (optional with c10d).")] = None,
    rdzv_id: RdzvId = None,
    max_restarts: MaxRestarts = 0,
    monitor_interval: MonitorInterval = 0.1,
    rdzv_timeout: RdzvTimeout = 600.0,
    rdzv_last_call: Annotated[int, typer.Option("--rdzv-last-call", help="With --nnodes MIN:MAX: seconds to wait "
                                                "for more nodes once MIN have joined (torchrun's default).")] = 30,
    is_host: IsHost = None,
    local_addr: LocalAddr = None,
    ifname: Ifname = None,
    requeue_signal: Annotated[str, typer.Option("--requeue-signal", help="With --emit-slurm: the signal Slurm sends "
                                                "before the time limit (USR1, USR2 or TERM); the job stops at one "
                                                "step, checkpoints and requeues itself.")] = "USR1",
    emit_slurm: Annotated[Path | None, typer.Option("--emit-slurm", help="Write an sbatch script running this "
                                                    "on every node of an allocation, and exit.")] = None,
    dry_run: DryRun = False,
    module: Module = False,
    script: ScriptWords = None,
) -> None:
    """Launch this node's ranks through torchrun with c10d rendezvous across machines: ddp-amp's training loop,
    or your SCRIPT."""
    from ddp_amp import network
    from ddp_amp.config import TrainConfig

    check_torchrun_numbers(max_restarts, monitor_interval)
    program = user_script(script, module, train)
    nnodes, endpoint, node_rank, nproc_per_node = _where_nodes_meet(from_env, nnodes, endpoint, node_rank,
                                                                    nproc_per_node)
    if from_env and k8s["emit_k8s"] is None and program is None:
        _take_up_own_run_dir(train, output)
    nodes = _checked_nodes(nnodes, node_rank, rdzv_timeout, rdzv_last_call)
    rendezvous = {"rdzv_timeout": rdzv_timeout, "rdzv_last_call": rdzv_last_call,
                  "monitor_interval": monitor_interval, "max_restarts": max_restarts}
    if k8s["emit_k8s"] is not None:
        config = TrainConfig(**train)
        emit_k8s_manifest(k8s, train, output, nodes, nproc_per_node=nproc_per_node, max_restarts=max_restarts,
                          stop_timeout=config.stop_timeout, script=program)
        return
    where = network.parse_endpoint(endpoint)
    TrainConfig(**train)  # every cheap check before the network ones, which can wait up to --rdzv-timeout
    if emit_slurm is not None:
        emit_slurm_script(emit_slurm, train, output, nodes, where, nproc_per_node=nproc_per_node, ifname=ifname,
                          requeue_signal=requeue_signal, script=program, **rendezvous)
        return
    _launch_node(train, output, resolved, nodes, where, nproc_per_node, dry_run=dry_run, rdzv_id=rdzv_id,
                 node_rank=node_rank, network_options={"is_host": is_host, "local_addr": local_addr,
                                                       "ifname": ifname}, script=program, **rendezvous)


def _checked_nodes(nnodes: str, node_rank: int | None, rdzv_timeout: float, rdzv_last_call: int):
    """--nnodes parsed, and the rendezvous numbers checked against it."""
    from ddp_amp.launch import torchrun

    nodes = torchrun.parse_nnodes(nnodes)
    if node_rank is not None and not 0 <= node_rank < nodes.max:
        raise UsageError(f"--node-rank must be in 0..{nodes.max - 1} for --nnodes {nodes}, got {node_rank}")
    check_rendezvous_timeout(rdzv_timeout)
    if rdzv_last_call < 1:
        raise UsageError(f"--rdzv-last-call must be >= 1 second, got {rdzv_last_call}")
    return nodes


def _launch_node(train: dict, output: dict, resolved: dict, nodes, where, nproc_per_node: str, *, dry_run: bool,
                 rdzv_id: str | None, node_rank: int | None, network_options: dict[str, Any], script=None,
                 **rendezvous: Any) -> None:
    """multinode: this node's network found, its ranks' plan, and its share of the job launched."""
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.preflight import preflight, preflight_script
    from ddp_amp.launch.session import Launch, settle_overwritten, warm_start

    config = warm_start(train, start_ranks_soon=not dry_run)
    nproc = torchrun.parse_nproc(nproc_per_node)
    net = torchrun.detect_node_network(where, rdzv_timeout=rendezvous["rdzv_timeout"], check_reachable=not dry_run,
                                       **network_options)
    job_id = rdzv_id or torchrun.default_rdzv_id(where, nodes, nproc, " ".join(
        [*training_args(train), *(script.argv() if script is not None else [])]))
    extra = {"elastic": nodes.min != nodes.max, "job_id": job_id}
    if script is not None:
        plan = preflight_script(config, script, nproc_per_node=nproc, flag="--nproc-per-node",
                                overwrite=output["overwrite"], run_dir=output["run_dir"], lock_run_dir=False,
                                extra=extra)
    else:
        plan = preflight(config, nproc_per_node=nproc, flag="--nproc-per-node", overwrite=output["overwrite"],
                         run_dir=output["run_dir"], lock_run_dir=False,
                         world_size=nodes.min * nproc if nodes.min == nodes.max else None, extra=extra)
    job = torchrun.node_job(where, nodes, nproc, net, node_rank=node_rank, rdzv_id=job_id, script=script is not None,
                            **rendezvous)(plan.device_type)
    if net.note:
        typer.echo(f"ddp-amp: {net.note}", err=True)
    if script is not None:
        if dry_run:
            settle_overwritten(plan, trained=False)
            typer.echo(job.torchrun_command(plan.config_path, script=script).shell())
            return
        launch_script(Launch(plan, nproc, job=job, script=script), output)
        return
    if dry_run:
        settle_overwritten(plan, trained=False)
        typer.echo(job.torchrun_command(plan.config_path).shell())
        typer.echo(f"# on every other node: ddp-amp multinode --endpoint {where} --nnodes {nodes} "
                   f"--nproc-per-node {nproc} --rdzv-id {job_id} (same training options)")
        return
    launch_training(Launch(plan, nproc, job=job), output, resolved)


def launch_training(launch, output: dict, resolved: dict) -> None:
    """A training launch with its progress shown; config.toml first (the options as given and resolved:
    `--config RUN_DIR/config.toml` repeats the run), the profile's top operators last."""
    from ddp_amp.files import atomic_write
    from ddp_amp.launch.session import run_launch
    from ddp_amp.outputs import read_summary
    from ddp_amp.progress.display import make_display

    config = launch.plan.config
    atomic_write(launch.plan.config_path.parent / "config.toml", config_toml(resolved).encode())
    run_launch(launch, make_display(output["log_format"], quiet=output["quiet"]))
    if config.profile and not output["quiet"]:
        if profile := read_summary(Path(config.run_dir)).get("profile"):
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
                             if value != TRAINING_OPTIONS[name][0] and (value or TRAINING_OPTIONS[name][0])], program)
    return program


def launch_script(launch, output: dict) -> None:
    """A launch of the user's script, its ranks' output shown as it comes."""
    from ddp_amp.launch.session import run_launch
    from ddp_amp.progress.display import make_display

    run_launch(launch, make_display(output["log_format"], quiet=output["quiet"], script=True))


def emit_slurm_script(path: Path, train: dict, output: dict, nodes, where, script=None, **launch_options) -> None:
    """--emit-slurm: the sbatch script that runs this multinode command on every node of an allocation."""
    from ddp_amp.launch.slurm import sbatch_script

    text = sbatch_script(training_args(train), port=where.port, nodes=nodes, device=train["device"],
                         run_dir=output["run_dir"], log_format=output["log_format"], script=script, **launch_options)
    write_new_file(path, text, "--emit-slurm")
    typer.echo(f"ddp-amp: wrote {path}; submit it with sbatch {path}")
    if script is not None:
        where_from = script.path if not script.module else f"module {script.target} from {script.cwd}"
        typer.echo(f"ddp-amp: every node runs {where_from} in {script.cwd}: both must be there on the nodes (a "
                   "shared file system)", err=True)


def _where_nodes_meet(from_env: bool, nnodes, endpoint, node_rank, nproc_per_node):
    """--nnodes, --endpoint, --node-rank, --nproc-per-node as given or, with --from-env, as a Kubernetes job
    injected them (where the command line does not give its own)."""
    import os

    from ddp_amp.launch.kubernetes import rendezvous_from_env

    if not from_env:
        if nnodes is None:
            raise UsageError("--nnodes is required (or --from-env inside a Kubernetes job)")
        return nnodes, endpoint, node_rank, nproc_per_node
    found = rendezvous_from_env(os.environ)
    typer.echo(f"ddp-amp: --from-env: {found.source}", err=True)
    return (nnodes or found.nnodes, endpoint or found.endpoint, found.node_rank if node_rank is None else node_rank,
            found.nproc_per_node if nproc_per_node == "1" and found.nproc_per_node else nproc_per_node)


def _take_up_own_run_dir(train: dict, output: dict) -> None:
    """--from-env: a pod its controller (re)started takes up its run dir on the claim as a requeued Slurm job
    does, with --resume auto: from the newest checkpoint, else (the first attempt, or one that left none) from
    the beginning."""
    if output["run_dir"] is not None and train["resume"] is None and not output["overwrite"]:
        train["resume"] = "auto"


def emit_k8s_manifest(k8s: dict, train: dict, output: dict, nodes, *, nproc_per_node: str, max_restarts: int,
                      stop_timeout: float, script=None) -> None:
    """--emit-k8s: the manifest (TrainJob, PyTorchJob or JobSet) that runs this on --nnodes pods; printed, then
    written as YAML."""
    from ddp_amp.launch.kubernetes import manifest_text

    text = manifest_text(k8s, [*training_args(train), "--log-format", output["log_format"]], nodes,
                         device=train["device"], run_dir=output["run_dir"], nproc_per_node=nproc_per_node,
                         max_restarts=max_restarts, stop_timeout=stop_timeout,
                         script=script.argv() if script is not None else [])
    write_new_file(k8s["emit_k8s"], text, "--emit-k8s")  # first: a path it cannot be written to prints nothing
    typer.echo(text, nl=False)
    if k8s["pvc"] is None:
        typer.echo("ddp-amp: warning: without --pvc the run dir is an emptyDir: checkpoints do not outlive a pod",
                   err=True)
    if script is not None:
        typer.echo(f"ddp-amp: the pods run {' '.join(script.argv())} from their working directory: the image must "
                   "hold it there", err=True)
    typer.echo(f"ddp-amp: wrote {k8s['emit_k8s']}; start it with kubectl apply -f {k8s['emit_k8s']}", err=True)


def check_torchrun_numbers(max_restarts: int, monitor_interval: float) -> None:
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not monitor_interval > 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {monitor_interval:g}")


def training_args(train: dict) -> list[str]:
    """The training options that differ from their defaults, as flags: the same on every node."""
    args = []
    for name, value in train.items():
        if value != TRAINING_OPTIONS[name][0]:
            flag = name.replace("_", "-")
            if isinstance(value, bool):
                args += [f"--{flag}" if value else f"--no-{flag}"]
            elif isinstance(value, (list, tuple)):  # a repeatable option: the flag once per value
                args += [part for item in value for part in (f"--{flag}", str(item))]
            else:
                args += [f"--{flag}", str(value)]
    return args


def write_new_file(path: Path, text: str, flag: str) -> None:
    if path.exists():
        raise UsageError(f"{flag} {str(path)!r} already exists; remove it or choose another name")
    if not path.parent.is_dir():
        raise UsageError(f"{flag} {str(path)!r}: directory {str(path.parent)!r} does not exist")
    from ddp_amp.files import atomic_write

    try:
        atomic_write(path, text.encode())
    except OSError as exc:
        raise UsageError(f"{flag} {str(path)!r} cannot be written: {exc.strerror}") from None
