"""The options of the training commands grouped by concern, in one place: the panels of `--help`, of
docs/options.md and of `--print-config`; and the short `--help` (the most used options) beside `--help-all`
(every option).

- PANELS: each TrainConfig option's concern, in the order a user thinks of them (what to train, how to optimize,
  on what precision, how parallel, checkpoints, evaluation, stops, observability).
- COMMAND_PANELS: the options of the commands themselves (output, launch, rendezvous, Slurm, Kubernetes).
- PanelledCommand: the click command class of spawn, run, multinode and bench; it puts every option in its panel,
  the panels in that order, and shows only SHORT_HELP's options under `--help`; `--help-all` shows them all.
"""

from __future__ import annotations

import functools
import inspect
from typing import Annotated, Any

import typer

from ddp_amp.commands.torchrun_names import TorchrunNames

TASK = "Task and data"
OPTIMIZATION = "Optimization"
PRECISION = "Device and precision"
PARALLEL = "Parallelism: DDP, ZeRO, FSDP"
CHECKPOINTS = "Checkpoints and resume"
EVALUATION = "Evaluation"
FAULTS = "Stops and faults"
OBSERVABILITY = "Observability"
PANELS: dict[str, tuple[str, ...]] = {
    TASK: ("task", "task_arg", "batch_size", "steps", "epochs", "seed", "num_workers"),
    OPTIMIZATION: ("optimizer", "lr", "momentum", "weight_decay", "schedule", "warmup_steps", "min_lr_ratio",
                   "clip_grad", "grad_accum", "micro_batch", "optimizer_impl"),
    PRECISION: ("device", "amp", "dtype", "compile", "max_memory", "tf32", "flush_denormal"),
    PARALLEL: ("shard", "bucket_mb", "bucket_view", "static_graph", "find_unused_parameters", "broadcast_buffers",
               "sync_batchnorm", "grad_compression"),
    CHECKPOINTS: ("checkpoint_every", "keep", "checkpoint_format", "async_checkpoint", "resume", "init_from",
                  "init_strict"),
    EVALUATION: ("eval_every", "keep_best"),
    FAULTS: ("timeout", "stop_timeout", "max_nonfinite"),
    OBSERVABILITY: ("log_every", "tensorboard", "tracker", "tracker_project", "tracker_run_name", "tracker_tag",
                    "profile"),
}
"""Every TrainConfig option (the fields outside config.NOT_OPTIONS) in exactly one concern, at most 12 each
(tests/unit/test_help.py); the order of the panels and of the options within them is the order --help shows."""

OUTPUT = "Output and config files"
LAUNCH = "Launch"
RENDEZVOUS = "Rendezvous (multinode)"
SLURM = "Slurm"
K8S = "Kubernetes (with --emit-k8s)"
BENCH = "What bench measures"
COMMAND_PANELS: dict[str, tuple[str, ...]] = {
    OUTPUT: ("run_dir", "overwrite", "log_format", "quiet", "config", "print_config"),
    BENCH: (),  # bench's own --amp, --compile, --shard... (commands/bench.py names their panel)
    LAUNCH: ("nproc_per_node", "max_restarts", "monitor_interval", "dry_run", "launcher", "module", "standalone"),
    RENDEZVOUS: ("nnodes", "from_env", "endpoint", "node_rank", "rdzv_id", "rdzv_timeout", "rdzv_last_call",
                 "is_host", "local_addr", "ifname"),
    SLURM: ("emit_slurm", "requeue_signal"),
    K8S: ("emit_k8s", "k8s_kind", "image", "namespace", "gpus_per_node", "cpu", "memory", "pvc"),
}
"""The commands' own options, after the training ones: what a launch writes, then how it launches."""

PANEL_OF: dict[str, str] = {name: panel for panels in (PANELS, COMMAND_PANELS)
                            for panel, names in panels.items() for name in names}
ORDER = [*PANELS, *COMMAND_PANELS]

SHORT_HELP: dict[str, str] = {
    "task": "linear, mlp, mlp-wide, transformer, gpt, or module:factory / file.py:factory.",
    "task_arg": "KEY=VALUE, repeatable: an argument of the --task factory.",
    "batch_size": "Samples per rank per micro-step.",
    "steps": "Optimizer steps to train \\[default: 100, unless --epochs].",
    "epochs": "Passes over the training set, instead of --steps.",
    "lr": "Peak learning rate.",
    "schedule": "LR schedule after warm-up.",
    "grad_accum": "Micro-steps per optimizer step.",
    "clip_grad": "Clip the global gradient norm to this value.",
    "device": "auto: CUDA when available, else CPU.",
    "amp": "Mixed precision: auto, on or off (fp32).",
    "dtype": "Autocast dtype (bf16-true: bf16 weights too; fp8: float8 layers, GPU).",
    "shard": "none (DDP), optimizer (ZeRO-1) or full (FSDP2).",
    "checkpoint_every": "Checkpoint every this many optimizer steps (0: never).",
    "resume": "A checkpoint to continue from: a path, or auto (the run dir's newest).",
    "eval_every": "Evaluate every this many optimizer steps, and at the end (0: at the end only).",
    "keep_best": "METRIC[:min|max]: keep the weights of the best evaluation in RUN_DIR/model_best.pt.",
    "tracker": "Log to an experiment tracker: mlflow or wandb (W&B); repeatable.",
}
"""The training options a plain --help shows (the most used), each in a line; --help-all shows every option
with its whole help."""
SHORT_TEXT = {
    **SHORT_HELP,
    "script": "Your own training script and its arguments, run on every rank instead of ddp-amp's loop.",
    "nproc_per_node": "Ranks: N, or gpu, cpu, auto (as torchrun).",
    "config": "Options from a TOML file; flags given here override it.",
    "endpoint": "host:port of the c10d store (port 29400 if omitted).",
    "from_env": "Read the node options from a Kubernetes job's variables.",
    "rdzv_id": "Job id, the same on every node \\[default: from the options].",
}
"""The help line of each option under a plain --help, where the whole one takes several lines."""
NOT_MOST_USED_BY = {"bench": frozenset({"epochs", "checkpoint_every", "resume", "eval_every", "keep_best",
                                         "tracker"})}
"""Training options of SHORT_HELP that a command's plain --help leaves out all the same: bench refuses --epochs,
and a timing has no use for checkpoints, evaluations or trackers."""
OWN_HELP = {"bench": {"steps": "Timed optimizer steps of each precision, after --warmup \\[default: 30]."}}
"""A shared training option's help where a command gives it another meaning: bench times --steps."""
LAUNCH_DETAILS = frozenset({"overwrite", "log_format", "quiet", "monitor_interval", "standalone", "rdzv_timeout",
                            "rdzv_last_call", "is_host", "local_addr", "ifname", "requeue_signal", "k8s_kind",
                            "image", "namespace", "gpus_per_node", "cpu", "memory", "pvc"})
"""The commands' own options that a plain --help leaves to --help-all."""
FULL_HELP = "ddp_amp.full_help"
"""ctx.meta's key: --help-all asked for every option."""


def shown_in_short_help(param, command: str) -> bool:
    if getattr(param, "rich_help_panel", None) in PANELS:
        return param.name in SHORT_HELP and param.name not in NOT_MOST_USED_BY.get(command, ())
    return param.name not in LAUNCH_DETAILS


def short_text(param, command: str) -> str | None:
    """The one-line help of an option under a plain --help; None: its own. SHORT_HELP's lines are the training
    options' (bench's own --amp and --shard take other values, and its --steps has OWN_HELP)."""
    if param.name in SHORT_HELP and (getattr(param, "rich_help_panel", None) not in PANELS
                                     or param.name in OWN_HELP.get(command, {})):
        return None
    return SHORT_TEXT.get(param.name)


class PanelledCommand(TorchrunNames):
    """A training command: every option in its panel (PANELS, COMMAND_PANELS; an option that names its own panel
    keeps it), the panels in ORDER; --help shows the most used options in a line each, --help-all every one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for param in self.params:
            if getattr(param, "rich_help_panel", None) is None and param.name in PANEL_OF:
                param.rich_help_panel = PANEL_OF[param.name]
            param.help = OWN_HELP.get(self.name, {}).get(param.name, param.help)
        rank = {panel: index for index, panel in enumerate(ORDER)}
        self.params.sort(key=lambda p: rank.get(getattr(p, "rich_help_panel", None), -1))

    def format_help(self, ctx, formatter) -> None:
        if ctx.meta.get(FULL_HELP):
            return super().format_help(ctx, formatter)
        left_out = [p for p in self.params if not p.hidden and not shown_in_short_help(p, self.name)]
        shortened = {p: p.help for p in self.params if short_text(p, self.name) is not None and p not in left_out}
        epilog = self.epilog
        self.epilog = f"The most used options; {len(left_out)} more, by concern: {ctx.command_path} --help-all"
        for param in left_out:
            param.hidden = True
        for param in shortened:
            param.help = short_text(param, self.name)
        try:
            return super().format_help(ctx, formatter)
        finally:
            for param in left_out:
                param.hidden = False
            for param, text in shortened.items():
                param.help = text
            self.epilog = epilog


def _full_help(ctx: typer.Context, value: bool) -> None:
    if value:
        ctx.meta[FULL_HELP] = True
        typer.echo(ctx.get_help(), color=ctx.color)
        raise typer.Exit()


HELP_ALL = inspect.Parameter("help_all", inspect.Parameter.KEYWORD_ONLY, default=False, annotation=Annotated[
    bool, typer.Option("--help-all", is_eager=True, callback=_full_help,
                       help="Show every option, grouped by concern, and exit.")])


def with_full_help(command):
    """Adds --help-all to a PanelledCommand (the command never sees it: its callback prints the help and exits)."""
    signature = inspect.signature(command)

    @functools.wraps(command)
    def wrapper(**kwargs: Any) -> Any:
        kwargs.pop("help_all")
        return command(**kwargs)

    wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), HELP_ALL])
    wrapper.__annotations__ = {**getattr(command, "__annotations__", {}), "help_all": HELP_ALL.annotation}
    return wrapper
