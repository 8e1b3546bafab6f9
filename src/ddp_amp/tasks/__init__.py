"""Tasks: what a run trains. Built-in ones by name, or the user's own as `module:factory` / `file.py:factory`.

A factory is any callable that takes no arguments and returns a `Task`. It is called on every rank after the
global torch seed is set, so the model's initial weights are reproducible; the data set must come out the same
on every rank (generate it from a fixed seed, or read it from disk), since the DistributedSampler shards it.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddp_amp.errors import UsageError

BUILTIN = {
    "linear": "ddp_amp.tasks.linear:build",
    "mlp": "ddp_amp.tasks.mlp:build",
    "transformer": "ddp_amp.tasks.transformer:build",
    "mlp-wide": "ddp_amp.tasks.mlp:build_wide",
}


@dataclass
class Task:
    """What a factory returns.

    Each item of `dataset` is an `(inputs, target)` pair. Either side may be a tensor or any nesting of
    mappings (dicts), namedtuples, lists and tuples of tensors, as the DataLoader's default collation batches
    them; every tensor inside a batch is moved to the rank's device. `output = model(inputs)` runs under
    autocast, and `loss_fn(output, target)` must return a scalar tensor, the mean over the batch.
    """

    model: Any
    """A torch.nn.Module, on the CPU; ddp-amp moves it to the device and wraps it in DDP."""
    dataset: Any
    """A map-style torch Dataset (`__len__` and `__getitem__`), identical on every rank."""
    loss_fn: Callable[[Any, Any], Any]
    """`loss_fn(output, target) -> scalar tensor`."""
    evaluate: Callable[..., dict[str, float]] | None = None
    """Optional: `evaluate(model, device) -> {name: value}` on rank 0 after training and after model.pt is
    saved. The model is the plain trained module, in eval mode, without autocast, still on `device` (the rank's
    GPU under CUDA): move the evaluation data there. The values land in summary.json under "eval"; an
    exception lands under "eval_error" and fails the command, the weights kept. A one-argument
    `evaluate(model)` is still called, with the model as it is."""
    items_per_sample: int = 1
    """How many counted items a sample holds (tokens per sequence for language models)."""
    item_name: str = "samples"
    """What the throughput counts: summary.json reports `<item_name>_per_s` next to samples_per_s."""
    flops_per_item: float | None = None
    """Optional: training FLOPs (forward + backward) per item, for `ddp-amp bench`'s MFU."""


def resolve_factory(spec: str) -> Callable[[], Task]:
    """The factory named by `--task`, imported and checked for shape. Raises UsageError naming --task."""
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
        except Exception as exc:  # the user's module raised while importing: say where, in one line
            raise UsageError(import_failure(spec, exc)) from None
    factory = getattr(module, attr, None)
    if factory is None:
        raise UsageError(f"--task {spec!r}: module {module_part!r} has no attribute {attr!r}")
    if not callable(factory) or inspect.isclass(factory) and not issubclass(factory, Task):
        raise UsageError(f"--task {spec!r} is not a factory: {attr!r} must be a function returning a Task")
    try:
        inspect.signature(factory).bind()
    except TypeError:
        raise UsageError(f"--task {spec!r} is not a factory: {attr!r} must be callable with no arguments") from None
    except ValueError:
        pass  # some builtins have no inspectable signature; the call itself will tell
    return factory


def precheck_task(spec: str) -> None:
    """What can be checked of --task without importing anything (so without torch): a file task's syntax."""
    module_part, sep, _ = BUILTIN.get(spec, spec).rpartition(":")
    if sep and module_part.endswith(".py") and Path(module_part).is_file():
        check_task_file(spec, Path(module_part))


def build_task(spec: str) -> Task:
    task = resolve_factory(spec)()
    if not isinstance(task, Task):
        raise TypeError(f"--task {spec!r}: the factory returned {type(task).__name__}, not ddp_amp.tasks.Task")
    return task


def _import_file(spec: str, path: Path):
    if not path.is_file():
        raise UsageError(f"--task {spec!r}: file {str(path)!r} does not exist")
    name = f"ddp_amp_user_task_{abs(hash(str(path.resolve())))}"
    if name in sys.modules:
        return sys.modules[name]
    check_task_file(spec, path)
    module_spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # the user's file raised while importing: say where, in one line
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
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "importlib" not in f.filename and f"{os.sep}ddp_amp{os.sep}" not in f.filename]
    where = f" at {user[-1].filename}, line {user[-1].lineno}" if user else ""
    return f"--task {spec!r}: importing it failed{where}: {type(exc).__name__}: {exc}"
