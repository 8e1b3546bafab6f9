"""`run --dry-run` and `multinode --dry-run`: what they write (this launch's config.json, which the printed command
reads, and nothing else: no lock) and what they never touch (an earlier run in the run dir, byte for byte, even
under --overwrite or --resume, which a dry run then refuses in one line). In-process, nothing launched; the
printed command run by hand: tests/system/test_torchrun.py."""

import json
import os
import shlex

import pytest
import torch
from helpers import CHECKS_SCRIPT, ddp_amps_run_dir, one_line, run_main

from ddp_amp.files import DirectoryLock

COMMANDS = {
    "run": ["run", "-n", "2", "--device", "cpu"],
    "multinode": ["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1:29411", "--device", "cpu"],
}


def dry_run(command: str, run_dir, *flags: str, capsys, steps: int = 3) -> tuple[int, str, str]:
    return run_main([*COMMANDS[command], "--steps", str(steps), *flags, "--dry-run", "--run-dir", str(run_dir)],
                    capsys)


def printed_config(out: str) -> str:
    """The config file the printed torchrun command gives ddp-amp's worker (its last word)."""
    argv = shlex.split(out.splitlines()[0])
    assert argv[-3:-1] == ["-m", "ddp_amp.worker"], argv
    return argv[-1]


def everything_in(run_dir) -> dict[str, tuple[bytes, int, int] | None]:
    """Every entry, hidden ones included: a file's bytes, inode and modification time (a file replaced by the same
    bytes, or renamed away and back, is told apart); None for a directory."""
    entries = {}
    for path in sorted(run_dir.rglob("*")):
        found = path.stat()
        entries[str(path.relative_to(run_dir))] = None if path.is_dir() else (
            path.read_bytes(), found.st_ino, found.st_mtime_ns)
    return entries


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("before", ["none", "empty", "a dry run's config.json"])
@pytest.mark.parametrize("flags", [(), ("--overwrite",)], ids=["", "overwrite"])
def test_a_dry_run_writes_only_the_config_json_its_command_reads(command, before, flags, tmp_path, capsys):
    """No .lock, nothing else; the config.json that the printed command names holds this launch's options, also
    where an earlier dry run wrote one (a config.json alone: no run's work beside it), with or without
    --overwrite."""
    run_dir = tmp_path / "run"
    if before != "none":
        run_dir.mkdir()
    if before == "a dry run's config.json":
        assert dry_run(command, run_dir, capsys=capsys, steps=6)[0] == 0
    code, out, err = dry_run(command, run_dir, *flags, capsys=capsys)
    assert code == 0, err
    assert printed_config(out) == str(run_dir / "config.json")
    assert sorted(os.listdir(run_dir)) == ["config.json"]
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 3


def an_earlier_run(run_dir, *, finished: bool, checkpoint: bool):
    """A run dir as a launch of `--steps 6 --checkpoint-every 3` leaves it (stopped at step 3 unless `finished`),
    its checkpoints as a run writes them; its lock file holds the pid of the launch that wrote it."""
    from ddp_amp.checkpoint.storage import save_checkpoint

    files = {"config.toml": b"steps = 6\n", "metrics.jsonl": b'{"step": 3, "loss": 1.0}\n', ".lock": b"4242\n",
             "summary.json": b'{"outcome": "finished"}\n' if finished else b'{"stopped_at_step": 3}\n',
             "logs/rank0.log": b"step 3\n", "logs/agent.log": b"INFO agent\n"}
    if finished:
        files.update({"model.pt": b"earlier weights", "model.pt.checksum": b'{"sha256": "0"}\n'})
    ddp_amps_run_dir(run_dir, files)
    (run_dir / "config.json").write_text(json.dumps({"launch_time": 1.0, "run_dir": str(run_dir), "steps": 6}))
    for step in (3, 6) if checkpoint else ():
        if step == 3 or finished:
            save_checkpoint(run_dir, {"step": step, "trainer": {"model": {"weight": torch.zeros(1, 8)}}, "rng": [],
                                      "world_size": 2, "config": {}, "saved_at": 1000.0 + step}, keep=5)
    return run_dir


EARLIER = {
    "--overwrite, finished": (("--overwrite",), {"finished": True, "checkpoint": True}),
    "--overwrite, stopped": (("--overwrite",), {"finished": False, "checkpoint": True}),
    "--resume auto": (("--resume", "auto"), {"finished": False, "checkpoint": True}),
    "--resume PATH": (("--resume", "{run_dir}/checkpoints/step-3.pt"), {"finished": False, "checkpoint": True}),
    "--resume auto, no checkpoint": (("--resume", "auto"), {"finished": False, "checkpoint": False}),
}


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize(("flags", "earlier"), EARLIER.values(), ids=EARLIER)
def test_a_dry_run_over_an_earlier_run_leaves_it_exactly_as_it_was(command, flags, earlier, tmp_path, capsys):
    """A launch sets the earlier run's files aside before it writes its config.json (--overwrite: all of them;
    --resume: the stopped attempt's record; --resume auto without a checkpoint starts over). A dry run never
    does, and the command it prints cannot (run by hand, it would train into the earlier run's files): one line,
    exit 2, nothing printed, every file of the earlier run the same file with the same bytes, nothing added."""
    run_dir = an_earlier_run(tmp_path / "run", **earlier)
    before = everything_in(run_dir)
    code, out, err = dry_run(command, run_dir, *(flag.format(run_dir=run_dir) for flag in flags), capsys=capsys)
    said, line = err.splitlines()[:-1], one_line(err.splitlines()[-1])
    assert code == 2 and out == ""
    assert said == []  # not even "--resume auto: ... starting from the beginning": nothing starts
    assert line.startswith(f"ddp-amp: error: --dry-run: --run-dir '{run_dir}' holds "), line
    assert "config.json" in line and "launch without --dry-run" in line
    assert everything_in(run_dir) == before


@pytest.mark.parametrize("command", COMMANDS)
def test_a_dry_run_without_a_flag_is_refused_over_an_earlier_run_as_a_launch_is(command, tmp_path, capsys):
    run_dir = an_earlier_run(tmp_path / "run", finished=False, checkpoint=True)
    before = everything_in(run_dir)
    code, out, err = dry_run(command, run_dir, capsys=capsys)
    assert code == 2 and out == ""
    assert "holds an earlier run (metrics.jsonl, summary.json, checkpoints/); continue it with --resume auto" in \
        one_line(err)
    assert everything_in(run_dir) == before


def test_a_dry_run_takes_no_lock_and_is_refused_while_a_launch_holds_one(tmp_path, capsys):
    """It only looks at the lock: while a launch holds the run dir, a dry run says so (its config.json would
    replace the running launch's, which torchrun's restarts read again); once the launch has ended, it writes its
    config.json and leaves the lock file as the launch left it."""
    run_dir = ddp_amps_run_dir(tmp_path / "run")
    held = DirectoryLock(run_dir)
    before = everything_in(run_dir)
    try:
        code, out, err = dry_run("run", run_dir, capsys=capsys)
    finally:
        held.release()
    assert code == 2 and out == ""
    assert one_line(err) == (f"ddp-amp: error: --run-dir '{run_dir}' is in use by another ddp-amp launch (pid "
                             f"{os.getpid()}); wait for it to end or choose another directory")
    assert everything_in(run_dir) == before
    code, out, err = dry_run("run", run_dir, capsys=capsys)
    assert code == 0, err
    assert everything_in(run_dir)[".lock"] == before[".lock"]  # the same bytes, never written again
    assert json.loads((run_dir / "config.json").read_text())["steps"] == 3


@pytest.mark.parametrize("command", COMMANDS)
@pytest.mark.parametrize("before", ["none", "an earlier run"])
def test_a_scripts_dry_run_writes_nothing(command, before, tmp_path, capsys):
    """The printed command runs the script itself and reads no config.json: nothing is written, under --overwrite
    into an earlier run too (the run dir's checks are a launch's, not a dry run's)."""
    run_dir = tmp_path / "run"
    if before != "none":
        an_earlier_run(run_dir, finished=True, checkpoint=True)
    state = everything_in(run_dir) if run_dir.exists() else None
    code, out, err = run_main([*COMMANDS[command], "--overwrite", "--dry-run", "--run-dir", str(run_dir),
                               str(CHECKS_SCRIPT), "--steps", "3"], capsys)
    assert code == 0, err
    assert out.splitlines()[0].endswith(f" {CHECKS_SCRIPT} --steps 3") and len(out.splitlines()) == 1
    assert (everything_in(run_dir) if run_dir.exists() else None) == state
