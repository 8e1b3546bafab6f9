"""What reading the loss scale around every fp16 step cost: the old skip detection (GradScaler.get_scale()
before and after update(), two host syncs a step) against the step hook now in the core, interleaved, medians.

    .venv/bin/python benchmarks/fp16_skip_sync.py [--repeats 5] [--steps 60] [--device cpu|cuda]

One rank in this process (a real one-rank gloo/nccl group), the mlp task under fp16 autocast + GradScaler.
On a CPU every "sync" returns at once (nothing runs asynchronously), so a ratio near 1 is expected there; on a
GPU the syncs stop the host from queuing the next step while the device works.
"""

import argparse
import os
import statistics
import tempfile

import torch
from common import spread
from torch.distributed import TCPStore

from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, process_group
from ddp_amp.launch.spawn import rank_environment
from ddp_amp.precision import Precision
from ddp_amp.tasks import build_task
from ddp_amp.train.step import AmpStep
from ddp_amp.train.trainer import Trainer


class Quiet:
    def on_log(self, record):
        pass


def scale_reading_step(step: AmpStep):
    """The previous detection: compare the scale around update() (each get_scale() waits for the device)."""

    def optimizer_step() -> bool:  # in place of train.update.OptimizerUpdate.step
        scale_before = step.scaler.get_scale()
        step.scaler.step(step.optimizer)
        step.scaler.update()
        return step.scaler.get_scale() >= scale_before

    return optimizer_step


def steps_per_s(read_scale: bool, device: torch.device, env: DistEnv, steps: int, run_dir: str) -> float:
    config = TrainConfig(task="mlp", steps=steps, log_every=steps, dtype="fp16", amp="on", batch_size=128,
                         run_dir=run_dir)
    torch.manual_seed(0)
    trainer = Trainer(config, env, device, Precision("fp16"), build_task("mlp"), Quiet())
    if read_scale:
        trainer.step.update.step = scale_reading_step(trainer.step)
    summary = trainer.train().summary  # steady state: the first steps (DDP's bucket rebuild...) excluded
    trainer.close()
    return summary["rank_samples_per_s"] / config.batch_size


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    device = torch.device(args.device, 0) if args.device == "cuda" else torch.device("cpu")
    store = TCPStore("127.0.0.1", 0, world_size=1, is_master=True, wait_for_workers=False)
    os.environ.update(rank_environment(0, 1, store.port))
    results = {"get_scale x2": [], "step hook": []}
    with tempfile.TemporaryDirectory() as tmp, process_group(DistEnv.from_environ(), device):
        for _ in range(args.repeats):
            for name, read_scale in (("get_scale x2", True), ("step hook", False)):
                results[name].append(steps_per_s(read_scale, device, DistEnv.from_environ(), args.steps, tmp))
    print(f"fp16 mlp, batch 128, one rank on {device}, {args.steps} steps x {args.repeats} interleaved repeats")
    for name, values in results.items():
        print(f"{name:<14} steps/s {spread(values, '.1f')}")
    ratios = [new / old for new, old in zip(results["step hook"], results["get_scale x2"])]
    print(f"step hook / get_scale x2: {spread(ratios, '.3f')} (median {statistics.median(ratios):.3f})")


if __name__ == "__main__":
    main()
