"""Launcher-side rendering of a bench report: a rich table with an environment footer, and an optional plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bench_table(report: dict[str, Any]):
    """The rich renderable: one row per precision, then the speedup, loss agreement and the environment."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    precisions = report["precisions"]
    sequence = any("tokens_per_s" in entry for entry in precisions.values())
    table = Table(title="ddp-amp bench", title_justify="left")
    for header in ("precision", "step ms (median)", "p90", "slowest rank", "samples/s",
                   *(("tokens/s",) if sequence else ()), "peak MB", "final loss"):
        table.add_column(header, justify="left" if header == "precision" else "right")
    for name, entry in precisions.items():
        table.add_row(name, f"{entry['step_s_median'] * 1e3:.2f}", f"{entry['step_s_p90'] * 1e3:.2f}",
                      f"{entry['slowest_rank_step_s_median'] * 1e3:.2f}", f"{entry['samples_per_s']:.0f}",
                      *((f"{entry.get('tokens_per_s', 0):.0f}",) if sequence else ()),
                      f"{entry['peak_memory_mb']:.0f}", f"{entry['final_loss']:.4f}")
    lines = []
    if "speedup" in report:
        speedup = report["speedup"]
        agreement = report["loss_agreement"]
        lines.append(f"speedup {speedup['amp']} over fp32: {speedup['median']:.2f}x "
                     f"(per repeat {speedup['min']:.2f}x-{speedup['max']:.2f}x); final losses differ by "
                     f"{agreement['relative_difference'] * 100:.2f}%")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    env = report["environment"]
    footer = (f"torch {env['torch']} | {env['device']} | world size {env['world_size']} ({env['backend']}) | "
              f"{env['threads_per_rank']} threads/rank | CPU native bf16: {'yes' if env['cpu_native_bf16'] else 'no'} "
              f"({' '.join(env.get('cpu_flags', [])) or 'no AVX2'})")
    if "tf32_matmul" in env:
        footer += f" | TF32 matmul {'on' if env['tf32_matmul'] else 'off'}"
    if env.get("model_flops_per_token"):
        footer += f" | {env['model_flops_per_token'] / 1e6:.1f} MFLOP/token"
    for name, entry in precisions.items():
        if entry.get("mfu") is not None:
            footer += f" | MFU {name} {entry['mfu'] * 100:.1f}%"
    lines.append(footer)
    return Group(table, *(Text(line) for line in lines))


def bench_plot(report: dict[str, Any], path: Path) -> None:
    """Step-time distributions, fp32 vs AMP, as a box plot. Needs matplotlib (`pip install 'ddp-amp[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(report["precisions"])
    data = [[t * 1e3 for r in report["precisions"][n]["repeats"] for times in r["step_s"].values() for t in times]
            for n in names]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.boxplot(data, showfliers=False)
    ax.set_xticks(range(1, len(names) + 1), names)
    ax.set_ylabel("step time (ms), all ranks")
    title = "ddp-amp bench"
    if "speedup" in report:
        title += f": {report['speedup']['amp']} {report['speedup']['median']:.2f}x faster than fp32"
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
