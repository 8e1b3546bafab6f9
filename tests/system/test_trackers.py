"""--tracker with real trackers on loopback: an MLflow tracking server (SQLite backend) started here, and
Weights & Biases in offline mode, read back from its own files. One tracker run per training run across a
SIGTERM and --resume auto and a torchrun restart, each step once; a server killed mid-run costs one warning."""

import glob
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import HELPER_TASKS, assert_ok, free_port, launch_until, read_metrics, read_summary, run_cli

mlflow = pytest.importorskip("mlflow")

TASK = f"{HELPER_TASKS}:resumable"
STEPS = 40
ARGS = ["-n", "2", "--device", "cpu", "--task", TASK, "--steps", str(STEPS), "--batch-size", "16", "--seed", "5",
        "--log-every", "1", "--checkpoint-every", "10", "--lr", "0.01", "--amp", "off"]
SLOW = {"DDP_AMP_TEST_STEP_SLEEP": "0.05"}  # slow enough to be caught between two checkpoints


class MlflowServer:
    """`mlflow server` on a free loopback port, a SQLite file for its runs, in a process group of its own."""

    def __init__(self, root: Path) -> None:
        port = free_port()
        self.uri = f"http://127.0.0.1:{port}"
        self.process = subprocess.Popen(
            [str(Path(sys.executable).parent / "mlflow"), "server", "--host", "127.0.0.1", "--port", str(port),
             "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'runs.db'}",
             "--default-artifact-root", str(root / "artifacts")],
            stdout=subprocess.DEVNULL, stderr=open(root / "server.log", "w"), start_new_session=True,
            env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})  # no job runner: the runs alone
        deadline = time.monotonic() + 180
        while not self._healthy():
            assert self.process.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the MLflow server did not start"
            time.sleep(0.3)

    def _healthy(self) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(f"{self.uri}/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL to its whole process group (the server and its workers), as a crash or an OOM kill would."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=30)

    def client(self):
        from mlflow.tracking import MlflowClient

        return MlflowClient(self.uri)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = MlflowServer(tmp_path_factory.mktemp("mlflow"))
    yield started
    started.kill()


def only_run(server: MlflowServer, project: str):
    client = server.client()
    experiment = client.get_experiment_by_name(project)
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]
    return client, runs[0]


TIMINGS = ("elapsed_s", "samples_per_s", "tflops_per_rank", "mfu")
"""Measured, not computed: a step trained again after a restart (the steps after the checkpoint) takes its own
time, and the tracker keeps the value of the attempt that sent the step first."""


def assert_history_is_metrics_jsonl(client, run_id: str, run_dir: Path, evaluated: bool = False,
                                    restarted: bool = False) -> None:
    """Every numeric key of metrics.jsonl's training and evaluation records: the tracker's history of it holds
    each step once, with metrics.jsonl's value (after a restart, the timings' steps only)."""
    records = read_metrics(run_dir) + read_metrics(run_dir, evaluations=True)
    keys = {key for record in records for key, value in record.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key not in ("step", "total_steps")}
    assert {"loss", "lr", "samples_per_s", *(["val_loss"] if evaluated else [])} <= keys
    for key in sorted(keys):
        expected = sorted((r["step"], float(r[key])) for r in records if isinstance(r.get(key), (int, float)))
        held = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        if restarted and key in TIMINGS:
            held, expected = [step for step, _ in held], [step for step, _ in expected]
        assert held == expected, key


def stopped_by_sigterm_after_step_10(run_dir: Path, flags: list[str], env: dict[str, str]) -> None:
    """A slow 2-rank run with `flags`, SIGTERM to its launcher once the step-10 checkpoint exists: exit 143."""
    stopped = launch_until(run_dir, *ARGS[2:], *flags, until=(run_dir / "checkpoints" / "step-10.pt").exists,
                           env={**SLOW, **env})
    assert stopped.returncode == 143, stopped.stderr

def test_a_two_rank_run_logs_its_config_metrics_and_files_to_a_real_mlflow_server(tmp_path, server):
    result = run_cli("spawn", "-n", "2", "--device", "cpu", "--task", "mlp", "--steps", str(STEPS), "--log-every",
                     "5", "--eval-every", "20", "--tracker", "mlflow", "--tracker-project", "plain", "--tracker-tag",
                     "team=vision", "--run-dir", str(tmp_path), env={"MLFLOW_TRACKING_URI": server.uri})
    assert_ok(result)
    client, run = only_run(server, "plain")
    assert run.info.status == "FINISHED" and run.data.tags["ddp_amp.outcome"] == "finished"
    assert run.data.tags["team"] == "vision" and run.info.run_name == tmp_path.name
    params = run.data.params
    assert params["world_size"] == "2" and params["task"] == "mlp"
    assert params["precision"] in ("fp32", "bf16", "bf16-true")  # --amp auto's measured answer
    assert params["steps"] == str(STEPS) and params["device"]
    assert_history_is_metrics_jsonl(client, run.info.run_id, tmp_path, evaluated=True)
    assert {a.path for a in client.list_artifacts(run.info.run_id)} >= {"model.pt", "summary.json"}
    summary = read_summary(tmp_path)
    logged = len(read_metrics(tmp_path)) + len(read_metrics(tmp_path, evaluations=True))
    sent = summary["trackers"]["mlflow"]
    assert {key: sent[key] for key in ("run_id", "sent_steps", "unsent_steps")} == {
        "run_id": run.info.run_id, "sent_steps": logged, "unsent_steps": 0} and "error" not in sent
    assert 0 < sent["thread_cpu_s"]
    assert run.data.metrics["summary/final_loss"] == pytest.approx(summary["final_loss"])


def test_a_run_stopped_by_sigterm_and_resumed_is_one_mlflow_run_with_each_step_once(tmp_path, server):
    stopped_by_sigterm_after_step_10(tmp_path, ["--tracker", "mlflow", "--tracker-project", "stopped"],
                                     {"MLFLOW_TRACKING_URI": server.uri})
    stopped_at = read_summary(tmp_path)["stopped_at_step"]
    client, run = only_run(server, "stopped")
    assert run.info.status == "KILLED" and run.data.tags["ddp_amp.outcome"] == f"stopped at step {stopped_at}"
    assert_ok(run_cli("spawn", *ARGS, "--tracker", "mlflow", "--tracker-project", "stopped", "--resume", "auto",
                      "--run-dir", str(tmp_path), env={"MLFLOW_TRACKING_URI": server.uri}))
    client, resumed = only_run(server, "stopped")
    assert resumed.info.run_id == run.info.run_id and resumed.info.status == "FINISHED"
    assert [m.step for m in sorted(client.get_metric_history(run.info.run_id, "loss"), key=lambda m: m.step)] == \
        list(range(1, STEPS + 1))
    assert_history_is_metrics_jsonl(client, run.info.run_id, tmp_path, restarted=True)


def test_a_run_continued_in_another_run_dir_is_still_one_mlflow_run(tmp_path, server):
    """Stopped in dir A, continued in a new dir B with --resume A/checkpoints/step-N.pt: the tracker run is found
    through the checkpoint's run dir, so there is still one MLflow run, finished, and B's trackers.json holds its
    id (A's)."""
    first, second = tmp_path / "a", tmp_path / "b"
    env = {"MLFLOW_TRACKING_URI": server.uri}
    stopped_by_sigterm_after_step_10(first, ["--tracker", "mlflow", "--tracker-project", "moved"], env)
    _, run = only_run(server, "moved")
    checkpoint = first / "checkpoints" / f"step-{read_summary(first)['stopped_at_step']}.pt"
    assert_ok(run_cli("spawn", *ARGS, "--tracker", "mlflow", "--tracker-project", "moved", "--resume", str(checkpoint),
                      "--run-dir", str(second), env=env))
    _, continued = only_run(server, "moved")
    assert continued.info.run_id == run.info.run_id and continued.info.status == "FINISHED"
    assert json.loads((second / "trackers.json").read_text())["mlflow"]["run_id"] == run.info.run_id


def test_a_resume_from_before_the_last_step_sent_sends_each_step_once(tmp_path, server):
    """Stopped at step 10 or later, resumed from the step-5 checkpoint: steps 6 to the stop are trained again,
    and the tracker, which had them, keeps each step once (a plain SIGTERM-and-resume cannot show it: it resumes
    from the stop's own step)."""
    every_5 = ["--checkpoint-every", "5", "--keep", "100"]
    env = {"MLFLOW_TRACKING_URI": server.uri}
    stopped_by_sigterm_after_step_10(tmp_path, ["--tracker", "mlflow", "--tracker-project", "again", *every_5], env)
    assert read_summary(tmp_path)["stopped_at_step"] >= 10
    at = ARGS.index("--checkpoint-every")
    args = ARGS[:at] + ARGS[at + 2:]  # every_5's, given once
    assert_ok(run_cli("spawn", *args, *every_5, "--tracker", "mlflow", "--tracker-project", "again", "--resume",
                      str(tmp_path / "checkpoints" / "step-5.pt"), "--run-dir", str(tmp_path), env=env))
    client, run = only_run(server, "again")
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(1, STEPS + 1))


def test_a_torchrun_restart_after_a_killed_rank_continues_the_same_run(tmp_path, server):
    result = run_cli("run", *ARGS, "--max-restarts", "1", "--tracker", "mlflow", "--tracker-project", "restarted",
                     "--run-dir", str(tmp_path), env={"DDP_AMP_TEST_KILL_AT": "25", "MLFLOW_TRACKING_URI": server.uri})
    assert_ok(result)
    assert read_summary(tmp_path)["restarts"] == 1
    client, run = only_run(server, "restarted")
    assert run.info.status == "FINISHED"
    assert_history_is_metrics_jsonl(client, run.info.run_id, tmp_path, restarted=True)


def test_a_server_killed_mid_run_is_one_warning_even_under_quiet_and_training_goes_on(tmp_path, tmp_path_factory):
    own = MlflowServer(tmp_path_factory.mktemp("mlflow-killed"))
    try:
        def mlflow_has_step_3() -> bool:
            record = tmp_path / "trackers.json"
            sent = json.loads(record.read_text() if record.exists() else "{}").get("mlflow", {})
            return sent.get("last_step", 0) >= 3

        finished = launch_until(tmp_path, *ARGS[2:], "--tracker", "mlflow", "--quiet", until=mlflow_has_step_3,
                                deliver=lambda _: own.kill(), env={**SLOW, "MLFLOW_TRACKING_URI": own.uri})
    finally:
        own.kill()
    assert finished.returncode == 0, finished.stderr
    output = finished.stdout + finished.stderr
    warnings = [line for line in output.splitlines() if "warning: --tracker mlflow" in line]
    assert len(warnings) == 1, warnings
    assert not [line for line in output.splitlines() if " step " in line and "loss" in line]  # --quiet held
    assert [r["step"] for r in read_metrics(tmp_path)] == list(range(1, STEPS + 1))
    sent = read_summary(tmp_path)["trackers"]["mlflow"]
    logged = len(read_metrics(tmp_path)) + len(read_metrics(tmp_path, evaluations=True))
    assert sent["error"] and sent["unsent_steps"] > 0 and sent["sent_steps"] + sent["unsent_steps"] == logged


def wandb_history(run_dir: Path) -> tuple[set[str], list[dict]]:
    """The run ids and history rows of every offline run under RUN_DIR/wandb, from W&B's transaction logs: the
    records decoded with wandb's own protobuf classes (wandb 0.31 ships no Python reader of the log; its framing
    is LevelDB's log format: 32 KiB blocks of records with a 7-byte header, after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    ids, rows = set(), []
    for path in sorted(glob.glob(str(run_dir / "wandb" / "offline-run-*" / "run-*.wandb"))):
        data, position, pending, records = Path(path).read_bytes(), 7, b"", []
        while position + 7 <= len(data):
            left = 32768 - position % 32768
            _, length, kind = struct.unpack("<IHB", data[position:position + 7])
            if left < 7 or (kind == 0 and length == 0):
                position += left
                continue
            chunk, position = data[position + 7:position + 7 + length], position + 7 + length
            pending = chunk if kind in (1, 2) else pending + chunk
            if kind in (1, 4):
                records.append(pending)
        for raw in records:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "run":
                ids.add(record.run.run_id)
            elif record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return ids, rows


def test_wandb_offline_holds_the_history_and_a_resumed_run_keeps_its_id(tmp_path, tmp_path_factory):
    """...and its temporary directories (wandb's media and artifacts) do not outlive either launch: a rank ends
    with os._exit, which runs none of Python's exit handlers (rank.tracker_runs)."""
    pytest.importorskip("wandb")
    offline = {"WANDB_MODE": "offline", "TMPDIR": str(tmp_path_factory.mktemp("tmpdir"))}
    stopped_by_sigterm_after_step_10(tmp_path, ["--tracker", "wandb"], offline)
    first_id = json.loads((tmp_path / "trackers.json").read_text())["wandb"]["run_id"]
    assert_ok(run_cli("spawn", *ARGS, "--tracker", "wandb", "--resume", "auto", "--run-dir", str(tmp_path),
                      env=offline))
    left = [path.name for path in Path(offline["TMPDIR"]).iterdir() if not path.name.startswith("torchinductor_")]
    assert left == [], f"left in TMPDIR: {left}"
    ids, rows = wandb_history(tmp_path)
    assert ids == {first_id} and len(glob.glob(str(tmp_path / "wandb" / "offline-run-*"))) == 2
    losses = [(row["_step"], row["loss"]) for row in rows if "loss" in row]
    assert losses == [(r["step"], r["loss"]) for r in read_metrics(tmp_path)]  # each step once, in order
    assert read_summary(tmp_path)["trackers"]["wandb"]["unsent_steps"] == 0


def test_a_script_using_the_loop_module_reports_to_the_tracker(tmp_path, server):
    """ddp_amp.loop's report() under `--tracker mlflow --log-every 5`: rank 0's reported values at steps 5..20,
    equal to metrics.jsonl's, in one finished run; what the tracker got in loop.json."""
    from helpers import TESTS, launch_script

    run = tmp_path / "run"
    result = launch_script(run, TESTS.parent / "examples" / "origin_loop.py", "--epochs", "20",
                           options=("--tracker", "mlflow", "--tracker-project", "script", "--log-every", "5"),
                           env={"MLFLOW_TRACKING_URI": server.uri})
    assert result.returncode == 0, result.stderr
    client, tracked = only_run(server, "script")
    assert tracked.info.status == "FINISHED" and tracked.data.params["tracker"] == "mlflow"
    logged = [(record["step"], record["loss"]) for record in map(json.loads, (run / "metrics.jsonl").read_text()
                                                                .splitlines())]
    assert sorted((m.step, m.value) for m in client.get_metric_history(tracked.info.run_id, "loss")) == logged
    assert [step for step, _ in logged] == [5, 10, 15, 20]
    record = json.loads((run / "loop.json").read_text())
    assert record["trackers"]["mlflow"]["sent_steps"] == 4
