"""The options the commands share, defined once.

- The training options are read from TrainConfig itself: each field's name, type, default and docstring become
  one flag (`option_specs`, rendered for typer in TRAINING_OPTIONS), so an option is defined in one place.
- `@with_training_options` and `@with_output_options` add a group of options to a command, which receives them
  as one dict (`train`, `output`).
- `@with_config_file` adds --config FILE.toml (its keys become the defaults, flags win) and --print-config; the
  command receives the options as resolved in `resolved`, for RUN_DIR/config.toml.
- The Annotated aliases below are the options several commands take (the rendezvous ones, --run-dir...).
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import typer

from ddp_amp import config as config_module
from ddp_amp.commands.panels import K8S, ORDER, OUTPUT, PANEL_OF
from ddp_amp.commands.torchrun_names import NOT_TAKEN, torchrun_flag_names
from ddp_amp.config import CHOICES, NOT_OPTIONS, TrainConfig
from ddp_amp.errors import UsageError


@dataclass(frozen=True)
class OptionSpec:
    name: str
    """The TrainConfig field."""
    flag: str
    """--name-with-dashes; a boolean that defaults to True is also --no-name."""
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
    names = (f"{spec.flag}/--no-{spec.flag[2:]}",) if spec.kind is bool and spec.default else (spec.flag,)
    # rich markup reads [...] as a style: escape the docstrings' brackets.
    return spec.default, Annotated[kind, typer.Option(*names, help=spec.help.replace("[", "\\["),
                                                      rich_help_panel=panel)]


TRAINING_OPTIONS: dict[str, tuple[Any, Any]] = {spec.name: _typer_option(spec) for spec in option_specs()}
"""Every training option, (default, annotation) by TrainConfig field; TrainConfig validates the values."""

RunDir = Annotated[str | None, typer.Option("--run-dir", help="Output directory \\[default: runs/<timestamp>].",
                                            rich_help_panel=OUTPUT)]
LOG_FORMATS = ("auto", "rich", "plain", "json")

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
"""What a launch writes and shows, the same on spawn, run and multinode."""

# The options several commands share.
NprocPerNode = Annotated[str, typer.Option("--nproc-per-node", "--nproc", "--gpus", "-n",
                                           help="Ranks on this node: a number, or gpu (one per visible GPU), cpu "
                                           "(one per core) or auto (gpu where there is one, else cpu), as torchrun "
                                           "takes them.")]
MaxRestarts = Annotated[int, typer.Option("--max-restarts", help="Restart the job this many times on a failure.")]
MonitorInterval = Annotated[float, typer.Option("--monitor-interval", help="Seconds between torchrun's checks.")]
DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the torchrun command and environment; start nothing.")]
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
    if path is not None and not path.resolve().parent.is_dir():
        raise UsageError(f"--json {str(path)!r}: directory {str(path.parent)!r} does not exist")


def check_plot_path(path: Path | None) -> None:
    if path is None:
        return
    if not path.resolve().parent.is_dir():
        raise UsageError(f"--plot {str(path)!r}: directory {str(path.parent)!r} does not exist")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'ddp-amp[plot]' (or pip install matplotlib)") \
            from None


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


def with_training_options(command=None, **defaults: Any):
    """Add TRAINING_OPTIONS as the dict `train`: `@with_training_options` or `@with_training_options(task=...)`."""
    decorate = option_group(TRAINING_OPTIONS, "train", **defaults)
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


NOT_IN_CONFIG = ("config", "print_config", "dry_run", "emit_slurm", "from_env", *K8S_OPTIONS,
                 *{name: None for command in NOT_TAKEN for name in torchrun_flag_names(command)})
"""What --config files do not set and --print-config does not print: actions, not options, and torchrun's flags
that a command has no option for (commands.torchrun_names)."""


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
    values = {OLD_KEYS.get(key, key) if OLD_KEYS.get(key) in params else key: value for key, value in values.items()}
    for key, value in values.items():
        param = params.get(key)
        if param is None:
            raise UsageError(f"--config {str(path)!r}: unknown key {key!r} (not an option of "
                             f"ddp-amp {ctx.info_name}; keys are option names with underscores)")
        is_flag = param.type_descriptor.annotation is bool
        repeatable = typing.get_origin(param.type_descriptor.annotation) is list  # --task-arg: a list of strings
        try:
            if isinstance(value, bool) != is_flag or isinstance(value, dict) or isinstance(value, list) != repeatable:
                raise ValueError
            if repeatable and not all(isinstance(item, str) for item in value):
                raise ValueError
            if not repeatable:
                param.get_runtime_param().coerce(value, param=param, ctx=ctx)
        except Exception:
            raise UsageError(f"--config {str(path)!r}: {key} = {value!r} is not a valid --{key.replace('_', '-')}")\
                from None
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[CONFIG_FILE_META] = path
    return path


OLD_KEYS = {"nproc": "nproc_per_node"}
"""Keys that config files written before an option's rename still use: spawn's `nproc = 2`."""
CONFIG_FILE_META = "ddp_amp.config_file"
"""ctx.meta's key for the --config file the options came from (with_config_file names it in a refusal)."""


def _naming_the_config_file(exc: UsageError, ctx: typer.Context) -> UsageError:
    """A refusal of options that came from the --config file (not the command line) says so: the user looks for
    them in the file, not in the command they typed."""
    import re

    path = ctx.meta.get(CONFIG_FILE_META)
    if path is None:
        return exc
    message = str(exc)
    from_file = [f"--{name.replace('_', '-')}" for name in ctx.params
                 if getattr(ctx.get_parameter_source(name), "name", None) == "DEFAULT_MAP"
                 and name in (ctx.default_map or {})]
    named = [flag for flag in from_file if re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", message)]
    if not named:
        return exc
    return UsageError(f"{message} ({', '.join(named)} from --config {str(path)!r})")


CONFIG_FILE_OPTIONS = [
    inspect.Parameter("ctx", inspect.Parameter.KEYWORD_ONLY, annotation=typer.Context),
    inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=Annotated[
        Path | None, typer.Option("--config", is_eager=True, callback=_load_config_file, rich_help_panel=OUTPUT,
                                  help="Options from a TOML file (keys: option names with underscores); flags "
                                  "given here override it.")]),
    inspect.Parameter("print_config", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
        bool, typer.Option("--print-config", rich_help_panel=OUTPUT,
                           help="Print every option as resolved, as TOML for --config, and exit.")]),
]


def with_config_file(command):
    """Adds --config FILE.toml and --print-config to a launching command, which receives its options as
    resolved (flags over --config) in `resolved`."""
    signature = inspect.signature(command)
    own = [p for p in signature.parameters.values() if p.name != "resolved"]

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop("config")
        ctx = kwargs.pop("ctx")
        resolved = {name: value for name, value in kwargs.items() if name not in NOT_IN_CONFIG}
        if kwargs.pop("print_config"):
            typer.echo(config_toml(resolved), nl=False)
            return None
        try:
            return command(**kwargs, resolved=resolved)
        except UsageError as exc:
            raise _naming_the_config_file(exc, ctx) from None

    wrapper.__signature__ = signature.replace(parameters=[*own, *CONFIG_FILE_OPTIONS])
    wrapper.__annotations__ = {**{p.name: p.annotation for p in own},
                               **{p.name: p.annotation for p in CONFIG_FILE_OPTIONS}}
    return wrapper


def config_toml(options: dict[str, Any]) -> str:
    """Flat TOML: one `key = value` per option that has a value (TOML has no null: an unset option is left out,
    which means its default), grouped under a comment naming each concern, in --help's order; still flat, so a
    file of any age reads the same."""
    import json

    groups: dict[str | None, list[str]] = {panel: [] for panel in ORDER}
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, Path):
            value = str(value)
        line = f"{key} = {json.dumps(value) if not isinstance(value, bool) else str(value).lower()}"
        groups.setdefault(PANEL_OF.get(key), []).append(line)
    blocks = [[f"# {panel}"] * (panel is not None) + lines for panel, lines in groups.items() if lines]
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"
