"""Helpers shared by the benchmarks: run ddp-amp as a user would and read its summary."""

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def machine_cpu_s() -> float:
    """CPU seconds (user + nice + system) all cores have spent since boot, from /proc/stat: the difference
    around a launch counts every process it started (the fork server's ranks, which no rusage of ours sees), and
    whatever else ran meanwhile."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
    return sum(int(v) for v in fields[1:4]) / os.sysconf("SC_CLK_TCK")


def run_ddp_amp(args: list[str], run_dir: Path, env: dict[str, str] | None = None) -> dict:
    """One `python -m ddp_amp ARGS --run-dir RUN_DIR`; its summary.json plus the process's own wall time and the
    machine's CPU seconds while it ran."""
    started, cpu = time.perf_counter(), machine_cpu_s()
    subprocess.run([sys.executable, "-m", "ddp_amp", *args, "--run-dir", str(run_dir)], check=True,
                   capture_output=True, env=env)
    summary = json.loads((run_dir / "summary.json").read_text())
    summary["process_wall_s"] = time.perf_counter() - started
    summary["machine_cpu_s"] = machine_cpu_s() - cpu
    return summary


def spread(values: list[float], fmt: str = ".2f") -> str:
    """median [min-max]"""
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def interleaved(base: list[str], modes: dict[str, list[str]], repeats: int, figure: str = "samples_per_s",
                after=None, envs: dict[str, dict[str, str]] | None = None) -> dict[str, list[float]]:
    """`repeats` rounds of one `base + extra` launch per mode, in turn (drift on a shared machine hits every mode
    alike); each launch's summary `figure`, per mode. `after(mode, run_dir)` may look at a run before it goes;
    `envs[mode]`: environment variables that mode's launches add."""
    import os
    import tempfile

    results: dict[str, list[float]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(repeats):
            for mode, extra in modes.items():
                run_dir = Path(tmp) / f"{mode}{repeat}"
                env = {**os.environ, **envs[mode]} if envs and mode in envs else None
                results[mode].append(run_ddp_amp(base + extra, run_dir, env=env)[figure])
                if after is not None:
                    after(mode, run_dir)
    return results


def print_ratio(results: dict[str, list[float]], numerator: str, denominator: str) -> None:
    """Each mode's samples/s, then numerator/denominator per interleaved pair (the figure to compare)."""
    width = max(len(mode) for mode in results) + 1
    print(f"{'mode':<{width}} {'samples/s median [min-max]':>30}")
    for mode, values in results.items():
        print(f"{mode:<{width}} {spread(values, '.0f'):>30}")
    ratios = [a / b for a, b in zip(results[numerator], results[denominator])]
    print(f"{numerator}/{denominator} throughput ratio: {spread(ratios, '.3f')} (per interleaved pair; median "
          f"{statistics.median(ratios):.3f})")
