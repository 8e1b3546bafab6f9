"""The run dir's rules, the same for every launch kind (ddp-amp's loop with a task, a plain script, a
ddp_amp.loop script), decided before anything starts (in-process, through the CLI's own main): an earlier run
needs --resume or --overwrite; files ddp-amp did not write are never replaced; a -m target's code never runs in
the launcher. What a launch that got past these does to an earlier run is tests/system/test_nothing_lost.py."""

import os

import pytest
from helpers import CHECKS_SCRIPT, TASKS, ddp_amps_run_dir, run_main

LOOP_SCRIPT = TASKS / "loop_fails.py"
NEW = {"task": ["--device", "cpu", "--task", "linear", "--steps", "3"],
       "script": [str(CHECKS_SCRIPT), "--steps", "3"],
       "loop": [str(LOOP_SCRIPT), "--steps", "3"]}
"""A launch of each kind: its words after `spawn -n 2 --run-dir DIR [FLAG]` (a script's options come first)."""


def earlier_run(kind: str, run_dir):
    """A finished earlier run of `kind`, as its launch leaves it."""
    files = {"summary.json": b'{"outcome": "finished"}\n', "logs/rank0.log": b"step 1\n"}
    if kind != "script":
        files.update({"model.pt": b"weights", "metrics.jsonl": b'{"step": 2, "loss": 1.0}\n'})
    if kind == "loop":
        files["loop.json"] = b'{"last_reported_step": 2}\n'
    return ddp_amps_run_dir(run_dir, files)


def snapshot(run_dir) -> dict[str, bytes]:
    return {str(path.relative_to(run_dir)): path.read_bytes() for path in sorted(run_dir.rglob("*"))
            if path.is_file()}


@pytest.fixture
def launched(monkeypatch):
    started = []
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: started.append(launch))
    return started


@pytest.mark.parametrize("flag", [[], ["--resume", "auto"]], ids=["no-flag", "resume-auto"])
@pytest.mark.parametrize("earlier", ["task", "script", "loop"])
@pytest.mark.parametrize("new", ["task", "script", "loop"])
def test_an_earlier_run_is_continued_only_when_asked_and_never_replaced_by_a_refusal(new, earlier, flag, tmp_path,
                                                                                     capsys, launched):
    """No flag: refused for every pair, the earlier run's files byte for byte. --resume auto: refused into a
    finished run (model.pt) of any kind; a plain script's finished run (its record, no model.pt) is continued."""
    run_dir = earlier_run(earlier, tmp_path / "run")
    before = snapshot(run_dir)
    words = NEW[new]
    options, rest = (words, []) if new == "task" else (flag and [], words)
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(run_dir), *flag, *options, *rest], capsys)
    if flag and earlier == "script":
        assert code == 0 and len(launched) == 1, err
        return
    assert code == 2 and not launched
    lines = err.strip().splitlines()
    if flag:
        assert len(lines) == 1 and lines[0].startswith("ddp-amp: error: ") and \
            "holds a finished run (model.pt)" in lines[0], err
    else:
        assert len(lines) == 1, err
        finished = "already holds a finished run (model.pt); choose another or pass --overwrite"
        unfinished = "holds an earlier run (summary.json); continue it with --resume auto, start over in it with " \
                     "--overwrite, or choose another directory"
        assert lines[0] == f"ddp-amp: error: --run-dir {str(run_dir)!r} " + (
            unfinished if earlier == "script" else finished)
    assert snapshot(run_dir) == before


@pytest.mark.parametrize("new", ["task", "script", "loop"])
@pytest.mark.parametrize("flag", [[], ["--overwrite"]], ids=["no-flag", "overwrite"])
@pytest.mark.parametrize(("users", "names"), [
    ({"config.json": b'{"lr": 0.1}\n'}, "config.json"),
    ({"model.pt": b"my weights", "logs/today.txt": b"notes"}, "model.pt, logs/"),
    ({".lock": b"held by my tool"}, ".lock"),
], ids=["config", "weights-and-logs", "lock"])
def test_files_ddp_amp_did_not_write_are_never_replaced(users, names, flag, new, tmp_path, capsys, launched,
                                                        monkeypatch):
    """`--run-dir .` in a project folder, or a run dir holding a script's own config.json: refused in one line
    naming the files, --overwrite or not; every file as it was, nothing launched."""
    monkeypatch.chdir(tmp_path)
    for name, data in users.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "train.py").write_text("print('mine')\n")
    before = snapshot(tmp_path)
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", ".", *flag, *NEW[new]], capsys)
    assert code == 2 and not launched
    assert err.strip().splitlines() == [
        f"ddp-amp: error: --run-dir '.' holds {names}, which ddp-amp did not write (no config.json of ddp-amp's "
        "beside them) and would replace; choose another directory"], err
    assert snapshot(tmp_path) == before


def test_a_lock_left_by_a_killed_launch_is_not_taken_for_a_users_file(tmp_path, capsys, launched):
    """A launch killed after it locked the run dir and before its config.json leaves .lock (its pid) alone."""
    (tmp_path / ".lock").write_text("4242\n")
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(tmp_path), *NEW["script"]], capsys)
    assert code == 0 and len(launched) == 1, err


@pytest.mark.parametrize("effect", ["open('ran-in-the-launcher', 'w').write('x')", "import sys; sys.exit(5)",
                                    "raise RuntimeError('an __init__ that fails')"])
def test_a_module_is_found_without_running_its_packages_init_in_the_launcher(effect, tmp_path, capsys, launched,
                                                                               monkeypatch):
    """-m pkg.train and -m pkg: the package's __init__ (which python -m runs first, in the ranks) is not run to
    find the module: no file written, no exit 5, no traceback; the launch goes ahead."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text(effect + "\n")
    (tmp_path / "pkg" / "train.py").write_text("print('training')\n")
    (tmp_path / "pkg" / "__main__.py").write_text("print('training')\n")
    for target in ("pkg.train", "pkg"):
        code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(tmp_path / target), "-m", target], capsys)
        assert code == 0, err
    assert len(launched) == 2 and not (tmp_path / "ran-in-the-launcher").exists()
    assert "pkg" not in __import__("sys").modules


@pytest.mark.parametrize(("files", "args", "line"), [
    ({"pkg/__init__.py": "", "pkg/train.py": "def main(:\n"}, ["-m", "pkg.train"],
     "-m pkg.train: {cwd}/pkg/train.py:1: SyntaxError: invalid syntax"),
    ({"pkg/__init__.py": "x = (\n", "pkg/train.py": ""}, ["-m", "pkg.train"],
     "-m pkg.train: {cwd}/pkg/__init__.py:1: SyntaxError: '(' was never closed"),
    ({"train.py": "print(1)\n"}, ["-m", "train.py"],
     "-m train.py: -m takes a module's dotted name, train.py is a file; run the file without -m (ddp-amp run -n 2 "
     "train.py) or give its module (-m train)"),
    ({"train.py": "print(1)\n"}, ["python", "train.py"],
     "script 'python': ddp-amp runs the script with Python itself, as torchrun does; drop 'python' (ddp-amp run "
     "-n 2 train.py, or -m package.module)"),
    ({"weights.py": b"\x00\x01binary"}, ["weights.py"],
     "script 'weights.py' is not Python source: it holds NUL bytes (a binary file?)"),
    ({}, ["--resume", "nosuch.pt", str(LOOP_SCRIPT)], "--resume nosuch.pt: no such checkpoint"),
], ids=["module-syntax", "parent-syntax", "module-dot-py", "python-first", "nul-bytes", "resume-missing"])
def test_what_cannot_run_is_one_line_before_launch_for_a_module_as_for_a_file(files, args, line, tmp_path, capsys,
                                                                              launched, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(text if isinstance(text, bytes) else text.encode())
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2 and not launched
    assert err.strip().splitlines() == ["ddp-amp: error: " + line.format(cwd=tmp_path)]
    assert not (tmp_path / "run").exists()


def test_a_fifo_given_as_the_script_is_refused_without_reading_it(tmp_path, capsys, launched):
    """Reading a FIFO would wait for a writer forever: refused from its type alone."""
    fifo = tmp_path / "train.py"
    os.mkfifo(fifo)
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(tmp_path / "run"), str(fifo)], capsys)
    assert code == 2 and not launched
    assert err.strip() == f"ddp-amp: error: script {str(fifo)!r} is not a regular file (a pipe or a device); give " \
                          "the training script's file"


def test_a_plain_scripts_bf16_true_refusal_suggests_nothing_it_would_refuse(tmp_path, capsys, launched):
    code, _, err = run_main(["spawn", "-n", "2", "--dtype", "bf16-true", "--run-dir", str(tmp_path / "run"),
                             str(CHECKS_SCRIPT)], capsys)
    assert code == 2 and "--dtype bf16 " not in err and "ddp-amp's own loop with --task" in err, err


def test_outside_ddp_amp_a_loop_continues_an_earlier_run_only_when_asked(tmp_path, monkeypatch):
    """Under plain torchrun or python the loop applies the launcher's rule itself: setup() into a run dir with an
    earlier run's metrics refuses in one line unless resume is given or torchrun's agent restarted the ranks."""
    from ddp_amp import loop

    for name in ("DDP_AMP_RUN_DIR", "TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    run_dir = earlier_run("loop", tmp_path / "run")
    with pytest.raises(loop.LoopError) as refused:
        loop.setup(run_dir=str(run_dir))
    assert str(refused.value) == (f"setup(): {run_dir} holds an earlier run (metrics.jsonl, summary.json, loop.json); "
                                  "continue it with setup(resume='auto'), or give another run_dir (setup(run_dir=...))")
    from ddp_amp.loop.settings import LoopSettings

    LoopSettings.resolve({"run_dir": str(run_dir), "resume": "auto"}).check_run_dir()  # asked: no refusal
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    LoopSettings.resolve({"run_dir": str(run_dir)}).check_run_dir()  # a restart continues
