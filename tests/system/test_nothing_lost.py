"""Nothing lost, whatever runs: launched with --overwrite into a run dir that holds a finished earlier run (of
ddp-amp's own loop, of a plain script, of a ddp_amp.loop script), a launch of each kind that fails before it
trained, fails after, is stopped by SIGTERM, or finishes, leaves the earlier run's files byte for byte as they
were unless it trained. Real 2-rank launches; what is refused before launch (no flag, --resume into a finished
run, files ddp-amp did not write) is in tests/unit/test_run_dir_rules.py."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import CHECKS_SCRIPT, HELPER_TASKS, TASKS, launch, launch_script, read_summary

pytestmark = pytest.mark.slow
LOOP_SCRIPT = TASKS / "loop_fails.py"
TASK_OPTIONS = ["--device", "cpu", "--amp", "off", "--log-every", "1", "--checkpoint-every", "2",
                "--no-async-checkpoint"]
KINDS = ("task", "script", "loop")
OUTCOMES = ("fails before training", "fails after training", "stopped", "finished")

# What each kind of launch runs for each outcome: ddp-amp's options before the script (or the task's), the
# script's arguments, and for a stop, the file whose appearance says the ranks are training.
LAUNCHES = {
    ("task", "fails before training"): ([*TASK_OPTIONS, "--task", f"{HELPER_TASKS}:fail_on_rank1_at_first_step",
                                         "--steps", "4"], None, None),
    ("task", "fails after training"): ([*TASK_OPTIONS, "--task", f"{HELPER_TASKS}:fail_on_rank1", "--steps", "20"],
                                       None, None),
    ("task", "stopped"): ([*TASK_OPTIONS, "--task", "linear", "--steps", "100000"], None, "metrics.jsonl"),
    ("task", "finished"): ([*TASK_OPTIONS, "--task", "linear", "--steps", "4"], None, None),
    ("script", "fails before training"): ([], ["--fail-rank", "1", "--fail-step", "0"], None),
    ("script", "fails after training"): ([], ["--fail-rank", "1", "--fail-step", "3", "--steps", "10"], None),
    ("script", "stopped"): ([], ["--steps", "100000", "--step-s", "0.05"], "logs/rank0.log"),
    ("script", "finished"): ([], ["--steps", "3"], None),
    ("loop", "fails before training"): ([], ["--fail-at", "0"], None),
    ("loop", "fails after training"): ([], ["--fail-at", "5", "--steps", "10"], None),
    ("loop", "stopped"): ([], ["--steps", "100000", "--step-s", "0.02"], "metrics.jsonl"),
    ("loop", "finished"): ([], ["--steps", "6"], None),
}
TRAINS = {("task", "fails after training"), ("task", "stopped"), ("task", "finished"), ("script", "finished"),
          ("loop", "fails after training"), ("loop", "stopped"), ("loop", "finished")}
"""A plain script trains, as ddp-amp sees it, when it finishes: one that failed or was stopped and wrote nothing
of training into the run dir (metrics, checkpoints, model.pt, loop.json) gets the earlier run back."""


@pytest.fixture(scope="module")
def earlier_runs(tmp_path_factory):
    """A finished run of each kind, each launched for real once."""
    root = tmp_path_factory.mktemp("earlier")
    done = {
        "task": launch(root / "task", *TASK_OPTIONS, "--task", "linear", "--steps", "4"),
        "script": launch_script(root / "script", CHECKS_SCRIPT, "--steps", "2"),
        "loop": launch_script(root / "loop", LOOP_SCRIPT, "--steps", "4"),
    }
    for kind, result in done.items():
        assert result.returncode == 0, (kind, result.stderr)
    return root


def files_of(run_dir: Path) -> dict[str, tuple[bytes, int]]:
    """Every file's bytes and inode: a file put back is the same file (renamed back), one that was replaced is
    not, even where a deterministic run wrote the same bytes again."""
    return {str(path.relative_to(run_dir)): (path.read_bytes(), path.stat().st_ino)
            for path in sorted(run_dir.rglob("*")) if path.is_file() and path.name != ".lock"}


def run_to_outcome(kind: str, outcome: str, run_dir: Path, flag: tuple[str, ...] = ("--overwrite",)
                   ) -> subprocess.CompletedProcess:
    """The launch, with `flag`, as a user types it; a stop is SIGTERM to the launcher once it trains."""
    options, script_args, ready = LAUNCHES[kind, outcome]
    command = [sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--log-format", "plain", *flag, *options,
               "--run-dir", str(run_dir)]
    if kind != "task":
        command += [str(CHECKS_SCRIPT if kind == "script" else LOOP_SCRIPT), *script_args]
    # this launch's output, not an earlier run's: the file grows past the size it had (a resumed run's logs)
    size_before = (run_dir / ready).stat().st_size if ready is not None and (run_dir / ready).is_file() else 0
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    try:
        if ready is not None:
            deadline = time.monotonic() + 120
            while not ((run_dir / ready).is_file() and (run_dir / ready).stat().st_size > size_before):
                assert process.poll() is None and time.monotonic() < deadline, process.communicate()
                time.sleep(0.1)
            process.send_signal(signal.SIGTERM)
        out, err = process.communicate(timeout=180)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return subprocess.CompletedProcess(command, process.returncode, out, err)


CASES = [(kind, outcome, KINDS[(k + o) % 3]) for k, kind in enumerate(KINDS) for o, outcome in enumerate(OUTCOMES)]
"""Each kind of launch with each outcome, into an earlier run of each kind in turn: every kind of launch meets
every kind of earlier run, and so does every outcome."""


@pytest.mark.parametrize(("kind", "outcome", "earlier"), CASES,
                         ids=[f"{kind}-{outcome.replace(' ', '-')}-over-{earlier}" for kind, outcome, earlier in CASES])
def test_overwrite_takes_the_earlier_run_only_from_a_launch_that_trained(kind, outcome, earlier, earlier_runs,
                                                                         tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(earlier_runs / earlier, run_dir)
    before = files_of(run_dir)
    result = run_to_outcome(kind, outcome, run_dir)
    expected_code = {"finished": 0, "stopped": 128 + signal.SIGTERM}.get(outcome, 1)
    assert result.returncode == expected_code, result.stderr
    after = files_of(run_dir)
    assert not (run_dir / ".overwritten").exists()
    if (kind, outcome) in TRAINS:
        assert "back as they were" not in result.stderr
        assert after.get("summary.json") != before["summary.json"]  # this launch's record, or none
        survived = [name for name in before if after.get(name) == before[name]]
        assert not survived, f"{survived}: the earlier run's, kept by a launch that trained under --overwrite"
    else:
        assert f"the earlier run's files in {run_dir} are back as they were" in result.stderr, result.stderr
        assert {name: after.get(name) for name in before} == before
        assert (run_dir / ".failed-launch" / "config.json").is_file()  # this launch's own files, set aside


@pytest.mark.skipif(os.geteuid() != 0, reason="mounts a small tmpfs: root only")
def test_a_full_disk_is_one_line_naming_the_file_and_the_checkpoint_that_resumes(tmp_path):
    """A loop script whose run dir fills up mid-run (a 400 KiB tmpfs): the launcher ends on one line naming the
    file that did not fit and the newest complete checkpoint, no chained traceback of ddp-amp's own writes (the
    flight record, the logs, summary.json) and no launcher traceback; that checkpoint, moved to a disk with room,
    resumes to the end."""
    small = tmp_path / "small"
    small.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=400k", "tmpfs", str(small)], check=True)
    try:
        result = subprocess.run([sys.executable, "-m", "ddp_amp", "spawn", "-n", "2", "--log-format", "plain",
                                 "--checkpoint-every", "5", "--keep", "50", "--run-dir", str(small / "run"),
                                 str(TASKS.parent.parent / "examples" / "own_loop.py"), "--steps", "300"],
                                capture_output=True, text=True, timeout=300)
        assert result.returncode == 1, result.stderr
        verdict = result.stderr.strip().splitlines()[-1]
        assert "No space left on device: '" in verdict and "; the newest complete checkpoint is " in verdict, verdict
        assert "During handling of the above exception" not in result.stderr, result.stderr
        assert "ddp_amp/cli.py" not in result.stderr and "flight_recorder" not in result.stderr, result.stderr
        kept = Path(verdict.split("the newest complete checkpoint is ")[1].split(" (continue")[0])
        shutil.copytree(small / "run", tmp_path / "roomy")
    finally:
        subprocess.run(["umount", str(small)], check=True)
    resumed = launch_script(tmp_path / "roomy", TASKS.parent.parent / "examples" / "own_loop.py", "--steps", "300",
                            options=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert read_summary(tmp_path / "roomy")["loop"]["resumed_from_step"] == int(kept.stem.split("-")[1])


RESUMED = [(kind, outcome) for kind in KINDS for outcome in OUTCOMES]


@pytest.mark.parametrize(("kind", "outcome"), RESUMED,
                         ids=[f"{kind}-{outcome.replace(' ', '-')}" for kind, outcome in RESUMED])
def test_resume_auto_continues_a_scripts_run_only_when_the_launch_trained(kind, outcome, earlier_runs, tmp_path):
    """--resume auto into a plain script's finished run (the one kind of finished run it continues: no model.pt;
    into the others it is refused before launch, tests/unit/test_run_dir_rules.py). A launch that did not train
    leaves every earlier file as it was, the logs it appended to cut back; one that trained continued the run:
    its record is this launch's. (ddp-amp's loop finds no checkpoint there and starts over, as --overwrite.)"""
    run_dir = tmp_path / "run"
    shutil.copytree(earlier_runs / "script", run_dir)
    before = {name: data for name, (data, _) in files_of(run_dir).items()}
    result = run_to_outcome(kind, outcome, run_dir, flag=("--resume", "auto"))
    expected_code = {"finished": 0, "stopped": 128 + signal.SIGTERM}.get(outcome, 1)
    assert result.returncode == expected_code, result.stderr
    after = {name: data for name, (data, _) in files_of(run_dir).items()}
    if (kind, outcome) in TRAINS:
        assert after.get("summary.json") != before["summary.json"]
    else:
        assert {name: after.get(name) for name in before} == before, result.stderr
