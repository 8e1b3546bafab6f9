"""--amp auto on real CPU ranks: every rank takes rank 0's answer, and a run measures, reports and caches it
for the next run."""

import json
import os

import pytest
import torch
from helpers import free_port, read_summary, run_cli

from ddp_amp import precision
from ddp_amp.rank import amp_probe


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("DDP_AMP_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"



def _agreement_rank(rank: int, port: int, cache_root: str, planted: tuple[str, str], out: str) -> None:
    """One rank of a real 2-rank gloo group, with a cache of its own whose planted answer differs per rank."""
    import torch.distributed as dist

    from ddp_amp.dist import DistEnv
    from ddp_amp.tasks import build_task

    os.environ["DDP_AMP_CACHE_DIR"] = os.path.join(cache_root, str(rank))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        task = build_task("mlp")
        shapes = amp_probe.layer_shapes(task.model, amp_probe._first_samples(task, 8))
        key = precision.amp_cache_key(torch.__version__, torch.get_num_threads(), shapes, task="mlp x8")
        precision.remember_amp_choice(key, {"choice": planted[rank], "bf16_speedup": 1.0, "bf16_true_pass_s": 1.0})
        env = DistEnv(rank=rank, local_rank=rank, world_size=2, local_world_size=2, master_addr="127.0.0.1",
                      master_port=port)
        chosen, found = amp_probe.measured_precision(task, env, torch.device("cpu"), samples=8, spec="mlp")
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump({"precision": chosen.name, "cached": found["cached"]}, f)
    finally:
        dist.destroy_process_group()


def test_every_rank_takes_rank_0s_answer(tmp_path):
    """Rank 0's cache says bf16 and rank 1's fp32: both ranks train in bf16."""
    import torch.multiprocessing as mp

    mp.spawn(_agreement_rank, args=(free_port(), str(tmp_path / "caches"), ("bf16", "fp32"), str(tmp_path)),
             nprocs=2)
    answers = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert [a["precision"] for a in answers] == ["bf16", "bf16"]
    assert all(a["cached"] for a in answers)


def _done_events(stdout: str) -> dict[int, dict]:
    events = [json.loads(line) for line in stdout.splitlines() if line.startswith("{")]
    return {e["rank"]: e for e in events if e["type"] == "done"}


def test_a_run_measures_reports_and_caches_then_the_next_run_uses_the_cache(tmp_path, cache_dir):
    args = ["spawn", "-n", "2", "--device", "cpu", "--task", "mlp", "--steps", "3", "--batch-size", "16",
            "--amp", "auto", "--log-format", "json"]
    first = run_cli(*args, "--run-dir", str(tmp_path / "first"))
    assert first.returncode == 0, first.stderr
    summary = read_summary(tmp_path / "first")
    probe = summary["amp_auto"]
    assert probe["cached"] is False and probe["choice"] in ("fp32", "bf16", "bf16-true")
    assert probe["fp32_pass_s"] > 0 and probe["bf16_pass_s"] > 0 and probe["bf16_true_pass_s"] > 0
    assert probe["bf16_speedup"] == pytest.approx(probe["fp32_pass_s"] / probe["bf16_pass_s"])
    assert probe["bf16_true_speedup"] == pytest.approx(probe["fp32_pass_s"] / probe["bf16_true_pass_s"])
    assert summary["precision"] == probe["choice"] == amp_probe.decide(probe["fp32_pass_s"], probe["bf16_pass_s"],
                                                                       probe["bf16_true_pass_s"])
    assert f"at {probe['bf16_speedup']:.2f}x fp32's speed" in probe["reason"]
    assert "precision measured at start-up" in first.stderr + first.stdout
    events = [json.loads(line) for line in first.stdout.splitlines() if line.startswith("{")]
    assert [e["precision"] for e in events if e["type"] == "precision"] == [probe["choice"]]
    assert {r: e["precision"] for r, e in _done_events(first.stdout).items()} == {0: probe["choice"],
                                                                                  1: probe["choice"]}
    cache = json.loads((cache_dir / precision.AMP_CACHE_FILE).read_text())
    assert list(cache) == [probe["key"]] and cache[probe["key"]]["choice"] == probe["choice"]

    # The answer flipped in the cache: a second run takes it as it is, without probing.
    flipped = {"fp32": "bf16", "bf16": "fp32"}[probe["choice"]]
    cache[probe["key"]]["choice"] = flipped
    (cache_dir / precision.AMP_CACHE_FILE).write_text(json.dumps(cache))
    second = run_cli(*args, "--run-dir", str(tmp_path / "second"))
    assert second.returncode == 0, second.stderr
    summary = read_summary(tmp_path / "second")
    assert summary["amp_auto"]["cached"] is True
    assert summary["precision"] == flipped and "(cached)" in summary["amp_auto"]["reason"]
    assert {r: e["precision"] for r, e in _done_events(second.stdout).items()} == {0: flipped, 1: flipped}

    shown = run_cli("env")
    assert shown.returncode == 0 and probe["key"] in shown.stdout and f"{flipped}: bf16" in shown.stdout
