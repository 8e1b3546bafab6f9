"""ddp_amp.loop, the calls that give a script's own loop what ddp-amp's loop has: real 2-rank gloo runs of
examples/own_loop.py (a GAN: two models, two optimizers, two schedulers) and of the loop scripts in tests/tasks,
launched by ddp-amp, by plain torchrun and as one `python` process; a real SIGTERM to the launcher."""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from helpers import (
    MARK_VAR,
    TASKS,
    TESTS,
    free_port,
    last_line,
    launch_script,
    launch_until,
    read_summary,
    run_processes,
)

pytestmark = pytest.mark.slow
EXAMPLE = TESTS.parent / "examples" / "own_loop.py"
STEPS = "300"
"""Long enough (about 5 s on 2 cores) that the stop below, sent at step 10, lands well before the end."""


def weights_equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[m][k], b[m][k]) for m in a for k in a[m])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    result = launch_script(run, EXAMPLE, "--steps", STEPS)
    assert result.returncode == 0, result.stderr
    return torch.load(run / "model.pt", weights_only=True)


def stopped_at_step_10_or_later(run, options=()) -> subprocess.CompletedProcess:
    """The example launched with progress at every step, SIGTERM to the launcher once rank 0 reported step 10."""
    return launch_until(run, "--log-format", "plain", "--log-every", "1", *options, str(EXAMPLE), "--steps", STEPS,
                        until=10)


@pytest.mark.parametrize("options", [(), ("--checkpoint-format", "sharded"),
                                     ("--checkpoint-format", "sharded", "--no-async-checkpoint")],
                         ids=["single-async", "sharded-async", "sharded-sync"])
def test_a_stop_saves_every_rank_at_one_step_and_the_resume_ends_on_the_uninterrupted_weights(tmp_path, options,
                                                                                            uninterrupted):
    """SIGTERM to the launcher: exit 143, both ranks' last report at the step the loop says it stopped at, a
    checkpoint there (in the format asked for, written in the background or not), no model.pt. `--resume auto`:
    both models' weights bit for bit the uninterrupted run's (whose checkpoints were single files), and
    metrics.jsonl holds each step once."""
    run = tmp_path / "run"
    stopped = stopped_at_step_10_or_later(run, options)
    assert stopped.returncode == 143, stopped.stderr
    stopped_summary = read_summary(run)
    loop = stopped_summary["loop"]
    step = loop["stopped_at_step"]
    assert loop["stopped_by"] == "SIGTERM" and 10 <= step < int(STEPS)
    for rank in (0, 1):
        reported = [int(line.split()[3]) for line in stopped.stdout.splitlines()
                    if line.startswith(f"[rank {rank}] step ")]
        assert reported[-1] == step, stopped.stdout[-2000:]
    if "sharded" in options:  # a DCP directory, every rank's part in it; the extras and RNG states beside them
        saved = torch.load(run / "checkpoints" / f"step-{step}" / "extras.pt", weights_only=True)
        assert (run / "checkpoints" / f"step-{step}" / ".metadata").is_file()
        assert loop["checkpoint"] == str(run / "checkpoints" / f"step-{step}")
    else:
        saved = torch.load(run / "checkpoints" / f"step-{step}.pt", weights_only=True)
    assert saved["step"] == step and len(saved["rng"]) == 2  # every rank's random state
    assert not (run / "model.pt").exists()
    # the stop line says what the built-in loop's says: the step, the checkpoint, how to continue
    assert last_line(stopped.stderr) == (f"ddp-amp: error: stopped by SIGTERM at step {step}; checkpoint "
                                         f"{loop['checkpoint']} (continue with --resume auto --run-dir {run})")
    relaunched = launch_script(run, EXAMPLE, "--steps", STEPS)  # --resume auto forgotten: refused, nothing changed
    assert relaunched.returncode == 2 and "holds an earlier run" in last_line(relaunched.stderr)
    assert Path(loop["checkpoint"]).exists() and read_summary(run)["loop"] == loop
    resumed = launch_script(run, EXAMPLE, "--steps", STEPS, options=("--resume", "auto", *options))
    assert resumed.returncode == 0, resumed.stderr
    resumed_summary = read_summary(run)
    assert resumed_summary["loop"]["resumed_from_step"] == step
    # the run's wall time counts both launches, its own wall_s the last one
    assert resumed_summary["launches"] == 2 and resumed_summary["wall_s_all_launches"] == round(
        stopped_summary["wall_s"] + resumed_summary["wall_s"], 3)
    assert weights_equal(torch.load(run / "model.pt", weights_only=True), uninterrupted)
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == int(STEPS)


def test_plain_torchrun_runs_the_same_script_to_the_same_weights_and_python_runs_it_alone(tmp_path, uninterrupted):
    """The script unchanged under `torchrun --standalone --nproc-per-node 2`: ddp-amp's weights. As `python
    script.py`: one process, its run directory where it runs."""
    torchrun = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(EXAMPLE), "--steps", STEPS], capture_output=True, text=True, timeout=300,
                              cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path)})  # torchrun's log dir
    assert torchrun.returncode == 0, torchrun.stderr
    assert weights_equal(torch.load(tmp_path / "ddp-amp-loop" / "model.pt", weights_only=True), uninterrupted)
    alone = tmp_path / "alone"
    alone.mkdir()
    python = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "20"], capture_output=True, text=True,
                            timeout=300, cwd=alone)
    assert python.returncode == 0, python.stderr
    record = json.loads((alone / "ddp-amp-loop" / "loop.json").read_text())
    assert record["world_size"] == 1 and record["last_reported_step"] == 20
    assert set(torch.load(alone / "ddp-amp-loop" / "model.pt", weights_only=True)) == {"generator", "discriminator"}


@pytest.mark.parametrize("api", ["accumulate", "autocast"])
def test_an_fp16_overflow_skips_the_step_and_the_schedule_together(tmp_path, api):
    """`--amp on --dtype fp16` on CPU ranks, --grad-accum 2: the step whose loss is infinite is skipped on both
    ranks, its weights unchanged, its schedule not advanced, the loss scale halved; the others step and advance.
    DDP all-reduces once per step (5), not per micro-step: the first micro-step of each step ran under no_sync,
    chosen by accumulate(model), or by autocast(model) in a loop written for earlier versions."""
    out = tmp_path / "steps.json"
    result = launch_script(tmp_path / "run", TASKS / "loop_checks.py", "--out", str(out), "--api", api,
                           options=("--amp", "on", "--dtype", "fp16", "--grad-accum", "2"))
    assert result.returncode == 0, result.stderr
    found = json.loads(out.read_text())
    assert found["precision"] == "fp16" and found["allreduces"] == 5
    steps, lr = found["steps"], 0.1
    for number, step in enumerate(steps, start=1):
        assert step["moved"] == step["stepped"]
        lr = lr / 2 if step["stepped"] else lr
        assert step["lr"] == pytest.approx(lr), (number, steps)
    third = steps[2]
    assert not third["stepped"] and third["scale"] == steps[1]["scale"] / 2
    assert steps[3]["stepped"] and steps[4]["stepped"]
    assert found["skipped"] == sum(not step["stepped"] for step in steps)
    assert read_summary(tmp_path / "run")["loop"]["grad_accum"] == 2


def test_the_origin_example_skips_an_overflowing_fp16_step_with_both_its_schedules(tmp_path):
    """examples/origin_loop.py itself (the origin example: SGD, ExponentialLR and CosineAnnealingLR stepped back
    to back), `--amp on --dtype fp16` on CPU ranks, its loss forced to inf at epoch 3 from outside: that step is
    skipped on both ranks with the weights, the rate and both schedules' positions unchanged and the loss scale
    halved; every other step moves the weights and advances both schedules, as the core's step does."""
    out = tmp_path / "steps.json"
    result = launch_script(tmp_path / "run", TASKS / "origin_loop_overflow.py", "--out", str(out),
                           options=("--amp", "on", "--dtype", "fp16"))
    assert result.returncode == 0, result.stderr
    found = json.loads(out.read_text())
    steps = found["steps"]
    assert found["precision"] == "fp16" and len(steps) == 6
    assert not steps[2]["stepped"] and steps[2]["scale"] == steps[1]["scale"] / 2
    assert steps[2]["lr"] == steps[1]["lr"] and steps[2]["positions"] == steps[1]["positions"]
    stepped = 0
    for step in steps:
        stepped += step["stepped"]
        assert step["moved"] == step["stepped"] and step["positions"] == [stepped, stepped], steps
    assert stepped >= 4 and found["skipped"] == 6 - stepped
    assert steps[5]["lr"] < steps[1]["lr"]


def test_wrong_calls_are_one_line_each_and_a_checkpoint_of_another_model_is_not_touched(tmp_path):
    out, run = tmp_path / "errors.json", tmp_path / "run"
    result = subprocess.run([sys.executable, str(TASKS / "loop_misuse.py"), "--out", str(out), "--run-dir", str(run)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    errors = json.loads(out.read_text())
    checkpoint = run / "checkpoints" / "step-2.pt"
    assert errors[:6] == [
        "step(): an optimizer that prepare() did not return; use the one it returned",
        "backward(): with --grad-accum 2, run each micro-step inside `for batch in run.accumulate(model, data):` "
        "(only the last all-reduces the gradients)",
        "step(): after 1 backward pass of its model, and --grad-accum is 2: the gradients are not reduced yet",
        "restore(): steps=int has no state_dict()/load_state_dict() to save and load",
        "prepare(): an optimizer trains parameters that are not the model's; prepare each model with the "
        "optimizers of its own parameters",
        "save(): nothing to save; register the state with restore(model=..., optimizer=...) first"]
    assert errors[6].startswith(f"--resume {checkpoint}: its model does not fit the model given for it: ")
    assert "size mismatch for weight" in errors[6] and "\n" not in errors[6]
    assert errors[7:9] == [
        f"steps(): --{name} and no state to {what}; give steps() the state by name (steps(total, model=model, "
        "optimizer=optimizer, ...)), or call restore(...) before it"
        for name, what in (("resume auto", "resume"), ("checkpoint-every 2", "checkpoint"))]
    assert errors[9] == ("prepare(): the model has no parameter to train (every one frozen, or none); a model "
                         "that only runs forward needs no prepare(): move it with .to(run.device)")
    assert errors[10] == "finish(): called a second time; call it once, after the loop"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step-2.json", "step-2.pt"]
    assert torch.load(checkpoint, weights_only=True)["trainer"]["model"]["weight"].shape == (3, 4)


def _sharded_loop(run, mode: str) -> dict:
    """The example for 30 steps under `--shard mode`, its record checked: its weights."""
    result = launch_script(run, EXAMPLE, "--steps", "30", options=("--shard", mode, "--checkpoint-every", "15"))
    assert result.returncode == 0, result.stderr
    record = read_summary(run)["loop"]
    assert record["shard"] == mode
    assert record["models"] == 2 * [{"none": "DistributedDataParallel", "optimizer": "DistributedDataParallel",
                                     "full": "FSDPSequential"}[mode]]
    assert record["optimizers"] == ({"optimizer": 2 * ["ZeroRedundancyOptimizer"]}.get(mode, ["AdamW", "Adam"]))
    assert (run / "checkpoints" / "step-30.pt").exists()
    return torch.load(run / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def unsharded_loop(tmp_path_factory) -> dict:
    """_sharded_loop under `--shard none` (DDP), launched once for both modes' comparisons."""
    return _sharded_loop(tmp_path_factory.mktemp("unsharded") / "none", "none")


@pytest.mark.parametrize("shard", ["optimizer", "full"])
def test_the_loop_under_shard_trains_as_under_ddp(shard, tmp_path, unsharded_loop):
    """`--shard optimizer`: prepare() rebuilds each optimizer as a ZeroRedundancyOptimizer, whose step is DDP's
    bit for bit (as in the core). `--shard full`: the models sharded by FSDP2 and their optimizers rebuilt over the
    shards; the weights DDP's within float rounding (its reduce-scatter sums in another order). Both checkpoint
    and finish as under DDP; loop.json names the mode."""
    runs = {"none": unsharded_loop, shard: _sharded_loop(tmp_path / shard, shard)}
    if shard == "optimizer":
        assert weights_equal(runs[shard], runs["none"])
    else:
        for model in runs["none"]:
            for key, expected in runs["none"][model].items():
                torch.testing.assert_close(runs[shard][model][key], expected, rtol=1e-4, atol=1e-5)


def test_report_writes_tensorboard_scalars_with_tensorboard(tmp_path):
    """`--tensorboard --log-every 5` before a loop script: rank 0's report() values as report/<name> scalars at
    steps 5, 10, 15, 20, equal to metrics.jsonl's."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = tmp_path / "run"
    result = launch_script(run, EXAMPLE.parent / "origin_loop.py", "--epochs", "20",
                           options=("--tensorboard", "--log-every", "5"))
    assert result.returncode == 0, result.stderr
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    scalars = [(event.step, event.value) for event in events.Scalars("report/loss")]
    logged = [(record["step"], record["loss"]) for record in map(json.loads, (run / "metrics.jsonl").read_text()
                                                                .splitlines())]
    assert [step for step, _ in scalars] == [5, 10, 15, 20] == [step for step, _ in logged]
    assert [value for _, value in scalars] == pytest.approx([value for _, value in logged], rel=1e-6)


LOOP_FAILS = TASKS / "loop_fails.py"
FP16 = ("--amp", "on", "--dtype", "fp16")


def test_accumulating_half_batches_in_a_users_loop_ends_on_the_whole_batchs_weights(tmp_path):
    """--grad-accum 2 over the two halves of each rank's batch of 8, against --grad-accum 1 over the whole: the
    same weights within float rounding (backward divides each micro-step's loss by --grad-accum)."""
    whole = launch_script(tmp_path / "whole", LOOP_FAILS, "--steps", "6", "--batch", "8")
    halves = launch_script(tmp_path / "halves", LOOP_FAILS, "--steps", "6", "--batch", "8",
                           options=("--grad-accum", "2"))
    assert whole.returncode == 0 and halves.returncode == 0, whole.stderr + halves.stderr
    assert read_summary(tmp_path / "halves")["loop"]["grad_accum"] == 2
    expected = torch.load(tmp_path / "whole" / "model.pt", weights_only=True)
    got = torch.load(tmp_path / "halves" / "model.pt", weights_only=True)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-6, atol=1e-7)


def _stopped(run_dir, *script_args: str, options: tuple[str, ...] = (), once: int = 5, signal_to=None,
             env: dict | None = None):
    """The loop script launched with progress at every step; once `once` steps are reported, SIGTERM to the
    launcher (or `signal_to(run_dir)`: a signal to one rank alone). (exit code, stdout, stderr)."""
    result = launch_until(run_dir, "--log-format", "plain", "--log-every", "1", *options, str(LOOP_FAILS),
                          *script_args, until=once, env=env,
                          deliver=None if signal_to is None else lambda _: signal_to(run_dir))
    return result.returncode, result.stdout, result.stderr


def test_an_fp16_loop_resumed_after_an_overflow_keeps_its_loss_scale_and_ends_on_the_uninterrupted_weights(
        tmp_path):
    """fp16 on CPU ranks, the loss of step 3 infinite: the scaler halves its scale there. Stopped after it and
    resumed: the scale right after restore() is the checkpoint's (below the initial one: halved by the overflows),
    and the weights are the uninterrupted run's, bit for bit."""
    args = ("--steps", "30", "--inf-at", "3")
    reference = launch_script(tmp_path / "reference", LOOP_FAILS, *args, options=FP16)
    assert reference.returncode == 0, reference.stderr
    run = tmp_path / "run"
    code, _, err = _stopped(run, *args, "--step-s", "0.1", options=FP16)
    assert code == 143, err
    step = read_summary(run)["loop"]["stopped_at_step"]
    assert 5 <= step < 30
    saved = torch.load(run / "checkpoints" / f"step-{step}.pt", weights_only=True)["trainer"]["_scaler"]["scale"]
    resumed = launch_script(run, LOOP_FAILS, *args, "--scale-to", str(tmp_path / "scale"),
                            options=(*FP16, "--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert float((tmp_path / "scale").read_text()) == saved < 2.0 ** 16  # below the initial 65536: halved
    expected = torch.load(tmp_path / "reference" / "model.pt", weights_only=True)
    got = torch.load(run / "model.pt", weights_only=True)
    assert all(torch.equal(got[key], expected[key]) for key in expected)


def test_a_stop_signal_to_one_rank_of_a_users_loop_stops_every_rank_at_one_step(tmp_path):
    """SIGUSR1 to rank 1 alone (as a job step's signal may reach one process first): every rank's last report is
    the step loop.json says it stopped at, a checkpoint is there, and the launch ends as a stop (138)."""
    def to_rank_1(run_dir):
        os.kill(int((tmp_path / "pids" / "rank1.pid").read_text()), signal.SIGUSR1)

    run = tmp_path / "run"
    code, out, err = _stopped(run, "--steps", "100000", "--step-s", "0.02", "--pids-to", str(tmp_path / "pids"),
                              signal_to=to_rank_1)
    assert code == 128 + signal.SIGUSR1, err
    loop = read_summary(run)["loop"]
    step = loop["stopped_at_step"]
    assert loop["stopped_by"] == "SIGUSR1" and (run / "checkpoints" / f"step-{step}.pt").is_file()
    for rank in (0, 1):
        reported = [int(line.split()[3]) for line in out.splitlines() if line.startswith(f"[rank {rank}] step ")]
        assert reported[-1] == step, out[-2000:]
    assert last_line(err) == (f"ddp-amp: error: stopped by SIGUSR1 at step {step}; checkpoint {loop['checkpoint']} "
                              f"(continue with --resume auto --run-dir {run})")


def test_a_restart_before_this_launch_saved_continues_from_resume_path_not_a_newer_checkpoint(tmp_path):
    """A stopped run leaves step-2 ... step-N; a launch under `run --max-restarts 1 --resume .../step-2.pt` loses
    rank 1 (SIGKILL) at step 3, before its first checkpoint (step 4): the restarted ranks continue from step-2.pt,
    what --resume chose, never from the newer step-N of the earlier launch (the core's rule: after a restart,
    this launch's checkpoints, else --resume)."""
    run = tmp_path / "run"
    code, _, err = _stopped(run, "--steps", "100000", "--step-s", "0.02", once=8, options=("--keep", "1000"))
    assert code == 143, err
    assert read_summary(run)["loop"]["stopped_at_step"] >= 8
    chosen = run / "checkpoints" / "step-2.pt"
    result = launch_script(run, LOOP_FAILS, "--steps", "20", "--kill-once-at", "3", command="run",
                           options=("--max-restarts", "1", "--resume", str(chosen), "--keep", "1000"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"ddp-amp loop: resumed from {chosen} (step 2)") == 2, result.stdout
    summary = read_summary(run)
    assert summary["restarts"] == 1 and summary["loop"]["resumed_from_step"] == 2


def test_a_loop_resumed_on_three_ranks_from_a_two_rank_checkpoint_trains_on_each_sample_of_the_epoch_once(tmp_path):
    """96 samples, 4 per rank and step: 2 ranks take 5 steps (40 samples) and save; `--resume auto` on 3 ranks
    runs to the end of the epoch. Every sample of the epoch is trained on exactly once across both launches,
    and the 3 ranks take as many steps each (none waits in an all-reduce the others never join)."""
    run, seen = tmp_path / "run", tmp_path / "seen"
    first = launch_script(run, TASKS / "loop_samples.py", "--out", str(seen), "--steps", "5")
    assert first.returncode == 0, first.stderr
    resumed = launch_script(run, TASKS / "loop_samples.py", "--out", str(seen), "--to-epoch-end", nproc=3,
                            options=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert read_summary(run)["loop"]["resumed_from_step"] == 5
    lines = {path.stem: path.read_text().split("\n")[:-1] for path in sorted(seen.iterdir())}
    assert sorted(lines) == ["w2-r0", "w2-r1", "w3-r0", "w3-r1", "w3-r2"]
    assert [len(lines[f"w2-r{rank}"]) for rank in (0, 1)] == [5, 5]
    assert len({len(lines[f"w3-r{rank}"]) for rank in (0, 1, 2)}) == 1
    samples = sorted(int(index) for batches in lines.values() for batch in batches for index in batch.split())
    assert samples == list(range(96))


UNFINISHED = "ddp_amp.loop: the script ended without finish(): no model.pt and no loop.json written"


@pytest.mark.parametrize("launcher", ["spawn", "python"])
def test_a_script_that_never_calls_finish_is_told_and_its_last_background_write_completes(tmp_path, launcher):
    """A loop script that forgets finish(): one line says what was not written (rank 0's, once), and the
    checkpoint written in the background at its last step is whole; under ddp-amp and as `python script.py`."""
    run, seen = tmp_path / "run", tmp_path / "seen"
    args = ("--out", str(seen), "--steps", "4", "--no-finish")
    if launcher == "spawn":
        result = launch_script(run, TASKS / "loop_samples.py", *args,
                               options=("--checkpoint-every", "2", "--async-checkpoint"))
    else:
        result = subprocess.run([sys.executable, str(TASKS / "loop_samples.py"), *args], capture_output=True,
                                text=True, timeout=120, cwd=tmp_path)
        run = tmp_path / "ddp-amp-loop"
    assert result.returncode == 0, result.stderr
    assert result.stderr.count(UNFINISHED) == 1, result.stderr
    assert not (run / "model.pt").exists() and not (run / "loop.json").exists()
    last = run / "checkpoints" / "step-4.pt"
    assert last.is_file() and torch.load(last, weights_only=True)["step"] == 4


@pytest.mark.parametrize(("exit", "status"), [("3", 3), ("giving up", 1)])
def test_a_script_that_exits_by_systemexit_without_finish_is_not_told_it_ended(tmp_path, exit, status):
    """`python script.py` whose script leaves by sys.exit(3) or raise SystemExit("giving up") before finish():
    atexit is not told the status, so the line says how it left (not the forgotten finish() of a script that ran
    to its end), and the status is the script's."""
    result = subprocess.run([sys.executable, str(TASKS / "loop_samples.py"), "--out", str(tmp_path / "seen"),
                             "--steps", "2", "--exit", exit], capture_output=True, text=True, timeout=120,
                            cwd=tmp_path)
    assert result.returncode == status, result.stderr
    assert UNFINISHED not in result.stderr, result.stderr
    assert last_line(result.stderr) == ("ddp_amp.loop: the script exited by sys.exit or SystemExit without "
                                        "finish(): no model.pt and no loop.json written"), result.stderr


@pytest.mark.parametrize("launcher", ["spawn", "python"])
def test_a_script_without_finish_whose_last_background_write_fails_exits_1_naming_it(tmp_path, launcher):
    """Its last checkpoint's background write fails (RLIMIT_FSIZE: EFBIG, as a full disk) and the script never
    calls finish(): the process fails naming the write, under ddp-amp and as `python script.py` (where an error
    in an atexit handler would change no exit status), and no partial checkpoint is left."""
    run, seen = tmp_path / "run", tmp_path / "seen"
    args = ("--out", str(seen), "--steps", "4", "--no-finish", "--file-size-limit", "3000")
    if launcher == "spawn":
        result = launch_script(run, TASKS / "loop_samples.py", *args, options=("--async-checkpoint",))
        assert last_line(result.stderr).startswith("ddp-amp: error: rank 0 failed: OSError: [Errno 27] File too "
                                                   "large"), result.stderr
    else:
        result = subprocess.run([sys.executable, str(TASKS / "loop_samples.py"), *args, "--async-save"],
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
        run = tmp_path / "ddp-amp-loop"
        assert "ddp_amp.loop: the checkpoint write in flight failed: OSError: [Errno 27] File too large" in \
            result.stderr, result.stderr
    assert result.returncode == 1, result.stderr
    assert list((run / "checkpoints").iterdir()) == []


def test_under_plain_torchrun_a_restart_continues_from_this_launchs_checkpoint(tmp_path):
    """`torchrun --max-restarts 1` (no ddp-amp; with the store setting docs/scripts.md gives): rank 1 SIGKILLs
    itself at step 7, after the checkpoints of steps 4 and 6 (step 6's may still be in its background write).
    The restarted ranks know the checkpoints as their launch's (the launch is torchrun's agent, which outlived
    them) and continue from one, not from step 0."""
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                             "--max-restarts", "1", str(LOOP_FAILS), "--steps", "10", "--kill-once-at", "7"],
                            capture_output=True, text=True, timeout=300, cwd=tmp_path,
                            env={**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",  # docs/scripts.md
                                 "TMPDIR": str(tmp_path)})  # torchrun's log dir (torchelastic_*), left in TMPDIR
    assert result.returncode == 0, result.stderr
    resumed = [line for line in result.stdout.splitlines() if line.startswith("ddp-amp loop: resumed from ")]
    assert len(resumed) == 1 and int(resumed[0].rsplit("(step ", 1)[1].rstrip(")")) in (4, 6), result.stdout
    record = json.loads((tmp_path / "ddp-amp-loop" / "loop.json").read_text())
    assert record["restarts"] == 1 and record["resumed_from_step"] in (4, 6)


def test_a_restart_before_any_checkpoint_logs_each_step_once(tmp_path):
    """A restart (torchrun's agent, here its count as `python` sees it) of a loop that failed before its first
    checkpoint starts from step 0: the earlier attempt's metrics lines go, as ddp-amp's own loop drops them,
    not kept beside the new attempt's same steps."""
    run_dir = tmp_path / "ddp-amp-loop"
    run_dir.mkdir()
    (run_dir / "metrics.jsonl").write_text("".join(f'{{"step": {step}, "loss": 9.0}}\n' for step in (10, 20, 30)))
    result = subprocess.run([sys.executable, str(LOOP_FAILS), "--steps", "10"], capture_output=True, text=True,
                            timeout=300, cwd=tmp_path, env={**os.environ, "TORCHELASTIC_RESTART_COUNT": "1"})
    assert result.returncode == 0, result.stderr
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [10]  # --log-every's default


def test_a_loop_resumed_past_a_checkpoint_whose_bytes_changed_continues_from_the_one_before(tmp_path):
    """The loop's checkpoints are the core manager's, checksums included: a byte flipped inside the model of the
    newest (its size unchanged, it still loads) is skipped with one warning naming it, and the loop continues
    from the one before."""
    import helper_tasks

    run = tmp_path / "run"
    code, _, err = _stopped(run, "--steps", "100000", "--step-s", "0.02", once=5, options=("--keep", "1000"))
    assert code == 143, err
    stopped = read_summary(run)["loop"]["stopped_at_step"]
    newest = run / "checkpoints" / f"step-{stopped}.pt"
    before = max(int(path.stem.split("-")[1]) for path in (run / "checkpoints").glob("step-*.pt")
                 if path != newest)
    helper_tasks.DAMAGES["flip-model"](newest)
    resumed = launch_script(run, LOOP_FAILS, "--steps", str(stopped + 2), options=("--resume", "auto"))
    assert resumed.returncode == 0, resumed.stderr
    warnings = [line for line in (resumed.stdout + resumed.stderr).splitlines() if "skipping checkpoint" in line]
    assert len(warnings) == 1 and f"skipping checkpoint {newest}: damaged, its crc32 is " in warnings[0], warnings
    assert read_summary(run)["loop"]["resumed_from_step"] == before


def test_ranks_killed_in_a_slow_checkpoint_write_after_a_stop_name_the_newest_complete_checkpoint(tmp_path):
    """SIGTERM to the launcher while every checkpoint after step 4 takes 60 s to write (a slow disk), with
    --stop-timeout 1: the ranks, still writing the stop's checkpoint, are killed. The last line names the newest
    checkpoint that is whole (step-4.pt), as a failure's does; nothing is left running."""
    mark = uuid.uuid4().hex
    run = tmp_path / "run"
    code, _, err = _stopped(run, "--steps", "100000", "--step-s", "0.05", "--write-s", "60",
                            options=("--stop-timeout", "1", "--keep", "1000"), env={MARK_VAR: mark})
    assert code == 143, err
    assert last_line(err) == (f"ddp-amp: error: stopped by SIGTERM: passed on to every rank (each rank's output in "
                              f"{run / 'logs'}); the newest complete checkpoint is {run / 'checkpoints' / 'step-4.pt'} "
                              f"(continue with --resume auto --run-dir {run})")
    assert run_processes(mark) == []


def test_a_stop_in_the_last_step_ends_the_loop_as_ddp_amps_own_finished_and_the_last_step_is_logged(tmp_path):
    """SIGTERM to the launcher while every rank is in the loop's last step (5, of --log-every 2): as ddp-amp's
    own loop, the run has finished: exit 0, one line saying the stop came after the loop, no stop recorded, no
    checkpoint asking for a resume that has nothing left to do. metrics.jsonl ends on step 5, as the core's does
    (it ended on 4)."""
    run, holding = tmp_path / "run", tmp_path / "holding"
    result = launch_until(run, "--log-every", "2", str(TASKS / "loop_samples.py"), "--out", str(tmp_path / "seen"),
                          "--steps", "5", "--hold-last-step", str(holding),
                          until=lambda: all((holding / f"rank{rank}.holding").exists() for rank in (0, 1)))
    assert result.returncode == 0, result.stderr
    assert "ddp-amp: SIGTERM came after the loop had finished (step 5)\n" in result.stderr
    summary = read_summary(run)
    assert summary["outcome"] == "finished" and summary["loop"]["completed_steps"] == 5
    assert "stopped_at_step" not in summary["loop"]
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [2, 4, 5]


def _two_nodes(tmp_path, mark: str, script: Path, *script_args: str) -> list[subprocess.Popen]:
    """Two multinode launchers on loopback, one rank each, each its own run dir (tmp_path/a, tmp_path/b): only
    the node of global rank 0 gets loop.json and the checkpoints."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, "-m", "ddp_amp", "multinode", "--nnodes", "2", "--nproc-per-node", "1", "--endpoint",
         f"127.0.0.1:{port}", "--device", "cpu", "--rdzv-timeout", "120", "--run-dir", str(tmp_path / name),
         str(script), *script_args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, MARK_VAR: mark}) for name in ("a", "b")]


def _signalled(nodes: list[subprocess.Popen], ready, pids) -> list[tuple[str, str]]:
    """Once `ready()`, SIGTERM to each pid of `pids()`; then each node's (stdout, stderr), none left running."""
    try:
        deadline = time.monotonic() + 240
        while not ready():
            assert all(node.poll() is None for node in nodes) and time.monotonic() < deadline, "never got there"
            time.sleep(0.05)
        for pid in pids():
            os.kill(pid, signal.SIGTERM)
        return [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.communicate()


def test_a_stop_in_the_last_step_ends_every_node_as_finished_each_with_its_own_run_dir(tmp_path):
    """SIGTERM to both launchers while both ranks are in the last step. Each node decides from its own ranks,
    which ran every step as all ranks do, not from loop.json, which one of them has: both exit 0 saying the stop
    came after the loop, and nothing is left running."""
    mark, holding = uuid.uuid4().hex, tmp_path / "holding"
    nodes = _two_nodes(tmp_path, mark, TASKS / "loop_samples.py", "--out", str(tmp_path / "seen"), "--steps", "5",
                       "--hold-last-step", str(holding))
    results = _signalled(nodes, lambda: all((holding / f"rank{rank}.holding").exists() for rank in (0, 1)),
                         lambda: [node.pid for node in nodes])
    for node, (_, err) in zip(nodes, results):
        assert node.returncode == 0, err
        assert "ddp-amp: SIGTERM came after the loop had finished (step 5)" in err, err
    assert run_processes(mark) == []


def test_a_stop_signal_to_one_rank_ends_every_node_as_a_stop_at_one_step(tmp_path):
    """SIGTERM to global rank 1 alone, each node its own run dir: both launchers exit 143 and name the step the
    ranks agreed on, rank 0's node with its checkpoint, the other saying where that is; nothing left running."""
    mark, pids = uuid.uuid4().hex, tmp_path / "pids"
    nodes = _two_nodes(tmp_path, mark, LOOP_FAILS, "--steps", "100000", "--step-s", "0.02", "--pids-to", str(pids))
    results = _signalled(nodes, lambda: all((pids / f"rank{rank}.pid").exists() for rank in (0, 1)),
                         lambda: [int((pids / "rank1.pid").read_text())])
    assert [node.returncode for node in nodes] == [143, 143], [err for _, err in results]
    first = 0 if (tmp_path / "a" / "loop.json").exists() else 1
    run = tmp_path / "ab"[first]
    loop = read_summary(run)["loop"]
    assert loop["stopped_by"] == "SIGTERM" and (run / "checkpoints" / f"step-{loop['stopped_at_step']}.pt").is_file()
    assert last_line(results[first][1]) == (
        f"ddp-amp: error: stopped by SIGTERM at step {loop['stopped_at_step']}; checkpoint {loop['checkpoint']} "
        f"(continue with --resume auto --run-dir {run})")
    assert last_line(results[1 - first][1]) == (
        f"ddp-amp: error: stopped by SIGTERM at step {loop['stopped_at_step']} (the loop's record and its checkpoint "
        "are in global rank 0's run dir, on its node)")
    assert read_summary(tmp_path / "ab"[1 - first])["outcome"] == "stopped"
    assert run_processes(mark) == []


def test_a_report_before_restore_in_a_resumed_run_keeps_the_metrics_before_its_checkpoint(tmp_path):
    """A resumed script that reports (an evaluation) before restore(): its first report came before the loop
    knew the step it continues from, and cut metrics.jsonl back to nothing; the lines up to the checkpoint stay."""
    run = tmp_path / "run"
    code, _, err = _stopped(run, "--steps", "100000", "--step-s", "0.02")
    assert code == 143, err
    stopped = read_summary(run)["loop"]["stopped_at_step"]
    resumed = launch_script(run, LOOP_FAILS, "--steps", str(stopped + 3), "--report-first",
                            options=("--resume", "auto", "--log-every", "1"))
    assert resumed.returncode == 0, resumed.stderr
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [*range(1, stopped + 1), 0, *range(stopped + 1, stopped + 4)], steps
