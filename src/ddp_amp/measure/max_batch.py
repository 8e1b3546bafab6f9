"""`ddp-amp bench --max-batch`, the launcher's side: one launch per precision whose ranks search the largest
batch that trains (train.batch_search), and the report of what they found."""

from __future__ import annotations

import io
import os
import sys
from pathlib import Path
from typing import Any

from ddp_amp.measure.bench import BenchOptions
from ddp_amp.measure.environment import environment
from ddp_amp.outputs import OUT_OF_MEMORY_FILE, read_summary
from ddp_amp.parallel import MODES


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
    plan, first = None, None
    by_launches = MODES[train_options.get("shard", "none")].one_size_per_launch
    for mode in options.modes:
        run_options = {**train_options, "amp": mode, "steps": 1, "log_every": 1}
        if mode == "off":
            run_options["dtype"] = "auto"
        run_dir = run_root / f"max-batch-{mode}"
        if by_launches:
            plan, summary, found = _search_by_launches(run_options, run_dir, nproc=nproc, launcher=options.launcher)
        else:
            plan = launch_quietly(run_options, run_dir, nproc=nproc, launcher=options.launcher, kind="max-batch")
            summary = read_summary(run_dir)
            found = summary.max_batch_search
        first = first or summary
        results[summary.precision] = {**found, "peak_memory_mb": summary.peak_memory_mb}
        status(f"bench: largest batch per rank in {summary.precision}: {found['max_batch']} "
               f"({len(found['trials'])} trials)")
    report: dict[str, Any] = {"max_batch": results, "notes": []}
    amp = next((p for p in results if p != "fp32"), None)
    if "fp32" in results and amp and results["fp32"]["max_batch"]:
        report["max_batch_ratio"] = {"amp": amp, "ratio": results[amp]["max_batch"] / results["fp32"]["max_batch"]}
    tf32 = train_options.get("tf32")
    env = environment(plan.device_type, first, None if tf32 is None else tf32 == "on")
    env["max_memory_gb"] = train_options.get("max_memory")
    report["environment"] = env
    report["method"] = {"search": "doubling from --batch-size, then bisecting to within 1/16",
                        "trial_steps": TRIAL_STEPS,
                        "launch_per_trial": by_launches, "launcher": options.launcher, "nproc": nproc,
                        "task": train_options["task"], "run_root": str(run_root)}
    return report


def _search_by_launches(run_options: dict[str, Any], run_dir: Path, *, nproc: int, launcher: str
                        ) -> tuple[Any, dict[str, Any], dict[str, Any]]:
    """--shard full: the same doubling and bisecting, one launch per size (RUN_DIR/batch-<size>). A sharded
    pass holds collectives, so a rank that runs out of memory inside one cannot tell the others; its launch
    fails, and the out-of-memory record it left (outputs.OUT_OF_MEMORY_FILE) makes that size one that does not
    fit. Any other failure is the command's. (plan, the largest fitting size's summary, the search's report)."""
    from ddp_amp.errors import RunFailed
    from ddp_amp.launch.session import launch_quietly
    from ddp_amp.train.batch_search import search

    trials: list[dict[str, Any]] = []
    fitted: dict[int, tuple[Any, dict[str, Any]]] = {}

    def trial(size: int) -> float | None:
        trial_dir, errors = run_dir / f"batch-{size}", io.StringIO()  # a size that does not fit is no error
        try:
            plan = launch_quietly({**run_options, "batch_size": size}, trial_dir, nproc=nproc, launcher=launcher,
                                  kind="max-batch", errors=errors)
        except RunFailed:
            if not any(trial_dir.glob(OUT_OF_MEMORY_FILE.format(rank="*"))):
                sys.stderr.write(errors.getvalue())
                raise
            trials.append({"batch": size, "fits": False})
            return None
        summary = read_summary(trial_dir)
        trials.extend(summary.max_batch_search["trials"])
        fitted[size] = plan, summary
        return summary.max_batch_search["samples_per_s"]

    largest, rate = search(trial, run_options["batch_size"])
    if not fitted:
        raise RunFailed(f"--batch-size {run_options['batch_size']} and every smaller size tried ran out of memory "
                        "under --shard full")
    plan, summary = fitted[largest]
    return plan, summary, {"max_batch": largest, "samples_per_s": rate, "trials": trials}
