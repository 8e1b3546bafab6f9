"""Checkpoints and weights files that prove what they hold: the checksum written with each, checked before
anything loads it, and `ddp-amp verify`. Real files, bytes flipped in place as a failing disk leaves them."""

import json
import zlib
from pathlib import Path

import pytest
import torch
from helpers import USER_TASKS, one_line, run_main

from ddp_amp.checkpoint import storage
from ddp_amp.files import atomic_write, checksum_mismatch, file_checksum
from ddp_amp.outputs import save_weights

from helper_tasks import flip_byte

FP32_SGD = ["--device", "cpu", "--amp", "off", "--optimizer", "sgd", "--lr", "0.05", "--schedule", "constant"]


def _state(step: int, seed: int = 0) -> dict:
    """A checkpoint's state as the manager writes one (what load_checkpoint checks it holds)."""
    generator = torch.Generator().manual_seed(seed)
    weights = {"0.weight": torch.randn(64, 8, generator=generator), "0.bias": torch.randn(64, generator=generator)}
    return {"step": step, "trainer": {"model": weights, "optimizer": {}}, "rng": [], "world_size": 2,
            "config": {"launch_time": 1.0}, "saved_at": float(step)}


def _middle_of(path, tensor: torch.Tensor) -> int:
    data, wanted = path.read_bytes(), tensor.contiguous().view(torch.uint8).numpy().tobytes()
    return data.index(wanted) + len(wanted) // 2


def test_the_checksum_is_of_the_bytes_written_and_names_what_differs_after_a_byte_flips(tmp_path):
    data = bytes(range(256)) * 4096
    record = atomic_write(tmp_path / "f", data, checksum=True)
    assert record == {"algorithm": "crc32", "value": f"{zlib.crc32(data):08x}", "bytes": len(data)}
    assert file_checksum(tmp_path / "f") == record and checksum_mismatch(tmp_path / "f", record) is None
    flip_byte(tmp_path / "f", 1000)
    damaged = bytearray(data)
    damaged[1000] ^= 0xFF
    assert checksum_mismatch(tmp_path / "f", record) == (f"its crc32 is {zlib.crc32(damaged):08x}, "
                                                        f"{record['value']} recorded")
    assert checksum_mismatch(tmp_path / "f", {**record, "bytes": 5}) == f"{len(data)} bytes, 5 recorded"


def test_a_checkpoint_with_a_flipped_byte_is_skipped_for_the_one_before_with_one_warning(tmp_path):
    for step in (10, 20):
        storage.save_checkpoint(tmp_path, _state(step, seed=step), keep=5)
    newest = tmp_path / "checkpoints" / "step-20.pt"
    assert torch.load(newest, weights_only=True)["step"] == 20
    flip_byte(newest, _middle_of(newest, _state(20, seed=20)["trainer"]["model"]["0.weight"]))
    torch.load(newest, weights_only=True)  # it still loads: only the checksum tells
    with pytest.raises(storage.CheckpointError, match=f"^{newest}: damaged, its crc32 is [0-9a-f]{{8}}, "
                                                      "[0-9a-f]{8} recorded$"):
        storage.load_checkpoint(newest)
    warnings = []
    path, state = storage.newest_valid_checkpoint(tmp_path, warn=warnings.append)
    assert (path.name, state["step"]) == ("step-10.pt", 10)
    assert len(warnings) == 1 and warnings[0].startswith(f"skipping checkpoint {newest}: damaged, its crc32 is ")


def test_a_checkpoint_written_before_checksums_loads_and_says_nothing(tmp_path, capsys):
    path = storage.save_checkpoint(tmp_path, _state(10), keep=2, checksum=False)
    assert "checksum" not in json.loads(storage.sidecar(path).read_text())
    warnings = []
    assert storage.newest_valid_checkpoint(tmp_path, warn=warnings.append)[0] == path and warnings == []
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 0 and out.splitlines() == [
        f"unchecked  {path}: no checksum recorded (written before checksums)", "1 file: 0 ok, 1 unchecked"]


def test_verify_checks_a_runs_checkpoints_and_weights_without_training(tmp_path, capsys):
    for step in (10, 20):
        storage.save_checkpoint(tmp_path, _state(step, seed=step), keep=5)
    weights = _state(0, seed=3)["trainer"]["model"]
    model = save_weights(tmp_path, weights)
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    checkpoints = tmp_path / "checkpoints"
    assert code == 0 and out.splitlines() == [f"ok         {checkpoints / 'step-20.pt'}",
                                              f"ok         {checkpoints / 'step-10.pt'}", f"ok         {model}",
                                              "3 files: 3 ok"]
    flip_byte(model, _middle_of(model, weights["0.bias"]))
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 1 and out.splitlines()[2].startswith(f"damaged    {model}: its crc32 is ")
    assert out.splitlines()[-1] == "3 files: 2 ok, 1 damaged"
    code, _, err = run_main(["verify", str(tmp_path / "nothing")], capsys)
    assert code == 2 and one_line(err) == f"ddp-amp: error: verify {tmp_path / 'nothing'}: no such file or directory"


def test_init_from_a_model_pt_whose_checksum_does_not_match_is_refused_before_launch(tmp_path, capsys):
    weights = {"0.weight": torch.randn(5, 8), "0.bias": torch.randn(5), "2.weight": torch.randn(1, 5),
               "2.bias": torch.randn(1)}
    model = save_weights(tmp_path, weights)
    flip_byte(model, _middle_of(model, weights["0.weight"]))
    code, _, err = run_main(["spawn", "-n", "2", *FP32_SGD, "--task", f"{USER_TASKS}:sized", "--task-arg", "width=5",
                             "--steps", "1", "--init-from", str(model), "--run-dir", str(tmp_path / "run")], capsys)
    assert code == 2
    assert one_line(err).startswith(f"ddp-amp: error: --init-from {model}: damaged, its crc32 is "), err
    assert not (tmp_path / "run").exists()


def test_a_sidecar_that_no_longer_parses_makes_its_checkpoint_damaged_not_unchecked(tmp_path):
    """A sidecar is written atomically: one that does not parse was damaged after, and with it the record of
    what the checkpoint holds; the checkpoint is skipped, not loaded unchecked."""
    path = storage.save_checkpoint(tmp_path, _state(10), keep=2)
    text = storage.sidecar(path).read_text()
    storage.sidecar(path).write_text(text[:20] + "\x00" + text[21:])
    with pytest.raises(storage.CheckpointError, match="damaged, its step-10.json is unreadable$"):
        storage.load_checkpoint(path)



@pytest.mark.parametrize("name", ["model.pt", "model_best.pt"])
@pytest.mark.parametrize("bytes_of", [lambda whole: b"", lambda whole: bytes(range(256)) * 4,
                                      lambda whole: whole[:len(whole) // 2]], ids=["empty", "random", "truncated"])
def test_verify_of_weights_without_a_checksum_that_cannot_load_is_unreadable(tmp_path, capsys, name, bytes_of):
    weights = _state(0, seed=3)["trainer"]["model"]
    paths = {other: save_weights(tmp_path, weights, other) for other in ("model.pt", "model_best.pt")}
    path = paths[name]
    (tmp_path / f"{name}.checksum").unlink()
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 0 and f"unchecked  {path}: no checksum recorded beside it" in out.splitlines()
    path.write_bytes(bytes_of(path.read_bytes()))
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 1 and any(line.startswith(f"unreadable {path}: ") for line in out.splitlines()), out
    assert out.splitlines()[-1] == "2 files: 1 ok, 1 unreadable"


def test_verify_names_a_checkpoint_and_a_weights_file_missing_beside_their_records(tmp_path, capsys):
    """ddp-amp writes a file before its record and removes the record first: a record without its file is a
    file lost (a copy that left it out, a deletion), never a state a launch leaves."""
    for step in (10, 20):
        storage.save_checkpoint(tmp_path, _state(step, seed=step), keep=5)
    model = save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    checkpoints = tmp_path / "checkpoints"
    (checkpoints / "step-20.pt").unlink()
    model.unlink()
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 1 and out.splitlines() == [
        f"ok         {checkpoints / 'step-10.pt'}",
        f"damaged    {checkpoints / 'step-20.pt'}: missing (its step-20.json is there)",
        f"damaged    {model}: missing (its model.pt.checksum is there)",
        "3 files: 1 ok, 2 damaged"]


def test_verify_of_a_run_dir_holding_only_a_weights_files_record_names_the_file_missing(tmp_path, capsys):
    model = save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    model.unlink()
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 1 and out.splitlines() == [f"damaged    {model}: missing (its model.pt.checksum is there)",
                                              "1 file: 0 ok, 1 damaged"]


@pytest.mark.parametrize("record", ["checkpoints/step-10.json", "model.pt.checksum"])
def test_verify_of_a_checksum_record_is_refused_naming_the_file_it_records(record, tmp_path, capsys):
    storage.save_checkpoint(tmp_path, _state(10), keep=2)
    save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    recorded = {"checkpoints/step-10.json": "checkpoints/step-10.pt", "model.pt.checksum": "model.pt"}[record]
    code, out, err = run_main(["verify", str(tmp_path / record)], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == (f"ddp-amp: error: verify {tmp_path / record}: the record written beside "
                             f"{tmp_path / recorded}, not a checkpoint or weights file; verify "
                             f"{tmp_path / recorded} or the run directory")


@pytest.mark.parametrize("name", ["config.json", "metrics.jsonl", "logs/rank0.log"])
def test_verify_of_a_runs_text_file_is_refused_not_called_unreadable(name, tmp_path, capsys):
    save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    (tmp_path / name).parent.mkdir(exist_ok=True)
    (tmp_path / name).write_text("{}\n")
    code, out, err = run_main(["verify", str(tmp_path / name)], capsys)
    assert code == 2 and out == ""
    assert one_line(err) == (f"ddp-amp: error: verify {tmp_path / name}: a {Path(name).suffix} file, not a "
                             "checkpoint or weights file; verify the run directory, a checkpoint or a weights file")


def _sharded_checkpoint(run_dir):
    """A sharded checkpoint's directory as DCP and rank 0 leave it (parts, .metadata, extras.pt, the manifest of
    their checksums), its parts' bytes made up: verify checks their checksums before it reads any."""
    from ddp_amp.checkpoint import sharded

    path = run_dir / "checkpoints" / "step-10"
    path.mkdir(parents=True)
    for name in ("__0_0.distcp", "__1_0.distcp", sharded.DCP_METADATA_FILE, sharded.EXTRAS_FILE):
        (path / name).write_bytes(name.encode() * 100)
    sharded.write_checksums(path, {})
    storage.write_sidecar(path, _state(10))
    return path


@pytest.mark.parametrize("lost", [".metadata", "extras.pt", "__1_0.distcp"])
def test_verify_of_a_sharded_checkpoint_with_a_part_lost_names_the_part_whether_given_or_found(lost, tmp_path,
                                                                                              capsys):
    path = _sharded_checkpoint(tmp_path)
    (path / lost).unlink()
    for given in (tmp_path, path):
        code, out, _ = run_main(["verify", str(given)], capsys)
        assert code == 1 and out.splitlines() == [f"damaged    {path}: its part {lost} is missing",
                                                  "1 file: 0 ok, 1 damaged"], given


def test_verify_of_a_checksum_of_an_algorithm_it_does_not_know_is_unchecked_not_ok(tmp_path, capsys):
    path = storage.save_checkpoint(tmp_path, _state(10), keep=2)
    model = save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    sidecar = json.loads(storage.sidecar(path).read_text())
    storage.sidecar(path).write_text(json.dumps({**sidecar, "checksum": {**sidecar["checksum"], "algorithm": "x"}}))
    (tmp_path / "model.pt.checksum").write_text(json.dumps({"algorithm": "x", "value": "0", "bytes": 1}))
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 0 and out.splitlines() == [
        f"unchecked  {path}: its checksum is of an algorithm this version does not know ('x')",
        f"unchecked  {model}: its checksum is of an algorithm this version does not know ('x')",
        "2 files: 0 ok, 2 unchecked"]


def test_a_checkpoint_pruned_while_verify_reads_the_run_is_left_out_not_damaged(tmp_path, capsys, monkeypatch):
    """A launch still training prunes checkpoints (--keep): one verify listed and that is gone when it reads it
    was not damaged."""
    for step in (10, 20):
        storage.save_checkpoint(tmp_path, _state(step, seed=step), keep=5)
    pruned = tmp_path / "checkpoints" / "step-10.pt"
    load = storage.load_checkpoint

    def pruned_first(path, **kwargs):
        if path == pruned:  # the launch prunes it as storage.prune does: its sidecar, then the file
            storage.sidecar(pruned).unlink()
            pruned.unlink()
        return load(path, **kwargs)

    monkeypatch.setattr(storage, "load_checkpoint", pruned_first)
    code, out, _ = run_main(["verify", str(tmp_path)], capsys)
    assert code == 0 and out.splitlines() == [f"ok         {tmp_path / 'checkpoints' / 'step-20.pt'}",
                                              "1 file: 1 ok"]


def test_a_weights_file_beside_a_manifest_of_its_own_is_no_piece_of_a_sharded_checkpoint(tmp_path):
    """A user's folder holding model.pt and a checksums.json of its own is not a sharded checkpoint's directory;
    one that also holds a part (or extras.pt) is, its model.pt refused as a piece of it."""
    (tmp_path / "checksums.json").write_text("{}")
    save_weights(tmp_path, _state(0, seed=3)["trainer"]["model"])
    assert storage.part_of_a_checkpoint(tmp_path / "model.pt") is None
    (tmp_path / "__0_0.distcp").write_bytes(b"part")
    assert storage.part_of_a_checkpoint(tmp_path / "model.pt") == (
        f"a file of the sharded checkpoint {tmp_path}, not a checkpoint; give {tmp_path}")
