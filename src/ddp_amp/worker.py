"""The per-rank entry of every launcher: standard environment + run config in, trained model and files out.

spawn calls `run_worker(config)` in each child; torchrun runs `python -m ddp_amp.worker RUN_DIR/config.json`.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddp_amp import checkpoint
from ddp_amp.config import TrainConfig
from ddp_amp.dist import DistEnv, process_group, resolve_device, set_cpu_threads
from ddp_amp.precision import resolve_precision
from ddp_amp.process import die_with_parent
from ddp_amp.tasks import build_task
from ddp_amp.train import Trainer


class LogReporter:
    """Each node's local rank 0 prints one plain line per log interval and appends it to metrics.jsonl (the
    figures are reduced across all ranks already); other ranks stay quiet."""

    def __init__(self, env: DistEnv, run_dir: Path, item_name: str) -> None:
        self.env, self.run_dir, self.item_name = env, run_dir, item_name

    def on_log(self, record: dict[str, Any]) -> None:
        if not self.env.writes_run_dir:
            return
        checkpoint.append_metrics(self.run_dir, record)
        line = (f"[rank {self.env.rank}] step {record['step']}/{record['total_steps']} loss {record['loss']:.4f} "
                f"lr {record['lr']:.1e} {record['samples_per_s']:.0f} samples/s")
        if self.item_name != "samples":
            line += f" {record[self.item_name + '_per_s']:.0f} {self.item_name}/s"
        if "loss_scale" in record:
            line += f" scale {record['loss_scale']:.0f} skipped {record['skipped_steps']}"
        print(line, flush=True)

    def on_end(self, summary: dict[str, Any]) -> None:
        pass


def run_worker(config: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank. Local rank 0 writes the run directory and returns the summary; others return None."""
    started = time.time()
    die_with_parent()
    env = DistEnv.from_environ()
    device = resolve_device(config.device, env.local_rank)
    threads = set_cpu_threads(env.local_world_size) if device.type == "cpu" else torch.get_num_threads()
    precision = resolve_precision(device.type, config.amp, config.dtype,
                                  cuda_bf16=device.type == "cuda" and torch.cuda.is_bf16_supported())
    run_dir = Path(config.run_dir)
    with process_group(env, device):
        torch.manual_seed(config.seed)  # identical initial weights on every rank, run after run
        task = build_task(config.task)
        reporter = LogReporter(env, run_dir, task.item_name)
        result = Trainer(config, env, device, precision, task, reporter).train()
        summary = result.summary
        summary["threads_per_rank"] = threads
        summary["worker_start_s"] = started - (config.launch_time or started)
        if not env.writes_run_dir:
            return None
        if task.evaluate is not None:
            result.model.eval()
            summary["eval"] = task.evaluate(result.model)
        summary["model_path"] = str(checkpoint.save_weights(run_dir, result.model))
        checkpoint.write_summary(run_dir, summary)
        return summary


def main(argv: list[str] | None = None) -> None:
    """`python -m ddp_amp.worker CONFIG_JSON`: the entry torchrun starts on every rank."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        sys.exit("usage: python -m ddp_amp.worker RUN_DIR/config.json")
    config = TrainConfig.from_json(Path(args[0]).read_text())
    if os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" and os.environ.get("RANK") == "0":
        # torchrun restarted the job from the beginning: the earlier attempt's log lines no longer apply.
        (Path(config.run_dir) / checkpoint.METRICS_FILE).unlink(missing_ok=True)
    run_worker(config)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    # record: a failing rank's traceback goes to torchrun's error file, so its summary names the root cause.
    record(main)()
