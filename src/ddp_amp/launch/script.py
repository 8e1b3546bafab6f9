"""A user's own training script as the ranks' work: `ddp-amp spawn|run|multinode [options] SCRIPT.py [args]` or
`-m package.module [args]`, as torchrun takes `training_script [args]` and `-m`.

The launcher side only (no torch): what the script is, the checks made before any rank starts (it exists, is a
readable file that compiles, or a module that can be found), and the options that mean something for a script.
Each rank runs it through ddp_amp.rank.script, with torchrun's environment contract.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from ddp_amp.config import LOOP_OPTIONS, Script
from ddp_amp.errors import UsageError
from ddp_amp.outputs import LOOP_RECORD_FILE
from ddp_amp.precision import BF16_TRUE

SCRIPT_TRAINING_OPTIONS = ("stop_timeout", "device")
"""The training options that apply to a script: how long ranks get to leave after a stop signal, and the devices
the job asks for (--device cpu: no GPUs requested by --emit-slurm and --emit-k8s). The others configure
ddp-amp's own loop (its model, optimizer, schedule, precision, checkpoints), which a script does not run: given
with a script they are refused, never silently ignored."""


def script_from_command_line(words: list[str] | None, module: bool) -> Script | None:
    """SCRIPT [ARGS...] as typer collected them (every word after the first positional one, verbatim), or None
    when the command trains a task. Checked here, before anything starts: one line per problem, exit 2."""
    if not words:
        if module:
            raise UsageError("-m needs a module to run: ddp-amp run -n 2 -m package.module [args]")
        return None
    target, args = words[0], tuple(words[1:])
    cwd = os.getcwd()
    if module:
        check_module(target)
        return Script(target, args, module=True, cwd=cwd)
    path = Path(target)
    check_script_file(path)
    return Script(target, args, path=str(path.resolve()), cwd=cwd)


def check_script_file(path: Path) -> None:
    """A file that exists, is readable and compiles (a syntax error is named file:line, as Python would)."""
    if not path.exists():
        raise UsageError(f"script {str(path)!r} does not exist")
    if path.is_dir():
        raise UsageError(f"script {str(path)!r} is a directory; give the training script's file (or -m "
                         "package.module)")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"script {str(path)!r} cannot be read: {exc.strerror}") from None
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise UsageError(f"script {exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}") from None
    except ValueError as exc:  # source with a NUL byte
        raise UsageError(f"script {str(path)!r} is not Python source: {exc}") from None


def check_module(name: str) -> None:
    """-m NAME: a module Python can find from this directory, as `python -m NAME` would (its parent packages
    are imported to look, as Python does)."""
    import sys

    added = os.getcwd() not in sys.path
    if added:  # python -m puts the working directory first on the path
        sys.path.insert(0, os.getcwd())
    try:
        spec = importlib.util.find_spec(name)
        # A package runs as its __main__ submodule, as python -m runs it.
        main = (importlib.util.find_spec(f"{name}.__main__")
                if spec is not None and spec.submodule_search_locations is not None else None)
    except (ImportError, ValueError) as exc:
        raise UsageError(f"-m {name}: cannot be found ({type(exc).__name__}: {exc})") from None
    finally:
        if added:
            sys.path.remove(os.getcwd())
    if spec is None:
        raise UsageError(f"-m {name}: no module of that name (from {os.getcwd()})")
    if spec.submodule_search_locations is not None and main is None:
        raise UsageError(f"-m {name}: a package without a __main__ module, which python -m cannot run; give the "
                         "module that trains (-m package.module)")


def refuse_loop_options(changed: list[str], script: Script, dtype: str | None = None) -> None:
    """`changed`: the training options given, as TrainConfig fields (those that differ from their defaults). A
    script runs its own loop: the options of ddp-amp's loop are refused by name, except those a script that uses
    ddp_amp.loop takes (config.LOOP_OPTIONS), and --dtype bf16-true, whose fp32 masters live in ddp-amp's loop."""
    if dtype == BF16_TRUE:
        raise UsageError(f"--dtype {BF16_TRUE}: a script's loop keeps its model's weights as it built them; "
                         "use --dtype bf16 (autocast), or ddp-amp's own loop with --task")
    allowed = SCRIPT_TRAINING_OPTIONS + (LOOP_OPTIONS if uses_loop_module(script) else ())
    given = ["--" + name.replace("_", "-") for name in changed if name not in allowed]
    if not given:
        return
    loop_ones = [flag for flag in given if flag[2:].replace("-", "_") in LOOP_OPTIONS]
    hint = (f"; {', '.join(loop_ones)} would apply to a script that uses ddp_amp.loop, and "
            f"{script.target} does not import it") if loop_ones else ""
    raise UsageError(f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'} of ddp-amp's own "
                     f"training loop, which a script does not run; drop {'it' if len(given) == 1 else 'them'} "
                     "(a script takes its own arguments after its name; of the training options only "
                     f"--stop-timeout and --device apply to it){hint}")


def uses_loop_module(script: Script) -> bool:
    """Whether the script's own source imports ddp_amp.loop (`from ddp_amp import loop`, `import ddp_amp.loop`,
    `from ddp_amp.loop import ...`): read, never run. A script that reaches it only through a module of its own is
    not seen; such a script takes the loop's settings as setup(**defaults)."""
    import ast

    path = script.path
    if script.module:
        spec = importlib.util.find_spec(script.target)
        if spec is not None and spec.submodule_search_locations is not None:
            spec = importlib.util.find_spec(f"{script.target}.__main__")
        path = spec.origin if spec is not None else None
    try:
        tree = ast.parse(Path(path).read_bytes())
    except (OSError, SyntaxError, ValueError, TypeError):
        return False
    for node in ast.walk(tree):
        if isinstance(node, ast.Import) and any(alias.name.startswith("ddp_amp.loop") for alias in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and node.module and (
                node.module.startswith("ddp_amp.loop")
                or (node.module == "ddp_amp" and any(alias.name == "loop" for alias in node.names))):
            return True
    return False


def script_threads_env(nproc_per_node: int) -> dict[str, str]:
    """OMP_NUM_THREADS as torchrun sets it for a script: 1 for several ranks, unless the user set it."""
    return {"OMP_NUM_THREADS": "1"} if nproc_per_node > 1 and "OMP_NUM_THREADS" not in os.environ else {}


def script_record(script: Script, run_dir: Path, *, launch, model, started: float, failure) -> dict[str, Any]:
    """summary.json of a script's run, as its launcher saw it: the command, the ranks, the outcome (finished,
    failed: the rank and why, stopped: by which signal), the exit code and how long it ran; and a script that
    used ddp_amp.loop, its loop's own account (loop.json)."""
    import json
    import time

    world_sizes = [state.world_size for state in model.ranks.values() if state.world_size]
    record: dict[str, Any] = {
        "script": script.argv(), "launcher": "spawn" if launch.job is None else "torchrun's agent",
        "world_size": max(world_sizes) if world_sizes else launch.nproc, "ranks_on_this_node": launch.nproc,
        "outcome": "finished", "exit_code": 0, "wall_s": round(time.time() - started, 3),
        "restarts": model.restarts,
    }
    loop = run_dir / LOOP_RECORD_FILE  # a script using ddp_amp.loop: its loop's own account
    if loop.is_file():
        try:
            record["loop"] = json.loads(loop.read_text())
        except ValueError:
            pass
    if failure is not None:
        stopped = failure.exit_code > 128
        record.update(outcome="stopped" if stopped else "failed", exit_code=failure.exit_code)
        record["stopped_by" if stopped else "failure"] = str(failure).split(":")[0].removeprefix("stopped by ") \
            if stopped else str(failure)
    return record
