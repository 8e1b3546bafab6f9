"""Loading a task from `--task`: a built-in one by name, or the user's own as `module:factory` / `file.py:factory`,
with its `--task-arg KEY=VALUE` arguments converted by the factory's annotations; the checks the launcher runs
before starting ranks (precheck_task, check_task_file) and the one-line reasons an import failed."""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import inspect
import os
import sys
import traceback
import typing
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError
from ddp_amp.process import StopSignal
from ddp_amp.tasks.contract import Task

USER_EXITS = (Exception, SystemExit, KeyboardInterrupt)
"""What a task's import or factory may raise that is the task's fault, sys.exit() included: one line naming
--task, not a rank that leaves with the user's exit code (0: a "successful" run that trained nothing). A stop
the launch was asked for is StopSignal, raised by the rank's signal handler, and stays a stop."""

BUILTIN = {
    "linear": "ddp_amp.tasks.linear:build",
    "mlp": "ddp_amp.tasks.mlp:build",
    "transformer": "ddp_amp.tasks.transformer:build",
    "mlp-wide": "ddp_amp.tasks.mlp:build_wide",
    "gpt": "ddp_amp.tasks.gpt:build",
}


def resolve_factory(spec: str, task_args: Sequence[str] = ()) -> Callable[[], Task]:
    """The factory named by `--task`, imported and checked for shape, its `--task-arg KEY=VALUE` arguments
    converted and bound: a callable of no arguments. Raises UsageError naming --task or --task-arg."""
    target = BUILTIN.get(spec, spec)
    module_part, sep, attr = target.rpartition(":")
    if not sep or not module_part or not attr:
        raise UsageError(
            f"--task {spec!r} is not a built-in task ({', '.join(BUILTIN)}) nor module:factory or file.py:factory"
        )
    if module_part.endswith(".py"):
        module = _import_file(spec, Path(module_part))
    else:
        # Like `python -m`, let the current directory's modules be found (console scripts leave it off sys.path).
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_part)
        except ModuleNotFoundError as exc:
            if exc.name and module_part.startswith(exc.name):  # the named module itself is missing
                raise UsageError(f"--task {spec!r}: module {module_part!r} cannot be imported ({exc})") from None
            raise UsageError(import_failure(spec, exc)) from None
        except StopSignal:  # the launch was asked to stop while it imported the task: a stop, not a bad task
            raise
        except USER_EXITS as exc:  # the user's module raised while importing: say where, in one line
            raise UsageError(import_failure(spec, exc)) from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"--task {spec!r}: module {module_part!r} has no attribute {attr!r}")
    if not callable(factory) or inspect.isclass(factory) and not issubclass(factory, Task):
        raise UsageError(f"--task {spec!r} is not a factory: {attr!r} must be a function returning a Task")
    kwargs = task_arguments(factory, spec, attr, task_args)
    return functools.partial(factory, **kwargs) if kwargs else factory


def task_arguments(factory: Callable, spec: str, name: str, pairs: Sequence[str]) -> dict[str, Any]:
    """`--task-arg KEY=VALUE` pairs as the factory's keyword arguments, each value converted by the parameter's
    annotation (int, float, bool, str, Path, or one of them | None; unannotated: its default's type, else str).
    An unknown key, a value that does not convert, or a required parameter not given is a UsageError."""
    try:
        signature = inspect.signature(factory, eval_str=True)
    except (NameError, TypeError, SyntaxError):  # an annotation that does not evaluate: read as written
        try:
            signature = inspect.signature(factory)
        except ValueError:
            return {}
    except ValueError:  # some builtins have no inspectable signature; the call itself will tell
        return {}
    params = signature.parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    named = {k: p for k, p in params.items() if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD,
                                                           inspect.Parameter.KEYWORD_ONLY)}
    kwargs: dict[str, Any] = {}
    given: dict[str, str] = {}  # each key's --task-arg as typed, to name both when one is given twice
    for pair in pairs:
        key, sep, text = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"--task-arg {pair!r} is not KEY=VALUE")
        if key in kwargs:  # two values for one argument: a typo or a leftover, never silently the last
            raise UsageError(f"--task-arg {key} is given twice ({given[key]} and {pair}); give it once")
        if key not in named and not takes_any:
            takes = ", ".join(named) or "no arguments"
            raise UsageError(f"--task-arg {key}: unknown argument {key!r} of {name} (it takes: {takes})")
        kwargs[key] = _convert(key, text, named.get(key), name)
        given[key] = pair
    missing = [k for k, p in params.items() if p.default is inspect.Parameter.empty and k not in kwargs
               and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)]
    if missing:
        raise UsageError(f"--task {spec!r}: missing argument {missing[0]!r} of {name}; pass --task-arg "
                         f"{missing[0]}=VALUE")
    return kwargs


_TRUE, _FALSE = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


def _convert(key: str, text: str, param: inspect.Parameter | None, factory: str) -> Any:
    choices = _literal_choices(param)
    if choices:  # Literal["tiny", "124m"]: one of the names, said in one line where it is not
        if text not in choices:
            raise UsageError(f"--task-arg {key}={text!r} is not one of {', '.join(choices)} ({factory}'s {key})")
        return text
    kind = _argument_type(param)
    if text.lower() == "none" and _takes_none(param):
        return None
    try:
        if kind is bool:
            if text.lower() not in _TRUE + _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        return kind(text)
    except (TypeError, ValueError):
        raise UsageError(f"--task-arg {key}={text!r} is not {_a(kind.__name__)} ({factory} takes {key}: "
                         f"{_annotation_text(param, kind)})") from None


def _literal_choices(param: inspect.Parameter | None) -> tuple[str, ...]:
    """The names a `Literal[...]` of strings allows, else ()."""
    annotation = None if param is None else param.annotation
    if typing.get_origin(annotation) is not typing.Literal:
        return ()
    return tuple(str(choice) for choice in typing.get_args(annotation))


def _takes_none(param: inspect.Parameter | None) -> bool:
    """An argument annotated `X | None` (or Optional[X]), or unannotated with the default None."""
    if param is None:
        return False
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return param.default is None
    if isinstance(annotation, str):  # unevaluated: read as written
        return "None" in annotation.replace(" ", "").split("|") or annotation.startswith("Optional[")
    return type(None) in typing.get_args(annotation)


def _annotation_text(param: inspect.Parameter | None, kind: type) -> str:
    """The argument's annotation as its author wrote it ("int | None"), else the type it is converted to."""
    if param is None or param.annotation is inspect.Parameter.empty:
        return kind.__name__
    annotation = param.annotation
    if isinstance(annotation, str):
        return annotation
    return " | ".join("None" if a is type(None) else getattr(a, "__name__", str(a))
                      for a in typing.get_args(annotation)) or getattr(annotation, "__name__", str(annotation))


def _a(word: str) -> str:
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _argument_type(param: inspect.Parameter | None) -> type:
    if param is None:
        return str
    annotation = param.annotation
    if annotation is inspect.Parameter.empty:
        return type(param.default) if param.default not in (inspect.Parameter.empty, None) else str
    options = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if isinstance(options[0], str):  # unevaluated: match the spelling
        name = options[0].replace(" ", "").split("|")[0]
        return {"int": int, "float": float, "bool": bool, "Path": Path}.get(name, str)
    return options[0] if options[0] in (int, float, bool, str, Path) else str


def precheck_task(spec: str) -> None:
    """What can be checked of --task without importing anything (so without torch): a file task's syntax."""
    module_part, sep, _ = BUILTIN.get(spec, spec).rpartition(":")
    if sep and module_part.endswith(".py") and Path(module_part).is_file():
        check_task_file(spec, Path(module_part))


def build_task(spec: str, task_args: Sequence[str] = (), model_on_meta: bool = False) -> Task:
    """The task, its model built where Task.model is a function (model_on_meta: under torch.device("meta"))."""
    task = call_factory(resolve_factory(spec, task_args), spec)
    if not isinstance(task, Task):
        raise TypeError(f"--task {spec!r}: the factory returned {type(task).__name__}, not ddp_amp.tasks.Task")
    return with_built_model(task, spec, model_on_meta)


def with_built_model(task: Task, spec: str, model_on_meta: bool = False) -> Task:
    """The task, with its model built if Task.model is the function that builds it."""
    import torch

    if isinstance(task.model, torch.nn.Module) or not callable(task.model):
        return task
    with torch.device("meta") if model_on_meta else contextlib.nullcontext():
        model = task.model()
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"--task {spec!r}: Task.model's function returned {type(model).__name__}, not a "
                        "torch.nn.Module")
    return replace(task, model=model)


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise UsageError(f"--task {spec!r}: file {str(path)!r} does not exist")
    name = f"ddp_amp_user_task_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    check_task_file(spec, path)
    # As `python file.py` does: the file's folder first on sys.path, so its sibling modules import.
    folder = str(path.resolve().parent)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except StopSignal:  # the launch was asked to stop while it imported the task: a stop, not a bad task
        del sys.modules[name]
        raise
    except USER_EXITS as exc:  # the user's file raised while importing: say where, in one line
        del sys.modules[name]
        raise UsageError(import_failure(spec, exc)) from None
    return module


def check_task_file(spec: str, path: Path) -> None:
    """Compile (not run) a `file.py:factory` task: a syntax error is reported before anything starts."""
    try:
        compile(path.read_bytes(), str(path), "exec")
    except SyntaxError as exc:
        raise UsageError(import_failure(spec, exc)) from None
    except OSError as exc:
        raise UsageError(f"--task {spec!r}: cannot read {str(path)!r} ({exc.strerror})") from None


def import_failure(spec: str, exc: BaseException) -> str:
    """One line for an exception raised while importing a task: the user's file and line, and the error."""
    if isinstance(exc, SyntaxError):
        return f"--task {spec!r}: syntax error in {exc.filename}, line {exc.lineno}: {exc.msg}"
    if isinstance(exc, (SystemExit, KeyboardInterrupt)):
        return f"--task {spec!r}: importing it {exit_text(exc)}"
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and f"{os.sep}ddp_amp{os.sep}" not in f.filename]
    where = f" at {user[-1].filename}, line {user[-1].lineno}" if user else ""
    return f"--task {spec!r}: importing it failed{where}: {type(exc).__name__}: {exc}"


def call_factory(factory: Callable[[], Any], spec: str) -> Any:
    """The factory's task; its sys.exit() or KeyboardInterrupt one line naming --task (an exception it raises
    stays the user's, with its traceback)."""
    try:
        return factory()
    except (SystemExit, KeyboardInterrupt) as exc:
        raise UsageError(f"--task {spec!r}: the factory {exit_text(exc)}") from None


def exit_text(exc: SystemExit | KeyboardInterrupt) -> str:
    """What a task's code did, said in words: 'called sys.exit(0)', 'raised KeyboardInterrupt'."""
    if isinstance(exc, SystemExit):
        return f"called sys.exit({exc.code!r}) (a task returns a Task; it does not exit)"
    return "raised KeyboardInterrupt"
