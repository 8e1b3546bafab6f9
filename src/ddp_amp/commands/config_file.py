"""--config FILE.toml and --print-config of the launching commands: a file's keys become the command's
defaults (flags given on the command line win), a refusal names the file where the value came from it, and
--print-config writes what --config reads, checked as a launch would check it."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import math
import re
import typing
from pathlib import Path
from typing import Annotated, Any

import typer

from ddp_amp.commands.options import K8S_OPTIONS
from ddp_amp.commands.panels import ORDER, OUTPUT, PANEL_OF
from ddp_amp.commands.torchrun_names import NOT_TAKEN, torchrun_flag_names
from ddp_amp.config import NOT_OPTIONS, TrainConfig
from ddp_amp.errors import UsageError

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
        # TOML is UTF-8, whatever the locale says; utf-8-sig: an editor's byte order mark (Notepad writes one) is
        # not content, where tomllib would call it an "invalid statement" at line 1, column 1
        values = tomllib.loads(path.read_text(encoding="utf-8-sig"))
    except OSError as exc:
        raise UsageError(f"--config {str(path)!r}: cannot read it ({exc.strerror})") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"--config {str(path)!r} is not UTF-8, as TOML must be (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"--config {str(path)!r} is not valid TOML: {exc}") from None
    params = {param.name: param for param in ctx.command.params if param.name not in NOT_IN_CONFIG}
    for old, new in OLD_KEYS.items():  # both names in one file: one would silently win over the other
        if old in values and new in values and new in params:
            raise UsageError(f"--config {str(path)!r} gives {old} and {new}, one option ({old} is its old name): "
                             "keep one")
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
            try:  # a file --config would refuse is not printed as one
                check_training_options(resolved)
            except UsageError as exc:
                raise _naming_the_config_file(exc, ctx) from None
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


def check_training_options(options: dict[str, Any]) -> None:
    """TrainConfig's own checks of the training options among `options` (bench's --amp and --shard are its own)."""
    names = {field.name for field in dataclasses.fields(TrainConfig) if field.name not in NOT_OPTIONS}
    values = {key: value for key, value in options.items() if key in names}
    if "steps" in values and "epochs" not in values:  # bench: its own --steps, no --epochs
        values["epochs"] = None
    TrainConfig(**values)


def config_toml(options: dict[str, Any]) -> str:
    """Flat TOML: one `key = value` per option that has a value (TOML has no null: an unset option is left out,
    which means its default), grouped under a comment naming each concern, in --help's order; still flat, so a
    file of any age reads the same."""

    groups: dict[str | None, list[str]] = {panel: [] for panel in ORDER}
    for key, value in options.items():
        if value is None:
            continue
        if isinstance(value, Path):
            value = str(value)
        line = f"{key} = {toml_value(value)}"
        groups.setdefault(PANEL_OF.get(key), []).append(line)
    blocks = [[f"# {panel}"] * (panel is not None) + lines for panel, lines in groups.items() if lines]
    return "\n\n".join("\n".join(block) for block in blocks) + "\n"


def toml_value(value: Any) -> str:
    """A value as TOML writes it: JSON's, but for booleans and the floats JSON has no word for."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    return json.dumps(value)
