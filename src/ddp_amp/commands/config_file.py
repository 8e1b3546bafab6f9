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
        values[key] = _checked_value(ctx, param, key, value, path)
    ctx.default_map = {**(ctx.default_map or {}), **values}
    ctx.meta[CONFIG_FILE_META] = path
    return path


NUMBER_OR_WORD = ("nproc_per_node", "micro_batch")
"""Text options whose text is a number or a word ("2" or "auto"): a TOML integer there is that number (spawn's
documented `nproc = 2`); any other text option takes a TOML string, so `run_dir = 5` is not silently "5"."""
TOML_TYPES = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array",
              dict: "a table"}


def _checked_value(ctx: typer.Context, param: Any, key: str, value: Any, path: Path) -> Any:
    """One key's value, refused unless it is of the option's type. The rule: a TOML string is the flag's text,
    read as the command line reads it (`steps = "5"` as `--steps 5`; one string for a repeatable flag is one use
    of it); any other value must be of the option's own type: true/false for a flag (which takes no text), an
    integer for an integer option (5.0 is not one, as `--steps 5.0` is not), an integer or float for a number, an
    array of strings for a repeatable option, and a string for a text option (NUMBER_OR_WORD aside)."""
    annotation = param.type_descriptor.annotation
    repeatable = typing.get_origin(annotation) is list
    if repeatable and isinstance(value, str):
        value = [value]
    expected = ("true or false" if annotation is bool else "an array of strings" if repeatable
                else "an integer" if annotation is int else "a number" if annotation is float
                else "a string or an integer" if key in NUMBER_OR_WORD else "a string")
    allowed = {"true or false": (bool,), "an array of strings": (list,), "an integer": (str, int),
               "a number": (str, int, float), "a string or an integer": (str, int), "a string": (str,)}[expected]
    if not isinstance(value, allowed) or (isinstance(value, bool) and annotation is not bool) \
            or (repeatable and not all(isinstance(item, str) for item in value)):
        kind = next((name for kind, name in TOML_TYPES.items() if isinstance(value, kind)), "a date or time")
        raise UsageError(f"--config {str(path)!r}: {key} = {_shown(value)} is {kind}, but "
                         f"--{key.replace('_', '-')} takes {expected}")
    try:
        param.get_runtime_param().coerce(value, param=param, ctx=ctx)
    except Exception:
        raise UsageError(f"--config {str(path)!r}: {key} = {_shown(value)} is not a valid --{key.replace('_', '-')}")\
            from None
    return value


def _shown(value: Any) -> str:
    """A value as the TOML file wrote it (a date or time as Python shows it: TOML writes it the same way)."""
    try:
        return toml_value(value)
    except TypeError:
        return str(value)


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
