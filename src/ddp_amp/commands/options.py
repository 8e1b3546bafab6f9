"""The options the commands share, defined once.

- The training options are read from TrainConfig itself: each field's name, type, default and docstring become
  one flag (`option_specs`, rendered for typer in TRAINING_OPTIONS), so an option is defined in one place.
- `@with_training_options` and `@with_output_options` add a group of options to a command, which receives them
  as one dict (`train`, `output`).
- `@with_config_file` (commands.config_file) adds --config FILE.toml and --print-config.
- The Annotated aliases below are the options several commands take (the rendezvous ones, --run-dir...).
"""

from __future__ import annotations

import ast
import copy
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ddp_amp import config as config_module
from ddp_amp.commands.panels import K8S, OUTPUT, PANEL_OF
from ddp_amp.config import CHOICES, NOT_OPTIONS, TrainConfig
from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class OptionSpec:
    name: str
    """The TrainConfig field."""
    flag: str
    """--name-with-dashes; a boolean is also --no-name."""
    kind: type
    """str, int, float or bool."""
    optional: bool
    """None is the default: "not given"."""
    default: Any
    choices: tuple[str, ...] | None
    help: str


def field_docs(cls: type = TrainConfig) -> dict[str, str]:
    """The docstring under each field of a dataclass, whitespace collapsed."""
    tree = ast.parse(inspect.getsource(config_module))
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls.__name__)
    docs: dict[str, str] = {}
    for item, following in zip(node.body, node.body[1:]):
        if (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[item.target.id] = " ".join(following.value.value.split())
    return docs


_KINDS = {"str": str, "int": int, "float": float, "bool": bool, "tuple[str,...]": list}
"""The field types a training option may have; a tuple of strings is a repeatable flag."""


def option_specs() -> list[OptionSpec]:
    """One spec per TrainConfig field that is a training flag."""
    docs = field_docs()
    specs = []
    for field in dataclasses.fields(TrainConfig):
        if field.name in NOT_OPTIONS:
            continue
        annotation = str(field.type).replace(" ", "")
        optional = annotation.endswith("|None")
        kind = _KINDS[annotation.removesuffix("|None")]
        flag = "--" + field.name.replace("_", "-")
        specs.append(OptionSpec(field.name, flag, kind, optional, field.default, CHOICES.get(field.name),
                                docs.get(field.name, "")))
    return specs


def _typer_option(spec: OptionSpec) -> tuple[Any, Any]:
    """(default, annotation) of one training option: its type a Literal of the allowed names where there are
    some (listed by --help, completed by the shell), its help the field's docstring."""
    panel = PANEL_OF.get(spec.name, "Other options")  # tests/unit/test_cli.py: every option has a panel
    if spec.kind is list:  # repeatable: --task-arg A=1 --task-arg B=2, --tracker mlflow --tracker wandb
        metavar = "|".join(spec.choices) if spec.choices else "KEY=VALUE"  # TrainConfig checks the names
        return (), Annotated[list[str], typer.Option(spec.flag, metavar=metavar, help=spec.help.replace("[", "\\["),
                                                      rich_help_panel=panel, show_default=False)]
    kind = Literal[spec.choices] if spec.choices else spec.kind
    if spec.optional:
        kind = kind | None
    # Every boolean has its --no- form: a --config file that turns one on is overridden on the command line.
    names = (f"{spec.flag}/--no-{spec.flag[2:]}",) if spec.kind is bool else (spec.flag,)
    # rich markup reads [...] as a style: escape the docstrings' brackets.
    return spec.default, Annotated[kind, typer.Option(*names, help=spec.help.replace("[", "\\["),
                                                      rich_help_panel=panel)]


TRAINING_OPTIONS: dict[str, tuple[Any, Any]] = {spec.name: _typer_option(spec) for spec in option_specs()}
"""Every training option, (default, annotation) by TrainConfig field; TrainConfig validates the values."""

def run_dir_option(default: str, what: str = "Output directory") -> Any:
    """--run-dir, its help naming the default the command really uses (bench and doctor keep a folder of runs
    of their own, runs/bench-<timestamp>/ and runs/doctor-<timestamp>/)."""
    return Annotated[str | None, typer.Option("--run-dir", help=f"{what} \\[default: {default}].",
                                              rich_help_panel=OUTPUT)]


RunDir = run_dir_option("runs/<timestamp>")
LOG_FORMATS = ("auto", "rich", "plain", "json")

OUTPUT_OPTIONS: dict[str, tuple[Any, Any]] = {
    "run_dir": (None, RunDir),
    "overwrite": (False, Annotated[bool, typer.Option("--overwrite/--no-overwrite", rich_help_panel=OUTPUT,
                                                      help="Allow --run-dir to replace an earlier run's files.")]),
    "log_format": ("auto", Annotated[Literal[LOG_FORMATS], typer.Option(
        "--log-format", rich_help_panel=OUTPUT, help="Progress: auto (rich on a terminal, else plain), rich, "
        "plain (a line per rank per interval) or json (an object per event).")]),
    "quiet": (False, Annotated[bool, typer.Option("--quiet/--no-quiet", "-q", rich_help_panel=OUTPUT,
                                                  help="Print only the final summary and ddp-amp's warnings.")]),
}
"""What a launch writes and shows, the same on spawn, run and multinode."""

# The options several commands share.
NprocPerNode = Annotated[str, typer.Option("--nproc-per-node", "--nproc", "--gpus", "-n",
                                           help="Ranks on this node: a number, or gpu (one per visible GPU), cpu "
                                           "(one per core) or auto (gpu where there is one, else cpu), as torchrun "
                                           "takes them.")]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Restart the job this many times on a failure.")]
MonitorInterval = Annotated[float, typer.Option("--monitor-interval", help="Seconds between torchrun's checks.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the torchrun command and environment; start nothing. "
                                      "Writes only the RUN_DIR/config.json the command reads; refused over an "
                                      "earlier run with --overwrite or --resume, which it leaves as it was.")]
# Where the nodes of a multi-node job meet: multinode's options, and doctor's with --nnodes.
Endpoint = Annotated[str | None, typer.Option("--endpoint", help="host:port of the c10d store (port 29400 if omitted; "
                                              "torchrun's --rdzv-endpoint); the node owning that address hosts it.")]
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
# A user's script (spawn, run, multinode), as torchrun takes it: every word from the first positional one on is
# the script's (the commands parse no option after it: cli.SCRIPT_CONTEXT).
ScriptWords = Annotated[list[str] | None, typer.Argument(
    metavar="SCRIPT [ARGS]", show_default=False,
    help="Your own training script and its arguments, run on every rank as torchrun runs it (instead of "
    "ddp-amp's training loop); everything after SCRIPT is passed to it unchanged.")]
Module = Annotated[bool, typer.Option("-m", "--module", help="SCRIPT is a module, run as python -m does.")]
RequeueSignal = Annotated[str, typer.Option(
    "--requeue-signal", help="With --emit-slurm: the signal Slurm sends before the time limit (USR1, USR2 or "
    "TERM); the job stops at one step, checkpoints and requeues itself.")]
EmitOneNodeSlurm = Annotated[Path | None, typer.Option(
    "--emit-slurm", help="Write an sbatch script running this on one node of an allocation, and exit.")]
Launcher = Annotated[Literal["spawn", "run"], typer.Option("--launcher", help="spawn or run (torchrun), on one "
                                                           "node.")]


def check_json_path(path: Path | None) -> None:
    from ddp_amp.files import check_report_path

    check_report_path(path, "--json")


def check_plot_path(path: Path | None) -> None:
    from ddp_amp.files import PLOT_FORMATS, check_report_path

    if path is None:
        return
    check_report_path(path, "--plot", tuple(PLOT_FORMATS))
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ddp-amp[plot]' (or pip install matplotlib)") \
            from None


def option_group(options: dict[str, tuple[Any, Any]], into: str, shown: dict[str, str] | None = None,
                 **defaults: Any):
    """A decorator adding `options` to a command's signature; the command receives them as one dict named
    `into`. `defaults` change a default for that command, `shown` the words --help gives for a default that
    depends on the device (bench's task); an option the command defines itself (bench's --amp) replaces the
    group's one."""

    def annotation(name: str) -> Any:
        if name not in (shown or {}):
            return options[name][1]
        kind, info = typing.get_args(options[name][1])
        info = copy.copy(info)
        info.show_default = shown[name]
        return Annotated[kind, info]

    def decorate(command):
        signature = inspect.signature(command, eval_str=True)
        own = [p for p in signature.parameters.values() if p.name != into]
        shared = [name for name in options if name not in signature.parameters]
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=defaults.get(name, options[name][0]),
                                   annotation=annotation(name)) for name in shared]

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            group = {name: kwargs.pop(name) for name in shared}
            return command(**{into: group}, **kwargs)

        wrapper.__signature__ = signature.replace(parameters=own + added)
        wrapper.__annotations__ = {p.name: p.annotation for p in own + added}
        return wrapper

    return decorate


def with_training_options(command=None, shown: dict[str, str] | None = None, **defaults: Any):
    """Add TRAINING_OPTIONS as the dict `train`: `@with_training_options` or `@with_training_options(task=...)`."""
    decorate = option_group(TRAINING_OPTIONS, "train", shown, **defaults)
    return decorate if command is None else decorate(command)


with_output_options = option_group(OUTPUT_OPTIONS, "output")


K8S_OPTIONS: dict[str, tuple[Any, Any]] = {
    "emit_k8s": (None, Annotated[Path | None, typer.Option(
        "--emit-k8s", rich_help_panel=K8S, help="Write a Kubernetes manifest running this on --nnodes pods, and "
        "exit.")]),
    "k8s_kind": ("trainjob", Annotated[Literal["trainjob", "pytorchjob", "jobset"], typer.Option(
        "--k8s-kind", rich_help_panel=K8S, help="Kubeflow Trainer's TrainJob, Training Operator's PyTorchJob, "
        "or a plain JobSet.")]),
    "image": (None, Annotated[str | None, typer.Option("--image", rich_help_panel=K8S,
                                                        help="The container image (with ddp-amp installed).")]),
    "namespace": ("default", Annotated[str, typer.Option("--namespace", rich_help_panel=K8S)]),
    "gpus_per_node": (None, Annotated[int | None, typer.Option(
        "--gpus-per-node", rich_help_panel=K8S, help="nvidia.com/gpu per pod (and ranks per pod).")]),
    "cpu": (None, Annotated[str | None, typer.Option("--cpu", rich_help_panel=K8S, help="CPU request per pod.")]),
    "memory": (None, Annotated[str | None, typer.Option("--memory", rich_help_panel=K8S,
                                                         help="Memory request per pod, e.g. 16Gi.")]),
    "pvc": (None, Annotated[str | None, typer.Option(
        "--pvc", rich_help_panel=K8S, help="A PersistentVolumeClaim for the run dir, so checkpoints outlive pods.")]),
}
"""multinode --emit-k8s: what the manifest asks of the cluster (launch.kubernetes)."""
with_k8s_options = option_group(K8S_OPTIONS, "k8s")


NODE_OPTIONS: dict[str, tuple[Any, Any]] = {
    "nnodes": (None, Annotated[str | None, typer.Option("--nnodes", help="Nodes: N, or MIN:MAX for an elastic "
                                                                         "range.")]),
    "endpoint": (None, Endpoint),
    "from_env": (False, Annotated[bool, typer.Option(
        "--from-env", help="Read --nnodes, --endpoint, --node-rank and --nproc-per-node from what a TrainJob, "
        "PyTorchJob or ddp-amp's JobSet injects (PET_*, MASTER_ADDR/MASTER_PORT/WORLD_SIZE/RANK).")]),
    "node_rank": (None, Annotated[int | None, typer.Option("--node-rank", help="This node's rank (optional with "
                                                                                "c10d).")]),
    "rdzv_id": (None, RdzvId),
    "rdzv_timeout": (600.0, RdzvTimeout),
    "rdzv_last_call": (30, Annotated[int, typer.Option(
        "--rdzv-last-call", help="With --nnodes MIN:MAX: seconds to wait for more nodes once MIN have joined "
        "(torchrun's default).")]),
    "is_host": (None, IsHost),
    "local_addr": (None, LocalAddr),
    "ifname": (None, Ifname),
    "requeue_signal": ("USR1", RequeueSignal),
    "emit_slurm": (None, Annotated[Path | None, typer.Option(
        "--emit-slurm", help="Write an sbatch script running this on every node of an allocation, and exit.")]),
}
"""multinode: where the nodes meet, and the Slurm script it can write instead (launch.multinode)."""
with_node_options = option_group(NODE_OPTIONS, "node")


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
