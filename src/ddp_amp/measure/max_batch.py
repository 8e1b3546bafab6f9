"""`ddp-amp bench --max-batch`, the launcher's side: one launch per precision whose ranks search the largest
batch that trains (train.batch_search), and the report of what they found."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from ddp_amp.measure.bench import BenchOptions, environment


def host_memory_share_gib(nproc: int) -> float:
    """A CPU rank's share of this host's memory, less a fifth for everything else: the cap bench --max-batch
    puts on CPU ranks without --max-memory, so the allocator fails cleanly before the kernel's OOM killer
    does."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") * 0.8 / nproc / 2**30


def run_max_batch(train_options: dict[str, Any], options: BenchOptions, *, nproc: int, run_root: Path,
                  status=print) -> dict[str, Any]:
    """bench --max-batch: per precision (fp32 and the AMP dtype) one launch that searches the largest per-rank
    batch that trains (train.batch_search), and the throughput at it."""
    from ddp_amp.launch.session import launch_quietly
    from ddp_amp.train.batch_search import TRIAL_STEPS

    results: dict[str, Any] = {}
    plan = None
    for mode in options.modes:
        run_options = {**train_options, "amp": mode, "steps": 1, "log_every": 1}
        if mode == "off":
            run_options["dtype"] = "auto"
        run_dir = run_root / f"max-batch-{mode}"
        plan = launch_quietly(run_options, run_dir, nproc=nproc, launcher=options.launcher, kind="max-batch")
        summary = json.loads((run_dir / "summary.json").read_text())
        found = summary["max_batch_search"]
        results[summary["precision"]] = {**found, "peak_memory_mb": summary["peak_memory_mb"]}
        status(f"bench: largest batch per rank in {summary['precision']}: {found['max_batch']} "
               f"({len(found['trials'])} trials)")
    report: dict[str, Any] = {"max_batch": results, "notes": []}
    amp = next((p for p in results if p != "fp32"), None)
    if "fp32" in results and amp and results["fp32"]["max_batch"]:
        report["max_batch_ratio"] = {"amp": amp, "ratio": results[amp]["max_batch"] / results["fp32"]["max_batch"]}
    tf32 = train_options.get("tf32")
    first = json.loads((run_root / f"max-batch-{options.modes[0]}" / "summary.json").read_text())
    env = environment(plan.device_type, nproc, first, None if tf32 is None else tf32 == "on")
    env["max_memory_gb"] = train_options.get("max_memory")
    report["environment"] = env
    report["method"] = {"search": "doubling from --batch-size, then bisecting to within 1/16",
                        "trial_steps": TRIAL_STEPS, "launcher": options.launcher, "nproc": nproc,
                        "task": train_options["task"], "run_root": str(run_root)}
    return report
