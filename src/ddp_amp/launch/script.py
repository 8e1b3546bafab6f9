"""A user's own training script as the ranks' work: `ddp-amp spawn|run|multinode [options] SCRIPT.py [args]` or
`-m package.module [args]`, as torchrun takes `training_script [args]` and `-m`.

The launcher side only (no torch): what the script is, the checks made before any rank starts (it exists, is a
readable file that compiles, or a module that can be found), and the options that mean something for a script.
Each rank runs it through ddp_amp.rank.script, with torchrun's environment contract.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from ddp_amp.config.script import LOOP_OPTIONS, Script
from ddp_amp.errors import UsageError
from ddp_amp.outputs import LOOP_RECORD_FILE
from ddp_amp.precision import BF16_TRUE, FP8_RECIPES

SCRIPT_TRAINING_OPTIONS = ("stop_timeout", "device")
"""The training options that apply to a script: how long ranks get to leave after a stop signal, and the devices
the job asks for (--device cpu: no GPUs requested by --emit-slurm and --emit-k8s). The others configure
ddp-amp's own loop (its model, optimizer, schedule, precision, checkpoints), which a script does not run: given
with a script they are refused, never silently ignored."""


INTERPRETERS = ("python", "python3", "torchrun", "python3.11", "python3.12", "python3.13")
"""Words a user may type before the script out of habit (`torchrun ... python train.py` is a common mistake too)."""


def script_from_command_line(words: list[str] | None, module: bool) -> Script | None:
    """SCRIPT [ARGS...] as typer collected them (every word after the first positional one, verbatim), or None
    when the command trains a task. Checked here, before anything starts: one line per problem, exit 2."""
    if not words:
        if module:
            raise UsageError("-m needs a module to run, as python -m does: -m package.module [ARGS]")
        return None
    target, args = words[0], tuple(words[1:])
    cwd = os.getcwd()
    if module:
        check_module(target)
        return Script(target, args, module=True, cwd=cwd)
    path = Path(target)
    if not path.exists() and Path(target).name in INTERPRETERS:
        raise UsageError(f"script {target!r}: ddp-amp runs the script with Python itself, as torchrun does; drop "
                         f"{target!r} (ddp-amp run -n 2 train.py, or -m package.module)")
    check_script_file(path)
    return Script(target, args, path=str(path.resolve()), cwd=cwd)


def check_script_file(path: Path, what: str = "script") -> None:
    """A regular file that exists, is readable and compiles (a syntax error is named file:line, as Python would).
    Not a FIFO or a device: reading one would wait for a writer that may never come."""
    import stat

    if not path.exists():
        raise UsageError(f"{what} {str(path)!r} does not exist")
    if path.is_dir():
        raise UsageError(f"{what} {str(path)!r} is a directory; give the training script's file (or -m "
                         "package.module)")
    if not stat.S_ISREG(path.stat().st_mode):
        raise UsageError(f"{what} {str(path)!r} is not a regular file (a pipe or a device); give the training "
                         "script's file")
    try:
        source = path.read_bytes()
    except OSError as exc:
        raise UsageError(f"{what} {str(path)!r} cannot be read: {exc.strerror}") from None
    if b"\0" in source:
        raise UsageError(f"{what} {str(path)!r} is not Python source: it holds NUL bytes (a binary file?)")
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise UsageError(f"{what} {exc.filename}:{exc.lineno}: {type(exc).__name__}: {exc.msg}") from None
    except ValueError as exc:
        raise UsageError(f"{what} {str(path)!r} is not Python source: {exc}") from None


def check_module(name: str) -> None:
    """-m NAME: a module Python can find from this directory, as `python -m NAME` would, whose source (and that
    of the packages above it, which python -m runs first) compiles. Found without importing anything: a
    package's __init__ is the user's code, which runs in the ranks, never in the launcher."""
    if name.endswith(".py") and Path(name).is_file():
        dotted = name.removesuffix(".py").replace("/", ".")
        raise UsageError(f"-m {name}: -m takes a module's dotted name, {name} is a file; run the file without -m "
                         f"(ddp-amp run -n 2 {name}) or give its module (-m {dotted})")
    try:
        chain = module_chain(name)
    except ModuleNotFound as missing:
        raise UsageError(f"-m {name}: {missing}") from None
    spec = chain[-1]
    if spec.submodule_search_locations is not None:
        raise UsageError(f"-m {name}: a package without a __main__ module, which python -m cannot run; give the "
                         "module that trains (-m package.module)")
    for found in chain:
        if found.origin and found.origin.endswith(".py"):
            check_script_file(Path(found.origin), what=f"-m {name}:")


class ModuleNotFound(Exception):
    """What of a dotted name cannot be found (module_chain)."""


def module_chain(name: str) -> list:
    """The specs python -m NAME would import, the top package first and the module it runs last (a package's
    __main__), found as importlib finds them (sys.meta_path's finders: plain files, zips, editable installs)
    but without executing any: a parent package's __init__ is not imported to look inside it, its
    submodule_search_locations are. The working directory comes first, as python -m puts it on sys.path."""
    import sys

    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        raise ModuleNotFound("not a module name (dotted Python identifiers, as python -m takes)")
    added = os.getcwd() not in sys.path
    if added:
        sys.path.insert(0, os.getcwd())
    try:
        chain, locations = [], None
        for index, part in enumerate(parts):
            fullname = ".".join(parts[:index + 1])
            if locations is None and index > 0:
                raise ModuleNotFound(f"{'.'.join(parts[:index])} is a module, not a package")
            spec = _find_spec(fullname, locations)
            if spec is None:
                raise ModuleNotFound("no module of that name (from " + os.getcwd() + ")" if index == 0 else
                                     f"{'.'.join(parts[:index])} has no module {part}")
            chain.append(spec)
            locations = spec.submodule_search_locations
        if locations is not None:  # a package runs as its __main__ submodule, as python -m runs it
            main = _find_spec(f"{name}.__main__", locations)
            if main is not None:
                chain.append(main)
        return chain
    finally:
        if added:
            sys.path.remove(os.getcwd())


def _find_spec(fullname: str, path):
    """importlib's search for one name, without the import of its parent that importlib.util.find_spec does."""
    import sys

    if (module := sys.modules.get(fullname)) is not None and getattr(module, "__spec__", None) is not None:
        return module.__spec__
    for finder in sys.meta_path:
        find = getattr(finder, "find_spec", None)
        if find is None:
            continue
        try:
            spec = find(fullname, path)
        except (ImportError, ValueError):
            continue
        if spec is not None:
            return spec
    return None


def refuse_loop_options(changed: list[str], script: Script, dtype: str | None = None,
                        resume: str | None = None) -> None:
    """`changed`: the training options given, as TrainConfig fields (those that differ from their defaults). A
    script runs its own loop: the options of ddp-amp's loop are refused by name, except those a script that uses
    ddp_amp.loop takes (config.LOOP_OPTIONS), and --dtype bf16-true, whose fp32 masters live in ddp-amp's loop.
    `--resume auto` is every script's: it continues the run dir of an earlier launch (a plain script resumes
    from its own checkpoints; --resume PATH is ddp_amp.loop's)."""
    loop = uses_loop_module(script)
    if dtype == BF16_TRUE or dtype in FP8_RECIPES:
        what = "keeps its model's weights" if dtype == BF16_TRUE else "keeps its model's layers"
        raise UsageError(f"--dtype {dtype}: a script's loop {what} as it built them; "
                         + ("use --dtype bf16 (autocast), or ddp-amp's own loop with --task" if loop else
                            "use ddp-amp's own loop with --task"))
    allowed = SCRIPT_TRAINING_OPTIONS + (LOOP_OPTIONS if loop else ()) + (("resume",) if resume == "auto" else ())
    given = ["--" + name.replace("_", "-") for name in changed if name not in allowed]
    if not given:
        return
    takes = ("--stop-timeout and ddp_amp.loop's settings (" + ", ".join(
        "--" + name.replace("_", "-") for name in LOOP_OPTIONS) + ")") if loop else \
        "--stop-timeout, --device and --resume auto"
    loop_ones = [flag for flag in given if flag[2:].replace("-", "_") in LOOP_OPTIONS]
    hint = (f"; {', '.join(loop_ones)} would apply to a script that uses ddp_amp.loop, and "
            f"{script.target} does not import it (a loop in a module of its own: add `import ddp_amp.loop` to "
            f"{entry_file(script) or script.target} itself, which is where ddp-amp looks)") if loop_ones else ""
    raise UsageError(f"{', '.join(given)}: {'an option' if len(given) == 1 else 'options'} of ddp-amp's own "
                     f"training loop, which a script does not run; drop {'it' if len(given) == 1 else 'them'} "
                     f"(a script takes its own arguments after its name; of the training options only {takes} apply "
                     f"to it){hint}")


def entry_file(script: Script) -> str | None:
    """The file whose source says whether a script uses ddp_amp.loop: the script, or the module python -m runs
    (a package's __main__), found without importing."""
    if not script.module:
        return script.path
    try:
        return module_chain(script.target)[-1].origin
    except ModuleNotFound:
        return None


def uses_loop_module(script: Script) -> bool:
    """Whether the script's own source imports ddp_amp.loop (`from ddp_amp import loop`, `import ddp_amp.loop`,
    `from ddp_amp.loop import ...`): read, never run. A script that reaches it only through a module of its own is
    not seen; such a script takes the loop's settings as setup(**defaults)."""
    import ast

    try:
        tree = ast.parse(Path(entry_file(script)).read_bytes())
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


def script_record(script: Script, run_dir: Path, *, launch, view, started: float, failure) -> dict[str, Any]:
    """summary.json of a script's run, as its launcher saw it: the command, the ranks, the outcome (finished,
    failed: the rank and why, stopped: by which signal), the exit code and how long it ran; and a script that
    used ddp_amp.loop, its loop's own account (loop.json)."""
    import json
    import time

    world_sizes = [state.world_size for state in view.ranks.values() if state.world_size]
    record: dict[str, Any] = {
        "script": script.argv(), "launcher": "spawn" if launch.job is None else "torchrun's agent",
        "world_size": max(world_sizes) if world_sizes else launch.nproc, "ranks_on_this_node": launch.nproc,
        "outcome": "finished", "exit_code": 0, "wall_s": round(time.time() - started, 3),
        "restarts": view.restarts,
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


def loop_stop_signal(view) -> signal.Signals | None:
    """The stop signal a ddp_amp.loop script's ranks agreed on, as this node's ranks said it (their "loop"
    events: every rank stops at the same step, so every node knows it, not only the one whose run dir gets rank
    0's loop.json), or None."""
    name = next((state.loop["stopped_by"] for state in view.ranks.values() if "stopped_by" in state.loop), None)
    return signal.Signals[name] if name in signal.Signals.__members__ else None


def stop_after_the_loop(run_dir: Path, view, started: float, stopped):
    """`stopped`, a stop this launcher passed on; None, said in one line, where it came after a ddp_amp.loop
    script's loop had run every step and every rank then returned 0: a finished run, as ddp-amp's own loop calls
    it (exit 0: nothing is left for a resume). A plain script's exit 0 may be its own stop handler's: a stop.
    Decided from this node's ranks, their "loop" events: every rank ends its loop at the same step, completed or
    stopped (the ranks agree on a stop together), so each node of a multinode job gives the same verdict, not
    only the one whose run dir gets rank 0's loop.json (read here for the model.pt it names, where it is)."""
    import json

    ranks = view.ranks.values()
    if not ranks or any(state.status != "done" or state.exit_code != 0 or "completed_steps" not in state.loop
                        or "stopped_at_step" in state.loop for state in ranks):
        return stopped
    try:
        record = run_dir / LOOP_RECORD_FILE
        loop = json.loads(record.read_text()) if record.stat().st_mtime >= started else {}  # this launch's
    except (OSError, ValueError):
        loop = {}
    written = f"; {loop['model']} is written" if isinstance(loop, dict) and loop.get("model") else ""
    steps = max(state.loop["completed_steps"] for state in ranks)
    print(f"ddp-amp: {str(stopped).removeprefix('stopped by ')} came after the loop had finished (step "
          f"{steps}){written}", file=sys.stderr, flush=True)  # a status line, as verdict.say's
    return None


def newest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint --resume auto would take first (ddp_amp.loop's), or None."""
    from ddp_amp.checkpoint.storage import checkpoints

    found = checkpoints(run_dir)
    return found[0] if found else None


def script_stop_line(record: dict[str, Any], run_dir: Path, signalled: str, view) -> str:
    """The verdict of a script stopped by a signal: for a ddp_amp.loop script that stopped at an agreed step,
    what the built-in loop's says (the step, the checkpoint, how to continue); else the signal passed on, and
    where a loop script's work is when it did not get to its stop (killed after --stop-timeout in a slow
    checkpoint write, or stopped before its loop's stop took effect): the newest complete checkpoint. Then the
    ranks that had stalled, and where (the progress `view`'s)."""
    return _stop_line(record, run_dir, signalled, view) + "".join(
        f"; rank {state.rank} had stalled at {state.position[3]}" for state in view.stalled())


def _stop_line(record: dict[str, Any], run_dir: Path, signalled: str, view) -> str:
    loop = record.get("loop") or {}
    step, checkpoint = loop.get("stopped_at_step"), loop.get("checkpoint")
    agreed = next((state.loop for state in view.ranks.values() if "stopped_at_step" in state.loop), None)
    if step is None and agreed is not None and 0 not in view.ranks:
        # a node of a multinode job without a shared run dir: loop.json and the checkpoint are rank 0's node's
        return (f"stopped by {agreed['stopped_by']} at step {agreed['stopped_at_step']} (the loop's record and "
                "its checkpoint are in global rank 0's run dir, on its node)")
    if step is None:
        line = f"{signalled}: passed on to every rank (each rank's output in {run_dir / 'logs'})"
        if kept := newest_checkpoint(run_dir):
            line += f"; the newest complete checkpoint is {kept} (continue with --resume auto --run-dir {run_dir})"
        return line
    name = loop.get("stopped_by") or signalled.removeprefix("stopped by ")
    if checkpoint:
        return (f"stopped by {name} at step {step}; checkpoint {checkpoint} (continue with --resume auto --run-dir "
                f"{run_dir})")
    return f"stopped by {name} at step {step}; no checkpoint kept"


def check_script_resume(resume: str | None) -> None:
    """--resume PATH of a loop script: a checkpoint that is there, refused before any rank starts (the loop's
    restore() checks what it holds)."""
    if resume is None or resume == "auto":
        return
    path = Path(resume)
    if not (path.is_file() or (path / ".metadata").is_file()):
        raise UsageError(f"--resume {resume}: no such checkpoint" + (" (a directory without DCP's .metadata)"
                                                                    if path.is_dir() else ""))


