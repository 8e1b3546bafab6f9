"""The `ddp-amp` command line. Commands are thin: parse, build a config, call one launcher function.

torch is imported only inside the commands that launch something, so `ddp-amp --help` stays fast.
This module is the only place where the project's errors become exit codes.
"""

from __future__ import annotations

import functools
import inspect
import sys
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ddp_amp.errors import RunFailed, UsageError
from ddp_amp.options import training_options
from ddp_amp.process import StopSignal, stop_signals_raise

app = typer.Typer(
    name="ddp-amp",
    help="Launch PyTorch DistributedDataParallel training with automatic mixed precision.",
    add_completion=True,
    pretty_exceptions_enable=False,
)

TRAINING = "Training"


def _print_version(value: bool) -> None:
    if value:
        from ddp_amp import __version__

        typer.echo(f"ddp-amp {__version__}")
        raise typer.Exit()


@app.callback()
def _main_options(
    version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                          help="Print ddp-amp's version and exit.")] = False,
) -> None:
    """Launch PyTorch DistributedDataParallel training with automatic mixed precision."""


def _training_option(spec) -> tuple[Any, Any]:
    """(default, annotation) of one training option: its type a Literal of the allowed names where there are
    some (listed by --help, completed by the shell), its help the field's docstring."""
    kind = Literal[spec.choices] if spec.choices else spec.kind
    if spec.optional:
        kind = kind | None
    names = (f"{spec.flag}/--no-{spec.flag[2:]}",) if spec.kind is bool and spec.default else (spec.flag,)
    # rich markup reads [...] as a style: escape the docstrings' brackets.
    return spec.default, Annotated[kind, typer.Option(*names, help=spec.help.replace("[", "\\["),
                                                      rich_help_panel=TRAINING)]


# Every training option, read from TrainConfig (ddp_amp.options) and added to each launching command by
# @training_options. TrainConfig validates the values.
TRAINING_OPTIONS: dict[str, tuple[Any, Any]] = {spec.name: _training_option(spec) for spec in training_options()}

OUTPUT = "Output"
RunDir = Annotated[str | None, typer.Option("--run-dir", help="Output directory \\[default: runs/<timestamp>].",
                                            rich_help_panel=OUTPUT)]
LOG_FORMATS = ("auto", "rich", "plain", "json")

# What a launch writes and shows, the same on spawn, run and multinode (passed to them as one dict, `output`).
OUTPUT_OPTIONS: dict[str, tuple[Any, Any]] = {
    "run_dir": (None, RunDir),
    "overwrite": (False, Annotated[bool, typer.Option("--overwrite", rich_help_panel=OUTPUT,
                                                      help="Allow --run-dir to replace an earlier run's files.")]),
    "log_format": ("auto", Annotated[Literal[LOG_FORMATS], typer.Option(
        "--log-format", rich_help_panel=OUTPUT, help="Progress: auto (rich on a terminal, else plain), rich, "
        "plain (a line per rank per interval) or json (an object per event).")]),
    "quiet": (False, Annotated[bool, typer.Option("--quiet", "-q", rich_help_panel=OUTPUT,
                                                  help="Print only the final summary.")]),
}


def option_group(options: dict[str, tuple[Any, Any]], into: str, **defaults: Any):
    """A decorator adding `options` to a command's signature; the command receives them as one dict named
    `into`. `defaults` change a default for that command; an option the command defines itself (bench's --amp)
    replaces the group's one."""

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        shared = [name for name in options if name not in signature.parameters]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name, options[name][0]),
                                   annotation=options[name][1]) for name in shared]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            group = {name: kwargs.pop(name) for name in shared}
            return command(**{into: group}, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=own + added)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
        return wrapper

    return decorate


def training_options(command=None, **defaults: Any):
    """Add TRAINING_OPTIONS as the dict `train`: `@training_options` or `@training_options(task=...)`."""
    decorate = option_group(TRAINING_OPTIONS, "train", **defaults)
    return decorate if command is None else decorate(command)


output_options = option_group(OUTPUT_OPTIONS, "output")


NOT_IN_CONFIG = ("config", "print_config", "dry_run", "emit_slurm")
"""What --config files do not set and --print-config does not print: actions, not options."""
_resolved_config: dict[str, Any] = {}
"""The launch's options as resolved (flags over --config), kept for RUN_DIR/config.toml."""


def _load_config_file(ctx: typer.Context, path: Path | None) -> Path | None:
    """--config FILE.toml: its keys become the command's defaults, so flags given on the command line win."""
    if path is None:
        return None
    import tomllib

    try:
        values = tomllib.loads(path.read_text())
    except OSError as exc:
        raise UsageError(f"--config {str(path)!r}: cannot read it ({exc.strerror})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {str(path)!r} is not valid TOML: {exc}") from None
    params = {param.name: param for param in ctx.command.params if param.name not in NOT_IN_CONFIG}
    for key, value in values.items():
        param = params.get(key)
        if param is None:
            raise UsageError(f"--config {str(path)!r}: unknown key {key!r} (not an option of "
                             f"ddp-amp {ctx.info_name}; keys are option names with underscores)")
        is_flag = param.type_descriptor.annotation is bool
        try:
            if isinstance(value, bool) != is_flag or isinstance(value, (dict, list)):
                raise ValueError
            param.get_runtime_param().coerce(value, param=param, ctx=ctx)
        except Exception:
            raise UsageError(f"--config {str(path)!r}: {key} = {value!r} is not a valid --{key.replace('_', '-')}")\
                from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    return path


def config_file_options(command):
    """Adds --config FILE.toml and --print-config to a launching command; the launch's resolved options are
    kept for RUN_DIR/config.toml."""
    signature = inspect.signature(command)
    added = [
        inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
            Path | None, typer.Option("--config", is_eager=True, callback=_load_config_file, rich_help_panel=OUTPUT,
                                      help="Options from a TOML file (keys: option names with underscores); flags "
                                      "given here override it.")]),
        inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
            bool, typer.Option("--print-config", rich_help_panel=OUTPUT,
                               help="Print every option as resolved, as TOML for --config, and exit.")]),
    ]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop("config")
        resolved = {name: value for name, value in kwargs.items() if name not in NOT_IN_CONFIG}
        if kwargs.pop("print_config"):
            typer.echo(config_toml(resolved), nl=False)
            return None
        _resolved_config.clear()
        _resolved_config.update(resolved)
        return command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *added])
    wrapper.__annotations__ = {**command.__annotations__, "config": added[0].annotation,
                               "print_config": added[1].annotation}
    return wrapper


def config_toml(options: dict[str, Any]) -> str:
    """Flat TOML: one `key = value` per option that has a value (TOML has no null: an unset option is left out,
    which means its default)."""
    import json

    lines = []
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, Path):
            value = str(value)
        lines.append(f"{key} = {json.dumps(value) if not isinstance(value, bool) else str(value).lower()}")
    return "\n".join(lines) + "\n"


@app.command()
@config_file_options
@training_options
@output_options
def spawn(
    train: dict,
    output: dict,
    nproc: Annotated[int, typer.Option("--gpus", "--nproc", "-n",
                                       help="Ranks to start: one per GPU with CUDA, CPU processes otherwise.")] = 1,
) -> None:
    """Launch N ranks on this machine with torch.multiprocessing."""
    from ddp_amp.launch.preflight import preflight

    if nproc >= 1:
        _warm_start(train)
    plan = preflight(train, nproc_per_node=nproc, flag="--gpus", overwrite=output["overwrite"],
                     run_dir=output["run_dir"])
    from ddp_amp.launch.spawn import spawn as spawn_ranks

    _launch(plan, nproc, output, lambda env, session: spawn_ranks(plan.config, nproc, extra_env=env))


def _warm_start(train: dict) -> None:
    """The cheap checks first, so a bad flag starts nothing; then the fork server, which imports torch for the
    ranks while this process imports it for the checks that follow (the two imports overlap)."""
    from ddp_amp.config import TrainConfig
    from ddp_amp.launch.forkserver import start_forkserver
    from ddp_amp.tasks import precheck_task

    TrainConfig(**train)
    precheck_task(train["task"])
    start_forkserver()


NprocPerNode = Annotated[str, typer.Option("--nproc-per-node", "--gpus", "-n",
                                           help="Ranks per node: a number, or gpu, cpu, auto as torchrun takes.")]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Restart the job this many times on a failure.")]
MonitorInterval = Annotated[float, typer.Option("--monitor-interval", help="Seconds between torchrun's checks.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the torchrun command and environment; start nothing.")]
# Where the nodes of a multi-node job meet: multinode's options, and doctor's with --nnodes.
Endpoint = Annotated[str | None, typer.Option("--endpoint", help="host:port of the c10d store (port 29400 if omitted); "
                                       "the node owning that address hosts it.")]
RdzvId = Annotated[str | None, typer.Option("--rdzv-id", help="Job id, the same on every node \\[default: "
                                            "derived from the endpoint, nnodes, nproc and run options].")]
RdzvTimeout = Annotated[float, typer.Option("--rdzv-timeout", help="Seconds to wait for all nodes (torchrun's "
                                            "own join timeout: a slowly booting node must not fail the job).")]
IsHost = Annotated[bool | None, typer.Option("--is-host/--no-is-host", help="Whether this node hosts the store "
                                             "\\[default: detected from the endpoint address].")]
LocalAddr = Annotated[str | None, typer.Option("--local-addr", help="Address this node advertises "
                                               "\\[default: the one that routes to the endpoint].")]
Ifname = Annotated[str | None, typer.Option("--ifname", help="Network interface for gloo/nccl "
                                            "\\[default: the one holding --local-addr].")]


@app.command()
@config_file_options
@training_options
@output_options
def run(
    train: dict,
    output: dict,
    nproc_per_node: NprocPerNode = "1",
    max_restarts: MaxRestarts = 0,
    monitor_interval: MonitorInterval = 0.1,
    dry_run: DryRun = False,
) -> None:
    """Launch N ranks on this machine through torchrun (standalone rendezvous on loopback)."""
    from ddp_amp.launch import torchrun
    from ddp_amp.launch.preflight import preflight

    _check_torchrun_numbers(max_restarts, monitor_interval)
    if not dry_run:
        _warm_start(train)
    nproc = torchrun.parse_nproc(nproc_per_node)
    plan = preflight(train, nproc_per_node=nproc, flag="--nproc-per-node", overwrite=output["overwrite"],
                     run_dir=output["run_dir"])
    options = {"nproc_per_node": nproc, "max_restarts": max_restarts, "monitor_interval": monitor_interval,
               "device_type": plan.device_type}
    if dry_run:
        typer.echo(torchrun.standalone_job(**options).torchrun_command(plan.config_path).shell())
        return
    from ddp_amp.dist import loopback_store

    # The rendezvous store, served by this launcher on loopback only, for as long as the launch lasts.
    store = loopback_store(timeout_s=plan.config.timeout)
    _launch_elastic(plan, nproc, output, torchrun.standalone_job(store_port=store.port, **options))
    del store


@app.command()
@config_file_options
@training_options
@output_options
def multinode(
    train: dict,
    output: dict,
    nnodes: Annotated[str, typer.Option("--nnodes", help="Nodes: N, or MIN:MAX for an elastic range.")],
    endpoint: Endpoint,
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
) -> None:
    """Launch this node's ranks through torchrun with c10d rendezvous across machines."""
    from ddp_amp.config import TrainConfig
    from ddp_amp.launch import network, torchrun
    from ddp_amp.launch.preflight import preflight

    _check_torchrun_numbers(max_restarts, monitor_interval)
    nodes = torchrun.parse_nnodes(nnodes)
    if node_rank is not None and not 0 <= node_rank < nodes.max:
        raise UsageError(f"--node-rank must be in 0..{nodes.max - 1} for --nnodes {nodes}, got {node_rank}")
    if rdzv_timeout <= 0:
        raise UsageError(f"--rdzv-timeout must be > 0 seconds, got {rdzv_timeout:g}")
    if rdzv_last_call < 1:
        raise UsageError(f"--rdzv-last-call must be >= 1 second, got {rdzv_last_call}")
    where = network.parse_endpoint(endpoint)
    TrainConfig(**train)  # every cheap check before the network ones, which can wait up to --rdzv-timeout
    if emit_slurm is not None:
        _emit_slurm(emit_slurm, train, output, nodes, where, nproc_per_node=nproc_per_node, rdzv_timeout=rdzv_timeout,
                    rdzv_last_call=rdzv_last_call, monitor_interval=monitor_interval, max_restarts=max_restarts,
                    ifname=ifname, requeue_signal=requeue_signal)
        return
    if not dry_run:
        _warm_start(train)
    nproc = torchrun.parse_nproc(nproc_per_node)
    net = torchrun.detect_node_network(where, is_host=is_host, local_addr=local_addr, ifname=ifname,
                                       rdzv_timeout=rdzv_timeout, check_reachable=not dry_run)
    job_id = rdzv_id or torchrun.default_rdzv_id(where, nodes, nproc, _training_args(train))
    plan = preflight(train, nproc_per_node=nproc, flag="--nproc-per-node", overwrite=output["overwrite"],
                     run_dir=output["run_dir"], lock_run_dir=False,
                     world_size=nodes.min * nproc if nodes.min == nodes.max else None,
                     extra={"elastic": nodes.min != nodes.max, "job_id": job_id})
    job = _node_job(where, nodes, nproc, net, node_rank=node_rank, rdzv_id=job_id, max_restarts=max_restarts,
                    monitor_interval=monitor_interval, rdzv_timeout=rdzv_timeout,
                    rdzv_last_call=rdzv_last_call)(plan.device_type)
    if net.note:
        typer.echo(f"ddp-amp: {net.note}", err=True)
    if dry_run:
        typer.echo(job.torchrun_command(plan.config_path).shell())
        typer.echo(f"# on every other node: ddp-amp multinode --endpoint {where} --nnodes {nodes} "
                   f"--nproc-per-node {nproc} --rdzv-id {job_id} (same training options)")
        return
    _launch_elastic(plan, nproc, output, job)


def _node_job(where, nodes, nproc: int, net, **job):
    """This node's torchrun job of a multi-node run, for a device type (known after the preflight)."""
    from ddp_amp.launch import torchrun

    return lambda device_type: torchrun.multinode_job(
        endpoint=where, nnodes=nodes, nproc_per_node=nproc, is_host=net.is_host, local_addr=net.local_addr,
        ifname_env=net.ifname_env, device_type=device_type, **job)


def _emit_slurm(path: Path, train: dict, output: dict, nodes, where, *, nproc_per_node: str, rdzv_timeout: float,
                rdzv_last_call: int, monitor_interval: float, max_restarts: int, ifname: str | None,
                requeue_signal: str) -> None:
    """--emit-slurm: the sbatch script that runs this multinode command on every node of an allocation."""
    from ddp_amp.launch import torchrun

    if requeue_signal not in torchrun.REQUEUE_SIGNALS:
        raise UsageError(f"--requeue-signal must be one of {', '.join(torchrun.REQUEUE_SIGNALS)}, got "
                         f"{requeue_signal!r}")
    if nproc_per_node not in ("gpu", "cpu", "auto"):
        torchrun.parse_nproc(nproc_per_node)  # a count is checked here; gpu/cpu/auto resolve on each node
    # What every node shares; per-node values (--local-addr, --is-host, --node-rank) are found on each node.
    args = ["--nproc-per-node", nproc_per_node, *_training_args(train), "--rdzv-timeout", f"{rdzv_timeout:g}",
            *(["--rdzv-last-call", str(rdzv_last_call)] if nodes.min != nodes.max else []),
            "--monitor-interval", f"{monitor_interval:g}", "--log-format", output["log_format"]]
    if max_restarts:
        args += ["--max-restarts", str(max_restarts)]
    if ifname:
        args += ["--ifname", ifname]
    gpus = int(nproc_per_node) if nproc_per_node.isdigit() and train["device"] != "cpu" else None
    script = torchrun.slurm_script(args, where.port, nodes=nodes, gpus_per_node=gpus, run_dir=output["run_dir"],
                                   requeue_signal=requeue_signal)
    _write_new_file(path, script, "--emit-slurm")
    typer.echo(f"ddp-amp: wrote {path}; submit it with sbatch {path}")


def _check_torchrun_numbers(max_restarts: int, monitor_interval: float) -> None:
    if max_restarts < 0:
        raise UsageError(f"--max-restarts must be >= 0, got {max_restarts}")
    if not monitor_interval > 0:
        raise UsageError(f"--monitor-interval must be > 0 seconds, got {monitor_interval:g}")


def _training_args(train: dict) -> list[str]:
    """The training options that differ from their defaults, as flags: the same on every node."""
    args = []
    for name, value in train.items():
        if value != TRAINING_OPTIONS[name][0]:
            flag = name.replace("_", "-")
            args += [f"--{flag}" if value else f"--no-{flag}"] if isinstance(value, bool) else [f"--{flag}", str(value)]
    return args


def _write_new_file(path: Path, text: str, flag: str) -> None:
    if path.exists():
        raise UsageError(f"{flag} {str(path)!r} already exists; remove it or choose another name")
    from ddp_amp.files import atomic_write

    atomic_write(path, text.encode())


@app.command()
@training_options(task="mlp-wide")
def bench(
    train: dict,
    amp: Annotated[Literal["both", "on", "off"],
                   typer.Option("--amp", help="both (off and on, interleaved), on or off.")] = "both",
    compile: Annotated[Literal["off", "on", "both"], typer.Option(
        "--compile", help="torch.compile: off, on, or both (eager and compiled, interleaved).")] = "off",
    warmup: Annotated[int, typer.Option("--warmup", help="Untimed steps before the timed --steps.")] = 10,
    repeats: Annotated[int, typer.Option("--repeats", help="Interleaved repeats of each precision.")] = 2,
    nproc: Annotated[int | None, typer.Option("--nproc", "--gpus", "-n", help="Ranks \\[default: every visible "
                                              "GPU with CUDA, 2 on CPU].")] = None,
    launcher: Annotated[Literal["spawn", "run"], typer.Option("--launcher", help="spawn or run (torchrun).")] = "spawn",
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every raw figure to this file.")] = None,
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw step times, off vs on (needs matplotlib).")] = None,
    max_batch: Annotated[bool, typer.Option("--max-batch", help="Instead of timing: per precision, the largest "
                                            "per-rank batch that trains (under --max-memory, or the device's "
                                            "memory) and the throughput at it.")] = False,
    run_dir: RunDir = None,
) -> None:
    """Measure what mixed precision (or torch.compile) buys: the same training off and on, interleaved."""
    from ddp_amp.bench import DEFAULT_STEPS, BenchOptions
    from ddp_amp.launch.preflight import RUNS_ROOT, default_run_dir

    steps = train.pop("steps")
    options = BenchOptions(amp=amp, steps=DEFAULT_STEPS if steps is None else steps, warmup=warmup,
                           repeats=repeats, launcher=launcher, compile=compile)
    if train["epochs"] is not None:
        raise UsageError("--epochs does not apply to bench; use --steps (timed) and --warmup")
    if json_path is not None and not json_path.resolve().parent.is_dir():
        raise UsageError(f"--json {str(json_path)!r}: directory {str(json_path.parent)!r} does not exist")
    if plot is not None:
        _check_plot_path(plot)
    import torch

    cuda = train["device"] != "cpu" and torch.cuda.is_available()
    if nproc is None:
        nproc = torch.cuda.device_count() if cuda else 2
    from ddp_amp.bench import run_bench
    from ddp_amp.config import TrainConfig

    TrainConfig(**train, steps=options.warmup + options.steps)  # all flags checked before anything is created
    root = Path(run_dir) if run_dir else RUNS_ROOT / f"bench-{default_run_dir().name}"
    if root.exists() and not root.is_dir():
        raise UsageError(f"--run-dir {str(root)!r} is an existing file, not a directory")
    status = lambda line: typer.echo(line, err=True)  # noqa: E731
    if max_batch:
        from ddp_amp.max_batch import host_memory_share_gib, run_max_batch

        if compile != "off":
            raise UsageError("--max-batch searches eager runs; drop --compile")
        if train["max_memory"] is None and train["device"] != "cuda" and not cuda:
            # CPU ranks: a cap the allocator fails at cleanly, before the kernel's OOM killer would
            train["max_memory"] = round(host_memory_share_gib(nproc), 2)
        report = run_max_batch(train, options, nproc=nproc, run_root=root, status=status)
    else:
        report = run_bench(train, options, nproc=nproc, run_root=root, status=status)
    from rich.console import Console

    from ddp_amp.report import bench_plot, bench_table, max_batch_plot, max_batch_table

    Console().print(max_batch_table(report) if max_batch else bench_table(report))
    if json_path is not None:
        from ddp_amp.outputs import write_json

        write_json(json_path, report)
        typer.echo(f"ddp-amp: wrote {json_path}", err=True)
    if plot is not None:
        (max_batch_plot if max_batch else bench_plot)(report, plot)
        typer.echo(f"ddp-amp: wrote {plot}", err=True)


@app.command()
def show(
    run_dirs: Annotated[list[Path], typer.Argument(help="Run directories to show and compare.", show_default=False)],
    plot: Annotated[Path | None, typer.Option("--plot", help="Draw loss, LR and throughput against step for every "
                                              "run to this PNG (needs matplotlib).")] = None,
) -> None:
    """Show runs side by side: summary, loss curve, and what differs between them."""
    from ddp_amp.runs import load_run

    runs = [load_run(path) for path in run_dirs]  # every path checked before anything is shown
    if plot is not None:
        _check_plot_path(plot)
    from rich.console import Console

    from ddp_amp.report import runs_table

    console = Console()
    console.print(runs_table(runs, width=console.width))
    if plot is not None:
        from ddp_amp.report import runs_plot

        runs_plot(runs, plot)
        typer.echo(f"ddp-amp: wrote {plot}", err=True)


def _check_plot_path(path: Path) -> None:
    if not path.resolve().parent.is_dir():
        raise UsageError(f"--plot {str(path)!r}: directory {str(path.parent)!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ddp-amp[plot]' (or pip install matplotlib)") \
            from None


@app.command()
def doctor(
    nproc: Annotated[int | None, typer.Option("--nproc", "--nproc-per-node", "--gpus", "-n", help="Ranks (per node "
                                              "with --nnodes) \\[default: every visible GPU with CUDA, 2 on CPU, "
                                              "1 per node with --nnodes].")] = None,
    device: Annotated[Literal["auto", "cpu", "cuda"], typer.Option("--device", help="auto, cpu or cuda.")] = "auto",
    amp: Annotated[Literal["auto", "on", "off"], typer.Option("--amp", help="The precision of the matmul rate, "
                                                                "as for training.")] = "auto",
    dtype: Annotated[Literal["auto", "bf16", "fp16"], typer.Option("--dtype", help="auto, bf16 or fp16.")] = "auto",
    launcher: Annotated[Literal["spawn", "run"], typer.Option("--launcher", help="spawn or run (torchrun), on one "
                                                                "node.")] = "spawn",
    nnodes: Annotated[int | None, typer.Option("--nnodes", help="Check a multi-node job: run the same doctor "
                                               "command on every node (as multinode); each node's links are "
                                               "measured too.")] = None,
    endpoint: Endpoint = None,
    rdzv_id: RdzvId = None,
    rdzv_timeout: RdzvTimeout = 600.0,
    is_host: IsHost = None,
    local_addr: LocalAddr = None,
    ifname: Ifname = None,
    strict: Annotated[bool, typer.Option("--strict", help="Exit 1 when a rank or a node is an outlier.")] = False,
    json_path: Annotated[Path | None, typer.Option("--json", help="Write every figure to this file.")] = None,
    run_dir: RunDir = None,
) -> None:
    """Measure the ranks and their links before a long job; outliers are named.

    Rendezvous time, all-reduce latency and bus bandwidth, each rank's matmul rate, host-to-device copies,
    and with --nnodes each node's link to the others."""
    import dataclasses
    import json

    from ddp_amp.config import NOT_OPTIONS, TrainConfig

    if json_path is not None and not json_path.resolve().parent.is_dir():
        raise UsageError(f"--json {str(json_path)!r}: directory {str(json_path.parent)!r} does not exist")
    multinode = None
    if nnodes is not None or endpoint is not None:
        multinode = _doctor_job(nnodes, endpoint, nproc, rdzv_id=rdzv_id, rdzv_timeout=rdzv_timeout, is_host=is_host,
                                local_addr=local_addr, ifname=ifname)
        nproc = nproc or 1
    import torch

    if nproc is None:
        nproc = torch.cuda.device_count() if device != "cpu" and torch.cuda.is_available() else 2
    options = {field.name: getattr(TrainConfig(), field.name) for field in dataclasses.fields(TrainConfig)
               if field.name not in NOT_OPTIONS}
    options.update(device=device, amp=amp, dtype=dtype, steps=1)
    from ddp_amp.checkup import judge
    from ddp_amp.launch.preflight import RUNS_ROOT, default_run_dir
    from ddp_amp.launch.quiet import launch_quietly
    from ddp_amp.outputs import DOCTOR_FILE

    root = Path(run_dir) if run_dir else RUNS_ROOT / f"doctor-{default_run_dir().name}"
    launch_quietly(options, root, nproc=nproc, launcher=launcher, extra={"doctor": True}, multinode=multinode)
    report = json.loads((root / DOCTOR_FILE).read_text())
    report["judgement"] = judge(report)
    from rich.console import Console

    from ddp_amp.report import doctor_table

    Console().print(doctor_table(report))
    if json_path is not None:
        from ddp_amp.outputs import write_json

        write_json(json_path, report)
        typer.echo(f"ddp-amp: wrote {json_path}", err=True)
    if strict and report["judgement"]["warnings"]:
        raise RunFailed("doctor --strict: " + "; ".join(report["judgement"]["warnings"]))


def _doctor_job(nnodes: int | None, endpoint: str | None, nproc: int | None, *, rdzv_id: str | None,
                rdzv_timeout: float, **network_options):
    """doctor --nnodes: (world size, job id, this node's torchrun job for a device type), as multinode runs it."""
    from ddp_amp.launch import network, torchrun

    if nnodes is None or endpoint is None:
        raise UsageError("doctor: --nnodes and --endpoint go together (the nodes meet at the endpoint)")
    if nnodes < 1:
        raise UsageError(f"--nnodes must be >= 1, got {nnodes}")
    if nproc is not None and nproc < 1:
        raise UsageError(f"--nproc-per-node must be >= 1, got {nproc}")
    if rdzv_timeout <= 0:
        raise UsageError(f"--rdzv-timeout must be > 0 seconds, got {rdzv_timeout:g}")
    where = network.parse_endpoint(endpoint)
    nodes, per_node = torchrun.Nnodes(nnodes, nnodes), nproc or 1
    net = torchrun.detect_node_network(where, rdzv_timeout=rdzv_timeout, check_reachable=True, **network_options)
    if net.note:
        typer.echo(f"ddp-amp: {net.note}", err=True)
    job_id = rdzv_id or torchrun.default_rdzv_id(where, nodes, per_node, "doctor")
    return nnodes * per_node, job_id, _node_job(where, nodes, per_node, net, node_rank=None, rdzv_id=job_id,
                                                max_restarts=0, monitor_interval=0.1, rdzv_timeout=rdzv_timeout)


@app.command()
def diagnose(
    run_dir: Annotated[Path, typer.Argument(help="A run directory whose ranks wrote flight records.",
                                            show_default=False)],
    last: Annotated[int, typer.Option("--last", help="Collectives per rank in the timeline.")] = 8,
) -> None:
    """Where the ranks of a failed or hung run parted, from their flight records.

    The collective a rank never entered (or a mismatch), then each rank's last collectives."""
    from ddp_amp.diagnosis import DUMP_DIR, read_dumps, timeline, where_ranks_parted

    if last < 1:
        raise UsageError(f"--last must be >= 1, got {last}")
    dumps = read_dumps(run_dir)
    if not dumps:
        raise UsageError(f"diagnose: {str(run_dir)!r} has no flight records ({DUMP_DIR}/rank<N>.json): the ranks "
                         "write them when a run fails or stalls")
    typer.echo(where_ranks_parted(dumps).line)
    for line in timeline(dumps, last):
        typer.echo(line)


@app.command()
def env(json_output: Annotated[bool, typer.Option("--json", help="One JSON object, for bug reports.")] = False) -> None:
    """Show what ddp-amp sees: torch, backends, devices, CPU bf16 support, cores and threads."""
    from ddp_amp.bench import environment_report

    report = environment_report()
    if json_output:
        import json

        typer.echo(json.dumps(report, indent=2))
        return
    typer.echo(f"ddp-amp {report['ddp_amp']}, torch {report['torch']} (CUDA {report['cuda'] or 'none'}, "
               f"NCCL {report['nccl'] or 'none'}), Python {report['python']}")
    backends = ", ".join(name for name, available in report["backends"].items() if available)
    typer.echo(f"backends: {backends or 'none'}")
    threads = report["threads"]
    typer.echo(f"cores {report['cores']}, torch threads {threads['torch']} (OMP_NUM_THREADS "
               f"{threads['OMP_NUM_THREADS'] or 'unset'}), CPU native bf16: "
               f"{'yes' if report['cpu_native_bf16'] else 'no (emulated)'}, AMX: "
               f"{'yes' if report['cpu_fast_bf16'] else 'no'}")
    for device, choice in report["amp_auto"].items():
        typer.echo(f"--amp auto on {device}: {choice['precision']} ({choice['reason']})")
    typer.echo(f"CUDA devices: {len(report['gpus'])}")
    for gpu in report["gpus"]:
        native = "native" if gpu["native_bf16"] else "no (emulated; --amp auto uses fp16)"
        typer.echo(f"  cuda:{gpu['index']} {gpu['name']} (compute capability {gpu['compute_capability']}, "
                   f"{gpu['memory_gib']:.1f} GiB) bf16: {native}")


def _launch(plan, nproc: int, output: dict, start) -> None:
    """Start the ranks with `start(extra_env, session)` while a progress session renders their events."""
    from ddp_amp.progress.display import make_display
    from ddp_amp.progress.session import ProgressSession

    config = plan.config
    if _resolved_config:  # the options as given and resolved: `--config RUN_DIR/config.toml` repeats the run
        from ddp_amp.files import atomic_write

        atomic_write(plan.config_path.parent / "config.toml", config_toml(_resolved_config).encode())
    # Diagnostics go to stderr: stdout carries the progress itself (JSON lines with --log-format json).
    tf32 = f", tf32 {config.tf32}" if config.tf32 and plan.device_type == "cuda" else ""
    why = f" (--amp {config.amp}: {plan.precision.reason})" if plan.precision.reason else ""
    typer.echo(f"ddp-amp: {nproc} rank(s) on {plan.device_type}, precision {plan.precision.name}{why}{tf32}, "
               f"task {config.task}, run dir {config.run_dir}", err=True)
    if plan.precision.warning:
        typer.echo(f"ddp-amp: warning: {plan.precision.warning}", err=True)
    session = ProgressSession(make_display(output["log_format"], quiet=output["quiet"]), plan.config_path.parent)
    try:
        with session, stop_signals_raise():
            start(session.environment(), session)
    except RunFailed as exc:
        if session.failure_shown():
            exc.details = ""  # the display has shown the failing rank's traceback already
        if exc.exit_code <= 128:
            # One node's records only under multinode (the others are on their hosts): no "left no record" there.
            world = None if config.job_id else nproc
            raise _explained_failure(exc, session, config, world) from None
        # This launcher was signalled and passed the signal on to its ranks: raises, unless the run had
        # finished before the stop took effect.
        _report_stop(Path(config.run_dir), config, signalled=str(exc), exit_code=exc.exit_code)
    _check_outcome(Path(config.run_dir), config)
    if config.profile and not output["quiet"]:
        from ddp_amp.outputs import read_summary

        if profile := read_summary(Path(config.run_dir)).get("profile"):
            from rich.console import Console

            from ddp_amp.report import profile_table

            Console(stderr=output["log_format"] == "json").print(profile_table(profile))


def _report_stop(run_dir: Path, config, *, signalled: str | None = None, exit_code: int = 1) -> None:
    """After a stop signal (to this launcher, `signalled`, or to a rank alone): one line saying at which step
    the ranks stopped and where their work is, raised with exit code 128 + the signal's number. A run that
    had already finished (model.pt written) when the stop took effect returns instead: exit 0."""
    import signal as signals

    from ddp_amp.outputs import read_summary

    summary = read_summary(run_dir)
    name = summary.get("stopped_by") or (signalled or "").removeprefix("stopped by ")
    if summary.get("model_path") and "stopped_at_step" not in summary:
        typer.echo(f"ddp-amp: {name} came after the run had finished; {summary['model_path']} is written", err=True)
        return
    step = summary.get("stopped_at_step")
    if step is None:
        raise RunFailed(f"{signalled}: the ranks did not stop within --stop-timeout {config.stop_timeout:g}s and "
                        "were killed; nothing of this run kept", exit_code=exit_code)
    if name in signals.Signals.__members__:
        exit_code = 128 + signals.Signals[name].value
    if summary.get("checkpoint"):
        raise RunFailed(f"stopped by {name} at step {step}; checkpoint {summary['checkpoint']} (continue with "
                        f"--resume auto --run-dir {run_dir})", exit_code=exit_code)
    raise RunFailed(f"stopped by {name} at step {step}; no checkpoint kept", exit_code=exit_code)


def _explained_failure(exc: RunFailed, session, config, world_size: int | None) -> RunFailed:
    """A failed run's error; when ranks stalled, it names them (the rank that failed is usually one that timed
    out waiting, and the cause is the one it waited for), and where the ranks' flight records say they parted."""
    from ddp_amp.diagnosis import DUMP_DIR, read_dumps, where_ranks_parted

    run_dir = Path(config.run_dir)
    parting = where_ranks_parted(read_dumps(run_dir), world_size)
    collectives = (f"; {parting.line} (flight records: {run_dir / DUMP_DIR}; ddp-amp diagnose {run_dir})"
                   if parting is not None else "")
    if parting is not None and parting.mismatch:
        return RunFailed(f"{parting.line} ({exc}; flight records: {run_dir / DUMP_DIR}; ddp-amp diagnose "
                         f"{run_dir})", exit_code=exc.exit_code, details=exc.details)
    if (stalled := session.stalled()) and exc.exit_code == 1:
        first = stalled[0]
        ranks = ", ".join(str(state.rank) for state in stalled)
        return RunFailed(f"rank {ranks} stalled in step {first.position[0] + 1} ({first.position[3]}); the "
                         f"other ranks gave up waiting after --timeout {config.timeout:g}s ({exc}){collectives}",
                         exit_code=exc.exit_code, details=exc.details)
    if collectives and "Timed out" in str(exc):
        return RunFailed(f"{exc}{collectives}", exit_code=exc.exit_code, details=exc.details)
    return exc


def _check_outcome(run_dir: Path, config) -> None:
    """Every rank finished; a run that diverged or whose evaluation raised still fails the command."""
    from ddp_amp.outputs import failure_of, read_summary

    summary = read_summary(run_dir)
    if "stopped_at_step" in summary:  # a stop signal reached a rank, not this launcher
        _report_stop(run_dir, config)
    if summary and (failure := failure_of(summary, run_dir)):
        raise RunFailed(failure)


def _launch_elastic(plan, nproc: int, output: dict, job) -> None:
    """run and multinode: torchrun's agent in this process (ddp_amp.launch.agent)."""
    from ddp_amp.launch.agent import run_agent

    typer.echo(f"ddp-amp: torchrun's agent in-process, as {job.torchrun_command(plan.config_path).shell()}", err=True)
    log_path = plan.config_path.parent / "logs" / "agent.log"
    sessions = []

    def start(env, session):
        sessions.append(session)
        run_agent(job, plan.config_path, env, log_path, rank_pids=session.rank_pids,
                  stop_timeout=plan.config.stop_timeout)

    _launch(plan, nproc, output, start)
    _report_recovery(plan.config, log_path, sessions[0].display.model)


def _report_recovery(config, log_path: Path, model) -> None:
    """A run that torchrun restarted and that then succeeded ends with one line saying what it recovered from."""
    from ddp_amp.launch import torchrun
    from ddp_amp.outputs import read_summary

    summary = read_summary(config.run_dir)
    if not summary.get("restarts"):
        return
    restarts = summary["restarts"]
    line = f"ddp-amp: recovered after {restarts} restart{'s' if restarts > 1 else ''}"
    causes = torchrun.restart_causes(log_path.read_text(errors="replace")) if log_path.exists() else []
    if causes:
        local_rank, what = causes[0]
        rank = model.ranks_before_restart.get(local_rank, local_rank)  # on another node local != global
        step = model.steps_before_restart.get(rank)
        line += f": rank {rank} {what}" + (f" (last seen in step {step})" if step is not None else "")
    resumed = summary.get("resumed_from_step")
    line += f"; resumed from step {resumed}" if resumed else "; restarted from the beginning (no checkpoint)"
    typer.echo(line, err=True)


def main(argv: list[str] | None = None) -> None:
    """Console entry point: run the app, turning every expected error into one line and an exit code."""
    args = sys.argv[1:] if argv is None else argv
    try:
        # standalone_mode=False: errors come back here instead of being drawn as multi-line panels. A stop
        # signal before the ranks start (the whole job step is signalled while this one starts) is one line
        # and 128 + its number, like a stop later on.
        with stop_signals_raise():
            code = app(args=args or ["--help"], prog_name="ddp-amp", standalone_mode=False)
    except typer.TyperException as exc:  # bad flags and values, as typer parses them
        typer.echo(f"ddp-amp: error: {exc.format_message()}", err=True)
        code = 2 if exc.exit_code == 1 else exc.exit_code
    except typer.Abort:
        typer.echo("ddp-amp: aborted", err=True)
        code = 130
    except UsageError as exc:
        for problem in exc.problems:
            typer.echo(f"ddp-amp: error: {problem}", err=True)
        code = 2
    except StopSignal as exc:  # a stop signal outside a launcher's own handling (e.g. during its start-up)
        typer.echo(f"ddp-amp: error: {exc}", err=True)
        code = exc.exit_code
    except RunFailed as exc:
        if exc.details:
            typer.echo(exc.details, err=True)
        typer.echo(f"ddp-amp: error: {exc}", err=True)
        code = exc.exit_code
    sys.exit(code if isinstance(code, int) else 0)
