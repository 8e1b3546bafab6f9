"""A user's script on the command line, before any rank starts (in-process, through the CLI's own main): what is
refused (one line, exit 2, nothing made), what the script is given, the jobs emitted for clusters; and the
launcher's capture of a script's output (progress.output) with real sockets."""

import io
import json
import socket
import subprocess
import sys
import time

import pytest
import yaml
from helpers import CHECKS_SCRIPT, one_line, run_main

from ddp_amp.progress.display import PlainDisplay, RichDisplay
from ddp_amp.progress.output import OutputServer, connect_stream


@pytest.mark.parametrize("command", [["spawn", "-n", "2"], ["run", "-n", "2"],
                                     ["multinode", "--nnodes", "2", "--endpoint", "127.0.0.1:29400"]])
def test_options_of_the_built_in_loop_with_a_script_are_named_and_refused(command, tmp_path, capsys):
    run_dir = tmp_path / "run"
    code, out, err = run_main([*command, "--optimizer", "sgd", "--lr", "0.1", "--no-async-checkpoint",
                               "--run-dir", str(run_dir), str(CHECKS_SCRIPT), "--steps", "3"], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == ("ddp-amp: error: --optimizer, --lr, --async-checkpoint: options of ddp-amp's own "
                             "training loop, which a script does not run; drop them (a script takes its own "
                             "arguments after its name; of the training options only --stop-timeout, --device and "
                             f"--resume auto apply to it); --async-checkpoint would apply to a script that uses "
                             f"ddp_amp.loop, and {CHECKS_SCRIPT} does not import it (a loop in a module of its "
                             f"own: add `import ddp_amp.loop` to {CHECKS_SCRIPT} itself, which is where ddp-amp "
                             "looks)")
    assert not run_dir.exists()


def test_everything_after_the_script_is_the_scripts_verbatim(capsys, tmp_path, monkeypatch):
    """Options after SCRIPT are the script's, even ddp-amp's own names (--lr, -n, --help): the torchrun command
    that `run --dry-run` prints ends with them unchanged; --stop-timeout before it is accepted; nothing is
    written (the printed command runs the script itself: no config.json to read)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # torchrun's 1 below, unless the user's shell set one
    code, out, err = run_main(["run", "-n", "2", "--stop-timeout", "5", "--dry-run", str(CHECKS_SCRIPT), "--lr",
                               "0.1", "-n", "7", "--help", "a b"], capsys)
    assert list(tmp_path.iterdir()) == []
    assert code == 0, err
    assert out.strip().endswith(f"--nproc-per-node 2 --max-restarts 0 --monitor-interval 0.1 {CHECKS_SCRIPT} --lr "
                                "0.1 -n 7 --help 'a b'")
    assert "OMP_NUM_THREADS=1" in out  # torchrun's setting for a script's ranks


@pytest.mark.parametrize("make, line", [
    (lambda tmp: tmp / "missing.py", "script '{path}' does not exist"),
    (lambda tmp: tmp, "script '{path}' is a directory; give the training script's file (or -m package.module)"),
    (lambda tmp: _write(tmp / "broken.py", "import os\n\ndef main(:\n    pass\n"),
     "script {path}:3: SyntaxError: invalid syntax"),
])
def test_a_script_that_cannot_run_is_one_line_before_anything_starts(make, line, tmp_path, capsys):
    path = make(tmp_path)
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "-n", "2", "--run-dir", str(run_dir), str(path), "--steps", "1"], capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: " + line.format(path=path)
    assert not run_dir.exists()


def _write(path, text):
    path.write_text(text)
    return path


@pytest.mark.parametrize("args, line", [
    (["-m", "no_such_module_here"], "-m no_such_module_here: no module of that name (from {cwd})"),
    (["-m", "no_such_package.train"], "-m no_such_package.train: no module of that name (from {cwd})"),
    (["-m", "trainpkg.nosuch"], "-m trainpkg.nosuch: trainpkg has no module nosuch"),
    (["-m"], "-m needs a module to run, as python -m does: -m package.module [ARGS]"),
    (["-m", "trainpkg"], "-m trainpkg: a package without a __main__ module, which python -m cannot run; give the "
                         "module that trains (-m package.module)"),
])
def test_a_module_that_cannot_be_found_is_one_line(args, line, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "trainpkg").mkdir()
    (tmp_path / "trainpkg" / "__init__.py").write_text("")  # no __main__.py
    code, _, err = run_main(["run", "-n", "2", "--run-dir", str(tmp_path / "run"), *args], capsys)
    assert code == 2
    assert one_line(err) == "ddp-amp: error: " + line.format(cwd=tmp_path)
    assert not (tmp_path / "run").exists()


def test_emit_slurm_with_a_script_runs_it_last_from_the_launch_directory(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, _, err = run_main(["multinode", "--nnodes", "2", "--endpoint", "head:29400", "--emit-slurm", "job.sh",
                             "--run-dir", "runs/a", str(CHECKS_SCRIPT), "--steps", "9"], capsys)
    assert code == 0, err
    text = (tmp_path / "job.sh").read_text()
    assert f"#SBATCH --chdir={tmp_path}" in text
    assert 'set -- --nproc-per-node 1 --rdzv-timeout 600 --monitor-interval 0.1 --log-format auto --run-dir ' \
           '"$RUN_DIR"\n' in text
    assert f'set -- "$@" {CHECKS_SCRIPT} --steps 9\n' in text  # the script and its words last
    # a requeued attempt continues its run dir (the script resumes itself), before the script's name
    assert text.index('set -- "${continued[@]}"') < text.index(f'set -- "$@" {CHECKS_SCRIPT}')
    assert 'if [ "${SLURM_RESTART_COUNT:-0}" -gt 0 ]; then\n  continue_run "$@"' in text
    assert "both must be there on the nodes" in err


def test_run_emits_a_one_node_slurm_job_of_the_same_run(tmp_path, capsys, monkeypatch):
    """Single-node Slurm jobs are common: `run --emit-slurm` writes one that runs `ddp-amp run` with the same
    options on one node (no rendezvous endpoint), requeued on preemption as multinode's job is."""
    monkeypatch.chdir(tmp_path)
    code, out, err = run_main(["run", "-n", "2", "--device", "cpu", "--max-restarts", "1", "--emit-slurm",
                               "job.sh", "--run-dir", "runs/a", str(CHECKS_SCRIPT), "--steps", "9"], capsys)
    assert code == 0, err
    text = (tmp_path / "job.sh").read_text()
    assert "#SBATCH --nodes=1\n" in text and "#SBATCH --requeue\n" in text
    assert 'set -- --nproc-per-node 2 --device cpu --monitor-interval 0.1 --log-format auto --max-restarts 1 ' \
           '--run-dir "$RUN_DIR"\n' in text
    assert 'srun --ntasks-per-node=1 ${SLURM_CPUS_PER_TASK:+--cpus-per-task="$SLURM_CPUS_PER_TASK"} ddp-amp run ' \
           '"$@"\n' in text
    assert "multinode" not in text and "--rdzv" not in text and "DDP_AMP_ENDPOINT" not in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0


def test_emit_k8s_with_a_script_ends_every_pods_command_with_it(tmp_path, capsys):
    code, out, err = run_main(["multinode", "--nnodes", "2", "--emit-k8s", str(tmp_path / "job.yaml"), "--image",
                               "me/train:1", "--k8s-kind", "jobset", "train.py", "--steps", "9"], capsys)
    # train.py does not exist here: a script is checked before anything is emitted
    assert code == 2 and "script 'train.py' does not exist" in err
    code, out, err = run_main(["multinode", "--nnodes", "2", "--emit-k8s", str(tmp_path / "job.yaml"), "--image",
                               "me/train:1", "--k8s-kind", "jobset", str(CHECKS_SCRIPT), "--steps", "9"], capsys)
    assert code == 0, err
    manifest = yaml.safe_load((tmp_path / "job.yaml").read_text())
    text = yaml.safe_dump(manifest)
    assert f"- {CHECKS_SCRIPT}\n" in text
    commands = [c["command"] for job in manifest["spec"]["replicatedJobs"]
                for c in job["template"]["spec"]["template"]["spec"]["containers"]]
    assert commands and all(command[-3:] == [str(CHECKS_SCRIPT), "--steps", "9"] for command in commands)


def _serve(tmp_path):
    events = []
    server = OutputServer(tmp_path / "logs", events.append)
    return server, events


def test_a_stream_still_waiting_to_be_accepted_when_the_launch_ends_is_read_to_its_end(tmp_path, monkeypatch):
    """A launcher short of CPU may not have accepted a rank's stream before the rank ended (its bytes wait in the
    listen queue): the end of the launch reads it too. Here the serving loop accepts nothing."""
    server, events = _serve(tmp_path)
    monkeypatch.setattr(server._server, "_handle_request_noblock", lambda: None)
    with server:
        for key, value in server.environment().items():
            monkeypatch.setenv(key, value)
        out = connect_stream(1, "stdout")
        out.sendall(b"rank 1 step 1 sum 4\n")
        out.close()
    assert (tmp_path / "logs" / "rank1.log").read_bytes() == b"rank 1 step 1 sum 4\n"
    assert [e["line"] for e in events] == ["rank 1 step 1 sum 4"]


def test_a_ranks_streams_reach_its_log_byte_for_byte_and_the_display_line_by_line(tmp_path, monkeypatch):
    server, events = _serve(tmp_path)
    with server:
        for key, value in server.environment().items():
            monkeypatch.setenv(key, value)
        out, err = connect_stream(1, "stdout"), connect_stream(1, "stderr")
        out.sendall(b"step 1\nstep 2\r\nhalf a li")
        time.sleep(0.05)
        err.sendall(b"warning: x\n")
        time.sleep(0.05)
        out.sendall(b"ne\nno newline at the end")
        out.close()
        err.close()
    assert (tmp_path / "logs" / "rank1.log").read_bytes() == \
        b"step 1\nstep 2\r\nhalf a liwarning: x\nne\nno newline at the end"
    lines = [(e["rank"], e["stream"], e["line"]) for e in events]
    assert [line for line in lines if line[1] == "stdout"] == [
        (1, "stdout", "step 1"), (1, "stdout", "step 2"), (1, "stdout", "half a line"),
        (1, "stdout", "no newline at the end")]
    assert [line for line in lines if line[1] == "stderr"] == [(1, "stderr", "warning: x")]


def test_a_progress_bar_shows_as_a_terminal_shows_it_while_it_moves_and_when_its_line_ends(tmp_path, monkeypatch):
    """tqdm's bar rewrites its line with carriage returns: its line showed every state run together, and only at
    its newline. Now the rank's row follows it (output_progress, the text after the last CR) and the complete
    line is its last state; the log keeps every byte."""
    from ddp_amp.progress.view_state import ProgressState

    server, events = _serve(tmp_path)
    with server:
        for key, value in server.environment().items():
            monkeypatch.setenv(key, value)
        err = connect_stream(0, "stderr")
        err.sendall(b"\r 10%|#         |")
        deadline = time.monotonic() + 10  # the launcher's reading thread gets to it
        while not events and time.monotonic() < deadline:
            time.sleep(0.01)
        view = ProgressState()
        for event in events:
            view.apply(event)
        assert [(e["type"], e["line"]) for e in events] == [("output_progress", " 10%|#         |")]
        assert view.ranks[0].last_line == " 10%|#         |"
        for state in (b"\r 20%|##        |", b"\r 30%|###       |"):  # within the throttle's window, then quiet
            err.sendall(state)
            time.sleep(0.01)
        deadline = time.monotonic() + 10  # the last state is shown though no more comes
        while events[-1]["line"] != " 30%|###       |" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert events[-1] == {"type": "output_progress", "rank": 0, "stream": "stderr", "line": " 30%|###       |"}
        err.sendall(b"\r 50%|#####     |\r100%|##########|\nnext\r\n")
        err.close()
    assert [(e["type"], e["line"]) for e in events if e["type"] == "output"] == [
        ("output", "100%|##########|"), ("output", "next")]
    assert (tmp_path / "logs" / "rank0.log").read_bytes() == \
        b"\r 10%|#         |\r 20%|##        |\r 30%|###       |\r 50%|#####     |\r100%|##########|\nnext\r\n"


def test_a_rank_that_prints_nothing_still_has_its_log(tmp_path, monkeypatch):
    """Every rank's log exists once its streams connected: an empty logs/rank1.log, not a missing one."""
    server, events = _serve(tmp_path)
    with server:
        for key, value in server.environment().items():
            monkeypatch.setenv(key, value)
        streams = [connect_stream(rank, name) for rank in (0, 1) for name in ("stdout", "stderr")]
        streams[0].sendall(b"rank 0 speaks\n")
        for stream in streams:
            stream.close()
    assert (tmp_path / "logs" / "rank0.log").read_bytes() == b"rank 0 speaks\n"
    assert (tmp_path / "logs" / "rank1.log").read_bytes() == b""


def test_a_connection_without_the_launchs_token_is_not_read(tmp_path):
    server, events = _serve(tmp_path)
    with server:
        host, port = server.environment()["DDP_AMP_OUTPUT"].rsplit(":", 1)
        with socket.create_connection((host, int(port))) as stray:
            stray.sendall(b"not-the-token 0 stdout\ninjected\n")
    assert events == [] and not (tmp_path / "logs" / "rank0.log").exists()


def test_a_scripts_lines_are_shown_by_rank_its_stderr_on_stderr(monkeypatch):
    stdout, stderr = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    display = PlainDisplay()
    display.handle({"type": "output", "rank": 1, "stream": "stdout", "line": "Rank 1, Epoch 0, Loss 1.5"})
    display.handle({"type": "output", "rank": 0, "stream": "stderr", "line": "UserWarning: x"})
    assert stdout.getvalue() == "[rank 1] Rank 1, Epoch 0, Loss 1.5\n"
    assert stderr.getvalue() == "[rank 0] UserWarning: x\n"


def test_around_a_script_ddp_amps_own_lines_leave_the_scripts_stdout_to_it(monkeypatch):
    """Piped, a script's stdout holds what the script printed and its report() lines: the ranks' states and a
    failing rank's traceback, ddp-amp's own lines, go to stderr (for ddp-amp's loop, stdout is the progress)."""
    stdout, stderr = io.StringIO(), io.StringIO()
    monkeypatch.setattr(sys, "stdout", stdout)
    monkeypatch.setattr(sys, "stderr", stderr)
    display = PlainDisplay()
    display.view.script = True
    display.handle({"type": "state", "rank": 0, "status": "starting", "world_size": 2, "pid": 1})
    display.handle({"type": "output", "rank": 0, "stream": "stdout", "line": "epoch 0"})
    display.handle({"type": "report", "rank": 0, "step": 3, "metrics": {"loss": 0.5}})  # the script's report()
    display.handle({"type": "error", "rank": 0, "traceback": "Traceback...\nValueError: no", "kind": "error",
                    "time": 1.0})
    display.close()
    assert stdout.getvalue().splitlines()[0] == "[rank 0] epoch 0"
    assert stdout.getvalue().splitlines()[1].startswith("[rank 0] step 3 loss 0.5")
    assert stderr.getvalue().splitlines() == ["[rank 0] starting (world size 2)", "[rank 0] failed:",
                                              "Traceback...", "ValueError: no"]


def test_the_live_view_of_a_script_has_a_row_per_rank_with_its_last_line():
    from rich.console import Console

    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    display = RichDisplay(console, live=False, clock=lambda: 0.0)
    display.view.script = True
    display.handle({"type": "state", "rank": 0, "status": "running", "pid": 10})
    display.handle({"type": "state", "rank": 1, "status": "running", "pid": 11})
    display.handle({"type": "output", "rank": 0, "stream": "stdout", "line": "epoch 3 loss 0.25"})
    display.handle({"type": "output", "rank": 1, "stream": "stdout", "line": "epoch 2 loss 0.5"})
    display.handle({"type": "state", "rank": 1, "status": "done", "exit_code": 0})
    view = Console(file=io.StringIO(), width=100)
    view.print(display.render())
    rows = [line.split() for line in view.file.getvalue().splitlines()]
    assert ["0", "running", "epoch", "3", "loss", "0.25"] in rows
    assert ["1", "done", "epoch", "2", "loss", "0.5"] in rows


def test_a_group_the_script_destroys_stays_referenced_until_the_rank_exits(monkeypatch):
    """docs/scripts.md: a DDP model that outlives `destroy_process_group()` would free the gloo group's last
    reference in the middle of the script's code, where its destructor can hang under load. A script rank keeps
    every group the script destroys (the rank ends with os._exit, so it is never destructed); for the script the
    group is destroyed as before."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d

    import ddp_amp.dist
    from ddp_amp.rank import script

    monkeypatch.setattr(distributed_c10d, "destroy_process_group", distributed_c10d.destroy_process_group)
    monkeypatch.setattr(dist, "destroy_process_group", dist.destroy_process_group)
    kept = []
    monkeypatch.setattr(ddp_amp.dist, "KEPT_GROUPS", kept)
    script._keep_destroyed_groups()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    world = dist.group.WORLD
    side = dist.new_group([0])
    dist.destroy_process_group(side)
    assert kept == [side] and dist.is_initialized()
    dist.destroy_process_group()
    assert not dist.is_initialized()
    assert world in kept and len(kept) == 2


@pytest.mark.parametrize("importing", ["from ddp_amp import loop", "import ddp_amp.loop",
                                       "from ddp_amp.loop import setup", "import ddp_amp.loop as dl"])
def test_the_loop_options_are_taken_for_a_script_that_imports_ddp_amp_loop_and_refused_otherwise(importing, tmp_path,
                                                                                                 capsys, monkeypatch):
    """--amp, --grad-accum, --resume, ... mean something for a script whose source imports ddp_amp.loop (its
    loop reads them from config.json): accepted there, up to the launch (patched out here); for another script
    they are refused with the reason named, before anything is made."""
    from ddp_amp.commands import train

    launched = []
    monkeypatch.setattr(train, "show", lambda launch, output, resolved: launched.append(launch))
    script = tmp_path / "train.py"
    script.write_text(f"{importing}\nprint('hi')\n")
    code, out, err = run_main(["spawn", "-n", "2", "--amp", "on", "--grad-accum", "2", "--resume", "auto",
                               "--run-dir", str(tmp_path / "run"), str(script)], capsys)
    assert code == 0, err
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert (config["amp"], config["grad_accum"], config["resume"]) == ("on", 2, "auto") and len(launched) == 1
    plain = tmp_path / "plain.py"
    plain.write_text("import ddp_amp\nprint('hi')\n")
    code, out, err = run_main(["spawn", "-n", "2", "--amp", "on", "--optimizer", "sgd",
                               "--run-dir", str(tmp_path / "run2"), str(plain)], capsys)
    assert code == 2 and one_line(err).endswith(
        f"--amp would apply to a script that uses ddp_amp.loop, and {plain} does not import it (a loop in a "
        f"module of its own: add `import ddp_amp.loop` to {plain} itself, which is where ddp-amp looks)")
    assert not (tmp_path / "run2").exists()


@pytest.mark.parametrize("layout", ["main-imports-loop", "init-imports-loop"])
def test_a_packages_loop_options_follow_the_module_python_m_runs(layout, tmp_path, capsys, monkeypatch):
    """-m pkg runs pkg/__main__.py: when that file imports ddp_amp.loop the loop's options are taken (--amp on
    lands in config.json); when only pkg/__init__.py does, they are refused, naming the package."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("ddp_amp.launch.session.run_launch", lambda launch, display: None)
    (tmp_path / "pkg").mkdir()
    importing, plain = "from ddp_amp import loop\n", "print('training')\n"
    (tmp_path / "pkg" / "__main__.py").write_text(importing if layout == "main-imports-loop" else plain)
    (tmp_path / "pkg" / "__init__.py").write_text(plain if layout == "main-imports-loop" else importing)
    run_dir = tmp_path / "run"
    code, _, err = run_main(["spawn", "-n", "2", "--amp", "on", "--run-dir", str(run_dir), "-m", "pkg"], capsys)
    if layout == "main-imports-loop":
        assert code == 0, err
        assert json.loads((run_dir / "config.json").read_text())["amp"] == "on"
    else:
        assert code == 2 and not run_dir.exists()
        assert one_line(err).endswith("; --amp would apply to a script that uses ddp_amp.loop, and pkg does not "
                                      "import it (a loop in a module of its own: add `import ddp_amp.loop` to "
                                      f"{tmp_path / 'pkg' / '__main__.py'} itself, which is where ddp-amp looks)")


def test_loop_options_from_a_config_file_are_refused_naming_the_file(tmp_path, capsys):
    """--config FILE's options of ddp-amp's loop, given with a plain script: the refusal says they came from the
    file (and not those given on the command line, which win over it)."""
    config = tmp_path / "train.toml"
    config.write_text('lr = 0.1\noptimizer = "sgd"\n')
    code, _, err = run_main(["spawn", "-n", "2", "--config", str(config), "--lr", "0.2", "--run-dir",
                             str(tmp_path / "run"), str(CHECKS_SCRIPT)], capsys)
    assert code == 2 and not (tmp_path / "run").exists()
    assert one_line(err).endswith(f"apply to it) (--optimizer from --config {str(config)!r})"), err


@pytest.mark.parametrize(("given", "restarts", "expected"), [
    ([], "0", []), ([], "1", ["--resume", "auto"]),
    (["--overwrite"], "0", ["--overwrite"]), (["--overwrite"], "1", ["--resume", "auto"]),
    (["--resume", "a/checkpoints/step-4.pt"], "1", ["--resume", "auto"]),
])
def test_a_scripts_requeued_slurm_attempt_continues_its_run_dir(given, restarts, expected):
    """The emitted job's lines before the script's name, run by bash: the first attempt launches as emitted; a
    requeued one (SLURM_RESTART_COUNT) continues with --resume auto in place of the job's own --overwrite or
    --resume (an --overwrite again would start the first attempt's work over)."""
    from ddp_amp.launch.slurm import _SCRIPT_RESUME

    result = subprocess.run(["bash", "-c", f'{_SCRIPT_RESUME}\nprintf "%s\\n" "$@"', "job", "--nproc-per-node", "2",
                             *given], env={"SLURM_RESTART_COUNT": restarts}, capture_output=True, text=True)
    assert result.stdout.splitlines() == ["--nproc-per-node", "2", *expected], result.stderr
