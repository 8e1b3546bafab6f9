"""Writes docs/options.md, the reference of every command's options, from the command line itself.

The training options are TrainConfig's fields (src/ddp_amp/config/__init__.py: name, type, default, docstring), which
the commands turn into flags (ddp_amp.commands.options); the other options are read from the typer app. So the page
says what `--help` says, and tests/unit/test_docs.py fails when the committed page is not what this writes.

    python docs/generate_options.py            # rewrite docs/options.md (make docs)
    python docs/generate_options.py --check    # exit 1 if docs/options.md is stale
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import typer

from ddp_amp.cli import app
from ddp_amp.commands.options import option_specs
from ddp_amp.commands.panels import PANELS

PAGE = Path(__file__).with_name("options.md")

HEADER = """# Options reference

Every option of every `ddp-amp` command, as `ddp-amp COMMAND --help` gives it. This page is generated from the
code by `make docs` (`docs/generate_options.py`): the training options are the fields of `TrainConfig`
(`src/ddp_amp/config/__init__.py`), each field's docstring its help, so the flags, their defaults and this page have one
source. Do not edit it by hand; `tests/unit/test_docs.py` fails when it is stale. The options are grouped by
concern, as `ddp-amp COMMAND --help-all` groups them (`src/ddp_amp/commands/panels.py`); a plain `--help` shows
the most used ones.

Options may also come from a file: `--config FILE.toml` takes its keys as defaults (flags still win), and
`--print-config` prints the resolved options in that form. See [commands](commands.md) for what each command does.
"""


def _cell(text: str) -> str:
    """Markdown table cell: one line, pipes escaped, rich's escaped brackets plain again."""
    return " ".join(text.replace("\\[", "[").split()).replace("|", "\\|")


def _names(param) -> str:
    if param.param_type_name == "argument":
        return f"`{param.name.upper()}`" + (" ..." if param.nargs == -1 else "")
    return ", ".join(f"`{name}`" for name in [*param.opts, *param.secondary_opts])


def _kind(param, ctx) -> str:
    if param.is_flag if param.param_type_name == "option" else False:
        return "flag"
    kind = param.display_type(ctx).strip("<>").replace("|", " \\| ")
    return "text" if kind == "str" else "repeatable" if kind == "list[str]" else kind


def _default(value) -> str:
    if value is None or value == () or value == []:
        return ""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"`{value}`"


def _row(param, ctx) -> str:
    return (f"| {_names(param)} | {_kind(param, ctx)} | {_default(param.default)} | "
            f"{_cell(getattr(param, 'help', None) or '')} |")


TABLE_HEAD = "| option | type | default | what it does |\n|---|---|---|---|"


def _is_training(param) -> bool:
    return getattr(param, "rich_help_panel", None) in PANELS


def _training_section(commands: dict) -> list[str]:
    flags = [spec.flag for spec in option_specs()]
    spawn_defaults = {param.opts[0]: param.default for param in commands["spawn"].params if _is_training(param)}
    takers = []
    for name, command in commands.items():
        taken = {param.opts[0]: param.default for param in command.params if _is_training(param)}
        if not taken:
            continue
        notes = []
        missing = [flag for flag in flags if flag not in taken]
        if missing:
            notes.append(f"all but {', '.join(f'`{flag}`' for flag in missing)}")
        notes += [f"`{flag}` defaults to {_default(default)}" for flag, default in taken.items()
                  if default != spawn_defaults[flag]]
        takers.append(f"`{name}`" + (f" ({'; '.join(notes)})" if notes else ""))
    spawn = commands["spawn"]
    ctx = spawn.make_context("spawn", [], resilient_parsing=True)
    lines = ["## Training options", "",
             "What to train and how, one option per field of `TrainConfig`, grouped by concern. Taken by "
             f"{', '.join(takers)}.", ""]
    for panel in PANELS:
        rows = [_row(param, ctx) for param in spawn.params if getattr(param, "rich_help_panel", None) == panel]
        lines += [f"### {panel}", "", TABLE_HEAD, *rows, ""]
    return lines


def _command_section(name: str, command) -> list[str]:
    own = [p for p in command.params if not _is_training(p) and not getattr(p, "hidden", False) and p.name != "help"]
    ctx = command.make_context(name, [], resilient_parsing=True)
    lines = [f"## `ddp-amp {name}`", "", _cell(command.help or ""), ""]
    if not own:
        return [*lines, "No options of its own.", ""]
    panels: dict[str, list] = {}
    for param in own:
        default = "Arguments" if param.param_type_name == "argument" else "Options"
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(param)
    for panel, params in panels.items():
        if len(panels) > 1:
            lines += [f"### {panel}", ""]
        lines += [TABLE_HEAD, *(_row(param, ctx) for param in params), ""]
    if any(_is_training(p) for p in command.params):
        lines += ["And the [training options](#training-options).", ""]
    return lines


def options_reference() -> str:
    group = typer.main.get_command(app)
    commands = dict(group.commands)
    lines = [HEADER, *_training_section(commands)]
    for name, command in commands.items():
        lines += _command_section(name, command)
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).rstrip() + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if the committed page is stale")
    args = parser.parse_args()
    text = options_reference()
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != text:
            print(f"{PAGE} is stale: run `make docs`", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
