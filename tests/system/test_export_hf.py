"""export --hf builds the user's model to call its save_pretrained, in a child interpreter, never in the
command's own process: the model built there, the user's code failing there (one line, exit 1, nothing written).
export is run in this process through the CLI's own main; each test starts that child (about 2.5 s, importing
torch), hence this tier. export's other refusals: tests/unit/test_launch_refusals.py."""

import os

import pytest
import torch
from helpers import USER_TASKS, finished_run_dir, one_line, pretrained_weights, run_main

pytestmark = pytest.mark.slow

def test_export_hf_of_a_model_without_save_pretrained_writes_nothing_not_even_the_o_file(tmp_path, capsys):
    run_dir = finished_run_dir(tmp_path, "mlp", {"w": torch.ones(2)})
    before = sorted(tmp_path.iterdir())
    code, _, err = run_main(["export", str(run_dir), "-o", str(tmp_path / "a.pt"), "--hf", str(tmp_path / "hf")],
                            capsys)
    assert code == 2 and "--hf: the model of --task mlp has no save_pretrained" in one_line(err)
    assert sorted(tmp_path.iterdir()) == before


def test_export_hf_builds_the_users_model_in_a_child_not_in_the_cli(tmp_path, capsys, monkeypatch):
    run_dir = finished_run_dir(tmp_path, f"{USER_TASKS}:saves_pretrained", pretrained_weights())
    monkeypatch.setenv("DDP_AMP_TEST_FACTORY_PID", str(tmp_path / "pid"))
    code, _, err = run_main(["export", str(run_dir), "-o", str(tmp_path / "a.pt"), "--hf", str(tmp_path / "hf")],
                            capsys)
    assert code == 0, err
    assert int((tmp_path / "pid").read_text()) != os.getpid()
    for path in (tmp_path / "a.pt", tmp_path / "hf" / "pytorch_model.bin"):
        assert torch.equal(torch.load(path, weights_only=True)["linear.weight"], torch.ones(1, 8))


@pytest.mark.parametrize("variable, expected", [
    ("DDP_AMP_TEST_FACTORY_RAISES", "--task {task}: building its model for --hf failed: ValueError: boom"),
    ("DDP_AMP_TEST_SAVE_PRETRAINED_RAISES", "--hf '{hf}': save_pretrained of the model of --task {task} failed: "
                                            "OSError: boom"),
    ("DDP_AMP_TEST_SAVE_PRETRAINED_RAISES=exit", "--hf '{hf}': save_pretrained of the model of --task {task} "
                                                 "failed: it called sys.exit(3)")])
def test_the_users_code_failing_in_export_hf_is_one_line_exit_1_and_leaves_nothing(tmp_path, capsys, monkeypatch,
                                                                                   variable, expected):
    task = f"{USER_TASKS}:saves_pretrained"
    run_dir = finished_run_dir(tmp_path, task, pretrained_weights())
    variable, _, value = variable.partition("=")
    monkeypatch.setenv(variable, value or "boom")
    before = sorted(tmp_path.iterdir())
    code, _, err = run_main(["export", str(run_dir), "-o", str(tmp_path / "a.pt"), "--hf", str(tmp_path / "hf")],
                            capsys)
    assert code == 1 and one_line(err) == "ddp-amp: error: " + expected.format(task=task, hf=tmp_path / "hf")
    assert sorted(tmp_path.iterdir()) == before
