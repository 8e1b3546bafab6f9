"""--dtype bf16-true on 2-rank gloo runs: resumes bit-exactly, passes checkpoints to and from other precisions,
trains to fp32's loss, and under --shard full all-gathers half the bytes. (The update below a bf16 ulp:
tests/unit/test_train_core.py; on GPUs: tests/system/test_gpu.py.)"""

import pytest
from helpers import assert_ok, read_summary, run_cli

from helper_tasks import ALL_GATHERS_DIR_VAR

COMMON = ["spawn", "-n", "2", "--device", "cpu", "--steps", "20", "--log-every", "10"]


def test_bf16_true_resumes_bit_exactly_and_its_checkpoints_pass_between_precisions(tmp_path):
    """A bf16-true run checkpointed at step 10 and resumed from it ends on the whole run's model.pt, byte for
    byte; the same checkpoint resumes in fp32 (from the fp32 masters it holds), and an fp32 run's checkpoint
    resumes in bf16-true. The whole runs end within 2% of each other's loss."""
    runs = {}
    for name, precision in (("true", ["--dtype", "bf16-true"]), ("fp32", ["--amp", "off"])):
        assert_ok(run_cli(*COMMON, "--task", "mlp", *precision, "--checkpoint-every", "10",
                          "--run-dir", str(tmp_path / name), timeout=300))
        runs[name] = read_summary(tmp_path / name)
    assert runs["true"]["precision"] == "bf16-true" and runs["fp32"]["precision"] == "fp32"
    assert runs["true"]["final_loss"] == pytest.approx(runs["fp32"]["final_loss"], rel=0.02)
    for source, resumed, precision in (("true", "true-again", ["--dtype", "bf16-true"]),
                                       ("true", "as-fp32", ["--amp", "off"]),
                                       ("fp32", "as-true", ["--dtype", "bf16-true"])):
        checkpoint = tmp_path / source / "checkpoints" / "step-10.pt"
        assert_ok(run_cli(*COMMON, "--task", "mlp", *precision, "--resume", str(checkpoint),
                          "--run-dir", str(tmp_path / resumed), timeout=300))
        summary = read_summary(tmp_path / resumed)
        assert summary["steps"] == 20 and summary["resumed_from_step"] == 10
    assert (tmp_path / "true-again" / "model.pt").read_bytes() == (tmp_path / "true" / "model.pt").read_bytes()
    assert read_summary(tmp_path / "as-fp32")["precision"] == "fp32"
    assert read_summary(tmp_path / "as-true")["precision"] == "bf16-true"


def test_the_compiled_master_step_resumes_bit_exactly_and_its_checkpoint_resumes_in_the_fused_step(tmp_path):
    """--optimizer-impl compiled on 2 ranks: what it reports, a resume from its step-10 checkpoint ending on the
    whole run's model.pt byte for byte, and the same checkpoint resumed by the default fused step (torch's
    AdamW state_dict both ways) ending within 1% of its loss."""
    compiled = ["--task", "mlp", "--dtype", "bf16-true", "--optimizer-impl", "compiled"]
    assert_ok(run_cli(*COMMON, *compiled, "--checkpoint-every", "10", "--run-dir", str(tmp_path / "whole"),
                      timeout=300))
    whole = read_summary(tmp_path / "whole")
    assert whole["optimizer_impl"] == "compiled" and whole["precision"] == "bf16-true"
    checkpoint = tmp_path / "whole" / "checkpoints" / "step-10.pt"
    for name, flags in (("again", compiled), ("fused", ["--task", "mlp", "--dtype", "bf16-true"])):
        assert_ok(run_cli(*COMMON, *flags, "--resume", str(checkpoint), "--run-dir", str(tmp_path / name),
                          timeout=300))
        assert read_summary(tmp_path / name)["resumed_from_step"] == 10
    assert (tmp_path / "again" / "model.pt").read_bytes() == (tmp_path / "whole" / "model.pt").read_bytes()
    fused = read_summary(tmp_path / "fused")
    assert fused["optimizer_impl"] == "fused"
    assert fused["final_loss"] == pytest.approx(whole["final_loss"], rel=0.01)


def test_the_transformer_in_bf16_true_ends_within_2_percent_of_fp32s_loss(tmp_path):
    losses = {}
    for name, precision in (("true", ["--dtype", "bf16-true"]), ("fp32", ["--amp", "off"])):
        assert_ok(run_cli(*COMMON, "--task", "transformer", *precision, "--run-dir", str(tmp_path / name),
                          timeout=300))
        losses[name] = read_summary(tmp_path / name)["final_loss"]
    assert losses["true"] == pytest.approx(losses["fp32"], rel=0.02)


def test_shard_full_in_bf16_true_all_gathers_half_the_bytes(tmp_path, helper_task):
    """FSDP2's MixedPrecisionPolicy(param_dtype=bf16): every all-gather moves bf16 shards of the fp32 masters,
    counted at FSDP2's collective on each rank: the same all-gathers as an fp32 run, each of half its bytes."""
    counted = {}
    for name, precision in (("true", ["--dtype", "bf16-true"]), ("fp32", ["--amp", "off"])):
        gathers = tmp_path / f"gathers-{name}"
        gathers.mkdir()
        assert_ok(run_cli("spawn", "-n", "2", "--device", "cpu", "--steps", "4", "--shard", "full", "--task",
                          helper_task("counted_all_gathers"), *precision, "--run-dir", str(tmp_path / name),
                          env={ALL_GATHERS_DIR_VAR: str(gathers)}, timeout=300))
        counted[name] = [[int(line) for line in (gathers / f"rank{rank}.txt").read_text().split()] for rank in (0, 1)]
        assert read_summary(tmp_path / name)["shard"] == "full"
    for rank in (0, 1):
        true, fp32 = counted["true"][rank], counted["fp32"][rank]
        assert len(true) == len(fp32) > 0
        assert [2 * b for b in true] == fp32


def _masters_rank(rank: int, port: int, out: str) -> None:
    """One rank of a 2-rank gloo group: a model initialised differently on each rank (as numpy- or random-seeded
    initialisation is), set up for bf16-true; writes its masters and its model's bf16 weights.

    The DDP wrapper is freed before the group is destroyed, as `Trainer.close` does: a wrapper left to the
    garbage collector takes the gloo group's last reference with it, and the group's destructor can then abort
    the rank at exit ("terminate called without an active exception", seen once in a clean-clone CI run)."""
    import gc
    import os

    import torch
    import torch.distributed as dist

    from ddp_amp.config import TrainConfig
    from ddp_amp.parallel.ddp import DDPStrategy
    from ddp_amp.precision import Precision

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(rank)
        model = torch.nn.Linear(4, 3)
        initial = {k: v.clone() for k, v in model.state_dict().items()}
        strategy = DDPStrategy(TrainConfig(dtype="bf16-true", amp="on"), torch.device("cpu"), Precision("bf16-true"))
        wrapped = strategy.setup_module(model)
        masters = strategy.masters.state_with_masters(model.state_dict())
        torch.save({"initial": initial, "masters": masters, "model": model.state_dict()},
                   os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        del wrapped, strategy
        gc.collect()
    finally:
        dist.destroy_process_group()


def test_every_ranks_masters_are_rank_0s_weights_after_ddp_wraps_the_model(tmp_path):
    """DDP hands rank 0's (bf16) weights to every rank when it wraps the model; the fp32 masters, taken before,
    are made rank 0's too. Without that, ranks whose initialisation differed would step apart for good."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_masters_rank, args=(port, str(tmp_path)), nprocs=2)
    rank0, rank1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    assert not torch.equal(rank0["initial"]["weight"], rank1["initial"]["weight"])
    for name in ("weight", "bias"):
        assert torch.equal(rank1["masters"][name], rank0["initial"][name])
        assert torch.equal(rank0["masters"][name], rank0["initial"][name])
        assert torch.equal(rank1["model"][name], rank0["initial"][name].bfloat16())
