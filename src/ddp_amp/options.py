"""The training options of the command line, read from TrainConfig itself: each field's name, type, default
and docstring become one flag, so an option is defined in one place. No torch, no typer: the CLI renders these.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
from dataclasses import dataclass
from typing import Any

from ddp_amp import config as config_module
from ddp_amp.config import CHOICES, NOT_OPTIONS, TrainConfig


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


_KINDS = {"str": str, "int": int, "float": float, "bool": bool}


def training_options() -> list[OptionSpec]:
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
