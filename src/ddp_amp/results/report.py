"""Launcher-side rendering of a bench report: a rich table with an environment footer, and an optional plot."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def bench_table(report: dict[str, Any]):
    """The rich renderable: one row per precision, then the speedup, loss agreement and the environment."""
    from rich.console import Group
    from rich.text import Text

    precisions = report["precisions"]
    sequence = any("tokens_per_s" in entry for entry in precisions.values())
    utilisation = any(entry.get("mfu") is not None for entry in precisions.values())
    env = report["environment"]
    table = _precision_table(precisions, sequence, utilisation)
    lines = [f"task: {env['task']}"] if env.get("task") else []
    speedups = report.get("speedups") or ({report["speedup"]["amp"]: {  # a report of an earlier version
        **report["speedup"], "loss_relative_difference": report["loss_agreement"]["relative_difference"]}}
        if "speedup" in report else {})
    for amp, speedup in speedups.items():
        lines.append(f"speedup {amp} over fp32: {speedup['median']:.2f}x "
                     f"(per repeat {speedup['min']:.2f}x-{speedup['max']:.2f}x); final losses differ by "
                     f"{speedup['loss_relative_difference'] * 100:.2f}%")
    for precision, gain in report.get("compile_speedup", {}).items():
        compile_s = precisions[precision + "+compile"].get("compile_s")
        lines.append(f"torch.compile speedup for {precision}: {gain['median']:.2f}x per step "
                     f"(per repeat {gain['min']:.2f}x-{gain['max']:.2f}x)"
                     + (f"; compiling took {compile_s:.1f}s (the first step, not in the step times)"
                        if compile_s is not None else ""))
    shards = report.get("shards", {})
    for shard, entries in shards.items():
        if shard == "against":
            continue
        for precision, entry in entries.items():
            speed, memory = entry["throughput"], entry["training_state_memory"]
            lines.append(f"--shard {shard} / {shards['against']} ({precision}): throughput {speed['median']:.2f}x "
                         f"({speed['min']:.2f}x-{speed['max']:.2f}x), rank 0's training-state memory "
                         f"{memory['median']:.2f}x ({entry['training_state_mb']:.0f} MB; peak less the memory "
                         "before the model was built)")
    for note in report.get("notes", []):
        lines.append(f"note: {note}")
    held = [(name, entry) for name, entry in precisions.items() if entry.get("peak_source")]
    if held:
        lines.append("MFU: " + "; ".join(f"{name} {entry['achieved_tflops_per_rank']:.3g} of "
                                         f"{entry['peak_tflops_per_rank']:.3g} TFLOP/s per rank "
                                         f"({entry['peak_source']})" for name, entry in held))
    lines.append(_bench_footer(env))
    return Group(table, *(Text(line) for line in lines))


def _precision_table(precisions: dict[str, Any], sequence: bool, utilisation: bool):
    """bench's table: a row per precision."""
    from rich import box
    from rich.table import Table

    headers = ("precision", "step ms\n(median)", "p90", "slowest\nrank", "samples/s",
               *(("tokens/s",) if sequence else ()), *(("MFU",) if utilisation else ()), "peak\nMB", "final\nloss")
    rows = [[name, f"{entry['step_s_median'] * 1e3:.2f}", f"{entry['step_s_p90'] * 1e3:.2f}",
             f"{entry['slowest_rank_step_s_median'] * 1e3:.2f}", f"{entry['samples_per_s']:.0f}",
             *((f"{entry.get('tokens_per_s', 0):.0f}",) if sequence else ()),
             *((percent(entry.get("mfu")),) if utilisation else ()),
             f"{entry['peak_memory_mb']:.0f}", f"{entry['final_loss']:.4f}"] for name, entry in precisions.items()]
    # No vertical rules, and no column narrower than its widest figure: every figure whole at 80 columns (a
    # pipe's width), headers wrapped instead.
    table = Table(title="ddp-amp bench", title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    for index, header in enumerate(headers):
        widest = max([len(row[index]) for row in rows] + [len(line) for line in header.split("\n")])
        table.add_column(header, justify="left" if index == 0 else "right", min_width=widest)
    for row in rows:
        table.add_row(*row)
    return table


def _bench_footer(env: dict[str, Any]) -> str:
    """The environment, in one line under bench's table."""
    footer = (f"torch {env['torch']} | {env['device']} | world size {env['world_size']} ({env['backend']}) | "
              f"{env['threads_per_rank']} threads/rank | CPU native bf16: {'yes' if env['cpu_native_bf16'] else 'no'} "
              f"({' '.join(env.get('cpu_flags', [])) or 'no AVX2'})")
    if env.get("flush_denormal") is not None:
        footer += f" | subnormals flushed: {'yes' if env['flush_denormal'] else 'no'}"
    if "tf32_matmul" in env:
        footer += f" | TF32 matmul {'on' if env['tf32_matmul'] else 'off'}"
    if env.get("model_flops_per_token"):
        footer += f" | {env['model_flops_per_token'] / 1e6:.1f} MFLOP/token"
    return footer


def doctor_table(report: dict[str, Any]):
    """ddp-amp doctor: a row per rank, the all-reduce figures, the verdict and any warning."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    slow = set(report["judgement"]["slow_ranks"])
    ranks = Table(title=f"ddp-amp doctor ({report['backend']}, {report['precision']})", title_justify="left")
    for header in ("rank", "node", "host", "device", "ready after", "matmul GFLOP/s", "host→device GB/s", "status"):
        ranks.add_column(header, justify="left" if header in ("host", "device", "status") else "right")
    for rank in report["ranks"]:
        h2d = rank.get("host_to_device_gb_per_s")
        ranks.add_row(str(rank["rank"]), str(rank.get("node", 0)), rank["host"], rank["device"],
                      f"{rank['rendezvous_s']:.1f}s",
                      f"{rank['matmul_gflops']:.0f}", number(h2d, ".1f"),
                      Text("slow", style="bold yellow") if rank["rank"] in slow else Text("ok", style="green"))
    links = Table(title="all-reduce (every rank at once)", title_justify="left")
    for header in ("size", "time", "bus bandwidth"):
        links.add_column(header, justify="right")
    figures = report["ranks"][0]["all_reduce"]
    links.add_row("4 B", f"{figures['latency_us']:.0f} us", "-")
    for size in figures["sizes"]:
        links.add_row(f"{size['mib']} MiB", f"{size['seconds'] * 1e3:.1f} ms", f"{size['bus_gb_per_s']:.2f} GB/s")
    judgement = report["judgement"]
    tables = [ranks, links]
    nodes = {node: figures for node, figures in judgement["nodes"].items() if "round_trip_us" in figures}
    if nodes:
        slow_nodes = {str(node) for node in judgement["slow_nodes"]}
        table = Table(title="nodes (each with its best peer, one pair at a time)", title_justify="left")
        for header in ("node", "address", "round trip", "send GB/s", "receive GB/s", "status"):
            table.add_column(header, justify="left" if header in ("address", "status") else "right",
                             no_wrap=header == "address")
        for node, figures in nodes.items():
            table.add_row(str(node), figures["address"], f"{figures['round_trip_us']:.0f} us",
                          f"{figures['send_gb_per_s']:.2f}", f"{figures['receive_gb_per_s']:.2f}",
                          Text("slow link", style="bold yellow") if str(node) in slow_nodes
                          else Text("ok", style="green"))
        tables.append(table)
    lines = [Text(f"warning: {w}", style="yellow") for w in judgement["warnings"]]
    lines.append(Text(f"{judgement['verdict']} (doctor took {report['elapsed_s']:.1f}s)"))
    return Group(*tables, *lines)


def max_batch_table(report: dict[str, Any]):
    """bench --max-batch: per precision the largest per-rank batch, the throughput at it, the trials."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    table = Table(title="ddp-amp bench --max-batch", title_justify="left")
    for header in ("precision", "largest batch per rank", "samples/s at it", "peak MB", "trials"):
        table.add_column(header, justify="left" if header == "precision" else "right")
    for name, entry in report["max_batch"].items():
        table.add_row(name, str(entry["max_batch"]), number(entry["samples_per_s"], ".0f"),
                      f"{entry['peak_memory_mb']:.0f}", str(len(entry["trials"])))
    lines = []
    if "max_batch_ratio" in report:
        ratio = report["max_batch_ratio"]
        lines.append(f"largest batch {ratio['amp']} / fp32: {ratio['ratio']:.2f}x")
    env = report["environment"]
    cap = f" | --max-memory {env['max_memory_gb']:g} GB per rank" if env.get("max_memory_gb") else ""
    lines.append(f"torch {env['torch']} | {env['device']} | world size {env['world_size']} ({env['backend']}){cap}")
    return Group(table, *(Text(line) for line in lines))


def max_batch_plot(report: dict[str, Any], path: Path) -> None:
    """Every trial of bench --max-batch: batch size against fits or not, per precision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3))
    for row, entry in enumerate(report["max_batch"].values()):
        for trial in entry["trials"]:
            ax.scatter(trial["batch"], row, marker="o" if trial["fits"] else "x",
                       color="tab:green" if trial["fits"] else "tab:red")
    ax.set_xscale("log", base=2)
    ax.set_yticks(range(len(report["max_batch"])), list(report["max_batch"]))
    ax.set_xlabel("batch per rank (o trains, x out of memory)")
    ax.set_title("ddp-amp bench --max-batch")
    fig.tight_layout()
    save_figure(fig, path, dpi=120)


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
    save_figure(fig, path, dpi=120)


# `ddp-amp show`: runs side by side.

def number(value, fmt: str) -> str:
    return format(value, fmt) if isinstance(value, (int, float)) else "-"


def percent(fraction) -> str:
    return f"{fraction:.1%}" if isinstance(fraction, (int, float)) else "-"


def runs_plot(runs: list, path: Path) -> None:
    """Loss, LR and throughput against step for every run, overlaid, one colour per run, named in the legend.
    Needs matplotlib (`pip install 'ddp-amp[plot]'`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddp_amp.results.runs import curve

    panels = (("loss", "loss", True), ("lr", "learning rate", False), ("samples_per_s", "samples/s (global)", False))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (key, label, log) in zip(axes, panels):
        for run in runs:
            points = curve(run, run.loss_key if key == "loss" else key)
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, marker="." if len(points) < 30 else None,
                        label=run.name + (" (in progress)" if run.state == "in progress" else ""))
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(label)
        if log and all(value > 0 for run in runs for _, value in curve(run, run.loss_key if key == "loss" else key)):
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize="small")
    fig.suptitle(" vs ".join(run.name for run in runs))
    fig.tight_layout()
    save_figure(fig, path, dpi=110)


def profile_table(profile: dict[str, Any]) -> Any:
    """--profile: rank 0's operators with the most self time over the profiled steps."""
    from rich.table import Table

    start, end = profile["steps"]
    on_device = any("self_cuda_ms" in row for row in profile["top_ops"])
    table = Table(title=f"profile of steps {start}-{end}, rank 0 (traces: {profile['traces']}; these steps are "
                  "left out of samples/s)", title_justify="left")
    table.add_column("operator")
    for header in (*(("self CUDA ms",) if on_device else ()), "self CPU ms", "calls"):
        table.add_column(header, justify="right")
    for row in profile["top_ops"]:
        table.add_row(row["name"], *((f"{row['self_cuda_ms']:.2f}",) if on_device else ()),
                      f"{row['self_cpu_ms']:.2f}", str(row["calls"]))
    return table


def save_figure(fig, path: Path, dpi: int) -> None:
    """--plot's file, in the format its suffix names, with ddp-amp's mark in its metadata (a later --plot may
    replace it, and nothing else), written whole or not at all; the figure closed."""
    import matplotlib.pyplot as plt

    from ddp_amp.files import PLOT_FORMATS, WRITTEN_BY, through_link, write_report

    suffix = through_link(path).suffix.lower()  # of the file written, where a link points
    try:
        write_report(path, "--plot", lambda temporary: fig.savefig(
            temporary, format=suffix[1:], dpi=dpi, metadata={PLOT_FORMATS[suffix]: f"{WRITTEN_BY} (matplotlib)"}))
    finally:
        plt.close(fig)
