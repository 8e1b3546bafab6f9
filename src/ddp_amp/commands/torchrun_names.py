"""torchrun's names on ddp-amp's command line, so that a torchrun command line carries over.

- TorchrunNames, the click command class of every command: an option that torchrun also takes answers to
  torchrun's underscore spelling too (--nproc_per_node, --max_restarts...), and --endpoint to torchrun's name
  for it (--rdzv-endpoint, --rdzv_endpoint); hidden aliases, left out of --help so that it stays short.
- NOT_TAKEN and @with_torchrun_flags: the torchrun flags a launching command has no option of its own for. A
  value that asks for what the command does anyway is taken and changes nothing (run --standalone,
  multinode --rdzv-backend c10d); any other is refused in one line that names the flag, as typed, and says
  what to use instead.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from ddp_amp.errors import UsageError

UNDERSCORED = ("--nproc-per-node", "--node-rank", "--max-restarts", "--monitor-interval", "--rdzv-id",
               "--rdzv-endpoint", "--rdzv-backend", "--local-addr", "--master-addr", "--master-port")
"""torchrun's flags that it takes under both spellings, --nproc-per-node and --nproc_per_node (its
--nnodes, --standalone and --module have no second one)."""
TORCHRUN_NAME = {"--endpoint": "--rdzv-endpoint"}
"""ddp-amp's options that torchrun names otherwise."""


def underscored(flag: str) -> str:
    return "--" + flag[2:].replace("-", "_")


def torchrun_spellings(opts: list[str]) -> list[str]:
    """The names torchrun gives an option that ddp-amp names `opts`, beyond those."""
    names = [*opts, *(TORCHRUN_NAME[opt] for opt in opts if opt in TORCHRUN_NAME)]
    names += [underscored(name) for name in names if name in UNDERSCORED]
    return [name for name in dict.fromkeys(names) if name not in opts]


class TorchrunNames(TyperCommand):
    """A command whose options also answer to torchrun's spellings of them (torchrun_spellings), which its
    parser takes and its help leaves out. A spelling another option of the command holds stays that one's."""

    def make_parser(self, ctx):
        parser = super().make_parser(ctx)
        params = [p for p in self.get_params(ctx) if p.param_type_name == "option"]
        held = {name for p in params for name in (*p.opts, *p.secondary_opts)}
        for param in params:
            aliases = [name for name in torchrun_spellings(param.opts) if name not in held]
            if not aliases:
                continue
            opts, secondary = param.opts, param.secondary_opts
            param.opts, param.secondary_opts = aliases, []  # the parser's entries for these names alone
            try:
                param.add_to_parser(parser, ctx)
            finally:
                param.opts, param.secondary_opts = opts, secondary
        return parser


@dataclass(frozen=True)
class NotTaken:
    """A torchrun flag a command has no option for."""

    flag: str
    instead: str
    """What to do instead, for the refusal's line."""
    accepted: tuple[Any, ...] = ()
    """Values that ask for what the command does anyway: taken, and they change nothing."""
    is_flag: bool = False
    help: str | None = None
    """Shown in --help-all where given (an accepted flag, documented); otherwise the flag is hidden."""


ONE_NODE = ("1", "1:1")
STANDALONE_HELP = ("Taken for torchrun's command lines, and changes nothing: {command} always runs on this node "
                   "alone, its rendezvous on loopback on a free port, as torchrun's --standalone does.")
FREE_PORT = "{command} serves its rendezvous on loopback, on a free port of its own: drop it"
MULTINODE = "several nodes meet with ddp-amp multinode --nnodes N --endpoint HOST:PORT"
NOT_TAKEN: dict[str, tuple[NotTaken, ...]] = {
    "spawn": (
        NotTaken("--standalone", "", accepted=(True,), is_flag=True, help=STANDALONE_HELP.format(command="spawn")),
        NotTaken("--nnodes", f"spawn starts ranks on this node only; {MULTINODE}", accepted=ONE_NODE),
        NotTaken("--rdzv-backend", "spawn forks its ranks without torchrun's rendezvous: drop it, or use ddp-amp "
                 "run (c10d)"),
        NotTaken("--rdzv-endpoint", f"spawn runs on this node alone; {MULTINODE}"),
        NotTaken("--master-addr", FREE_PORT.format(command="spawn")),
        NotTaken("--master-port", FREE_PORT.format(command="spawn")),
    ),
    "run": (
        NotTaken("--standalone", "", accepted=(True,), is_flag=True, help=STANDALONE_HELP.format(command="run")),
        NotTaken("--nnodes", f"run starts ranks on this node only; {MULTINODE}", accepted=ONE_NODE),
        NotTaken("--rdzv-backend", "run's rendezvous is c10d, the only backend ddp-amp runs: give c10d or leave "
                 "the flag out", accepted=("c10d",)),
        NotTaken("--rdzv-endpoint", f"run's rendezvous is on loopback; {MULTINODE}"),
        NotTaken("--master-addr", FREE_PORT.format(command="run")),
        NotTaken("--master-port", FREE_PORT.format(command="run")),
    ),
    "multinode": (
        NotTaken("--standalone", "multinode's nodes meet at --endpoint; on one node alone use ddp-amp run",
                 is_flag=True),
        NotTaken("--rdzv-backend", "multinode's rendezvous is c10d (its store at --endpoint), the only backend "
                 "ddp-amp runs: give c10d or leave the flag out", accepted=("c10d",)),
        NotTaken("--master-addr", "multinode's nodes meet at a c10d store: use --endpoint HOST:PORT (torchrun's "
                 "--rdzv-endpoint)"),
        NotTaken("--master-port", "multinode's nodes meet at a c10d store: use --endpoint HOST:PORT (torchrun's "
                 "--rdzv-endpoint)"),
    ),
}
"""Per launching command, torchrun's flags it has no option for. --standalone is what spawn and run do anyway;
multinode's rendezvous, like run's, is c10d; --master-addr and --master-port belong to torchrun's static
rendezvous, which ddp-amp does not run."""


def _parameters(command: str) -> dict[str, tuple[str, NotTaken, inspect.Parameter]]:
    """A keyword parameter per spelling of each flag of NOT_TAKEN[command]: {name: (spelling, entry, param)}."""
    found = {}
    for entry in NOT_TAKEN[command]:
        for spelling in dict.fromkeys((entry.flag, underscored(entry.flag))):
            name = spelling[2:].replace("-", "_") + ("_" if "_" in spelling else "")
            kind = bool if entry.is_flag else str | None
            option = typer.Option(spelling, hidden=entry.help is None, help=entry.help, show_default=False)
            found[name] = (spelling, entry, inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY,
                                                              default=False if entry.is_flag else None,
                                                              annotation=Annotated[kind, option]))
    return found


def torchrun_flag_names(command: str) -> tuple[str, ...]:
    """The parameter names with_torchrun_flags adds to `command`: not options a --config file sets."""
    return tuple(_parameters(command)) if command in NOT_TAKEN else ()


def refusal(spelling: str, entry: NotTaken, value: Any) -> str | None:
    """The line refusing `spelling` given as `value`; None where it is not given or is taken."""
    if value in (None, False) or value in entry.accepted:
        return None
    return f"{spelling}{'' if entry.is_flag else f' {value}'}: {entry.instead}"


def with_torchrun_flags(command_name: str):
    """Adds NOT_TAKEN[command_name]'s flags to a command, which never sees them: one refused is one line (exit 2)
    before the command runs."""
    added = _parameters(command_name)

    def decorate(command):
        signature = inspect.signature(command)

        @functools.wraps(command)
        def wrapper(**kwargs: Any) -> Any:
            given = {name: kwargs.pop(name) for name in added}
            for name, value in given.items():
                spelling, entry, _ = added[name]
                if (line := refusal(spelling, entry, value)) is not None:
                    raise UsageError(line)
            return command(**kwargs)

        params = [param for _, _, param in added.values()]
        wrapper.__signature__ = signature.replace(parameters=[*signature.parameters.values(), *params])
        wrapper.__annotations__ = {**getattr(command, "__annotations__", {}),
                                   **{param.name: param.annotation for param in params}}
        return wrapper

    return decorate
