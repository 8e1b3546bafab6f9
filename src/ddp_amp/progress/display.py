"""Launcher-side rendering of progress events: a live rich view on a terminal, plain lines or JSON otherwise.

All displays share `ProgressState` (progress.view_state), which folds events into per-rank state; only `RichDisplay`
imports rich.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

from ddp_amp.outputs import RunRecord
from ddp_amp.progress.events import Event, metrics_text, plain_line
from ddp_amp.progress.view_state import ProgressState


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    minutes, secs = divmod(int(round(seconds)), 60)
    return f"{minutes}:{secs:02d}"


def summary_rows(view: ProgressState) -> list[tuple[str, ...]]:
    rows = []
    for state in sorted(view.ranks.values(), key=lambda s: s.rank):
        done = state.done or {}
        rows.append((str(state.rank), str(done.get("steps", state.step)), _fmt(done.get("samples_per_s"), ".0f"),
                     _fmt(done.get("peak_memory_mb"), ".0f"), _fmt(done.get("final_loss", state.loss), ".4f"),
                     state.status))
    return rows


def summary_footer(view: ProgressState) -> list[str]:
    record = RunRecord(view.summary)
    if not record:
        return []
    lines = [f"wall time {record.wall_s:.1f}s, time to first step {record.time_to_first_step_s:.1f}s, "
             f"{record.samples_per_s:.0f} samples/s global, precision {record.precision}"]
    if record.mfu is not None:
        lines.append(f"MFU {record.mfu:.1%}: {record.achieved_tflops_per_rank:.3g} TFLOP/s per rank of "
                     f"{record.peak_tflops_per_rank:.3g} ({record.peak_source})")
    elif record.achieved_tflops_per_rank is not None and record.peak_source:  # a peak measured too low
        lines.append(f"{record.achieved_tflops_per_rank:.3g} TFLOP/s per rank; peak {record.peak_tflops_per_rank:.3g} "
                     f"({record.peak_source})")
    if record.frozen_parameters:
        lines.append(f"parameters: {record.trainable_parameters:,} trained, {record.frozen_parameters:,} "
                     "frozen (left out of the optimizer)")
    if record.eval:
        lines.append("eval: " + ", ".join(f"{k} {v:.4g}" for k, v in record.eval.items()))
    if record.model_path:
        lines.append(f"wrote {record.model_path} and {record.summary_path}")
    else:  # a diverged run keeps no weights
        lines.append(f"wrote {record.summary_path} (no model.pt)")
    return lines


class PlainDisplay:
    """One line per rank per log interval, rank first, for pipes, files and CI; `quiet` keeps only the end and
    ddp-amp's own warnings (a tracker that failed: the user would not learn it before reading summary.json)."""

    def __init__(self, stream: TextIO | None = None, *, quiet: bool = False, final_summary: bool = True,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.stream = stream or sys.stdout
        self.quiet = quiet
        self.final_summary = final_summary
        self.view = ProgressState(clock=clock)

    def handle(self, event: Event) -> None:
        self.view.apply(event)
        if (self.quiet and not event.get("warning")) or event["type"] in ("error", "done"):
            return  # tracebacks and each rank's totals are shown once, at the end
        line = plain_line(event)
        if line:
            # A script's stderr lines go to stderr, as under torchrun: its stdout can still be piped alone. They
            # are flushed once per batch of lines (flush), the other events at once.
            if event["type"] == "output":
                stream = sys.stderr if event.get("stream") == "stderr" and self.stream is sys.stdout else self.stream
            elif event["type"] == "report":  # a loop script's own progress (its report() calls): the script's
                stream = self.stream
            else:
                stream = self._own_stream
            print(line, file=stream, flush=event["type"] != "output")

    @property
    def _own_stream(self) -> TextIO:
        """Where ddp-amp's own lines go: stdout carries the progress of ddp-amp's loop, but a script's stdout is
        the script's alone (piped, it holds what the script printed and its report() lines), so around a script
        the ranks' states and failures go to stderr."""
        return sys.stderr if self.view.script and self.stream is sys.stdout else self.stream

    def flush(self) -> None:
        self.stream.flush(), sys.stderr.flush()

    def close(self) -> None:
        for rank, text in self.view.failure_reports():
            print(f"[rank {rank}] failed:\n{text}", file=self._own_stream, flush=True)
        if self.final_summary and self.view.ranks and self.view.summary:
            for rank, steps, sps, memory, loss, status in summary_rows(self.view):
                print(f"[rank {rank}] {status}: {steps} steps, {sps} samples/s, peak memory {memory} MB, "
                      f"final loss {loss}", file=self._own_stream)
            for line in summary_footer(self.view):
                print(line, file=self._own_stream)
            self._own_stream.flush()


class JsonDisplay:
    """One JSON object per event, for tools."""

    def __init__(self, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stdout
        self.view = ProgressState()

    def handle(self, event: Event) -> None:
        self.view.apply(event)
        print(json.dumps(event, sort_keys=True), file=self.stream, flush=event["type"] != "output")

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        pass


PROGRESS_BAR_WIDTH = 12
DROPPED_FIRST = ("epoch", "progress", "lr", "skipped", "micro", "local", "node", "MFU", "scale", "samples/s")
"""The live table's columns a narrow terminal loses, first to last: every value shown is shown whole (a loss
cropped to "0.01…" says less than no loss column); rank, step, loss and status always stay."""


def _columns_that_fit(headers: list[str], rows: list[list[Any]], width: int) -> list[int]:
    """The indices of the columns to show in `width` columns of terminal, in order."""
    def cell_width(cell: Any) -> int:  # a str, a rich Text, or the progress bar
        return len(cell) if isinstance(cell, str) else len(cell.plain) if hasattr(cell, "plain") else \
            PROGRESS_BAR_WIDTH

    widths = [max([len(header), *(cell_width(row[index]) for row in rows)]) for index, header in enumerate(headers)]
    kept = list(range(len(headers)))
    for name in DROPPED_FIRST:
        if sum(widths[index] for index in kept) + 2 * (len(kept) - 1) <= width:  # cells 2 apart (padding 0, 1)
            break
        kept = [index for index in kept if headers[index] != name]
    return kept


_STYLES = {"done": "green", "failed": "bold red", "restarting": "yellow", "checkpointing": "cyan",
           "stalled": "bold yellow", "stopped": "yellow", "slow": "yellow"}


class RichDisplay:
    """A live table, one row per rank, and a global line; at the end tracebacks, then a summary table."""

    def __init__(self, console=None, *, clock: Callable[[], float] = time.monotonic, live: bool = True) -> None:
        from rich.console import Console

        self.console = console or Console()
        self.view = ProgressState(clock=clock)
        self._live = None
        if live:
            self.start()

    def start(self) -> None:
        from rich.live import Live

        self._live = Live(self.render(), console=self.console, refresh_per_second=4, get_renderable=self.render)
        self._live.start()

    def handle(self, event: Event) -> None:
        self.view.apply(event)
        if event["type"] in ("precision", "output"):  # a line above the live table
            self.console.print(plain_line(event), highlight=False, markup=False, soft_wrap=True)

    def render(self):
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        if self.view.script:
            return self._render_script()

        ranks = sorted(self.view.ranks.values(), key=lambda s: s.rank)
        show_node = any(s.node for s in ranks)
        show_scale = any(s.loss_scale is not None for s in ranks)  # fp16 only
        show_micro = any(s.micro_batch_size is not None for s in ranks)  # --micro-batch only
        show_mfu = any(s.mfu is not None for s in ranks)  # where the run counts its FLOPs
        headers = ["rank", *(("node", "local") if show_node else ()), "progress", "step", "epoch", "loss", "lr",
                   "samples/s", *(("MFU",) if show_mfu else ()), *(("scale", "skipped") if show_scale else ()),
                   *(("micro",) if show_micro else ()), "status"]
        rows = []
        for state in ranks:
            total = state.total_steps or 0
            row = [str(state.rank)]
            if show_node:
                row += [_fmt(state.node, "d"), _fmt(state.local_rank, "d")]
            row += [ProgressBar(total=total or 1, completed=state.step if total else 0, width=PROGRESS_BAR_WIDTH),
                    f"{state.step}/{total or '?'}", str(state.epoch), _fmt(state.loss, ".4f"), _fmt(state.lr, ".1e"),
                    _fmt(state.samples_per_s, ".0f")]
            if show_mfu:
                row.append(_fmt(state.mfu, ".1%"))
            if show_scale:
                row += [_fmt(state.loss_scale, ".0f"), str(state.skipped_steps)]
            if show_micro:
                row.append(_fmt(state.micro_batch_size, "d"))
            rows.append([*row, Text(state.status, style=_STYLES.get(state.status, ""))])
        kept = _columns_that_fit(headers, rows, self.console.width)
        table = Table(box=None, pad_edge=False, expand=False)
        for index in kept:
            table.add_column(headers[index], justify="left" if headers[index] in ("progress", "status") else "right",
                             no_wrap=True)
        for row in rows:
            table.add_row(*(row[index] for index in kept))
        view = self.view
        throughput = f"{_fmt(view.global_samples_per_s, '.0f')} samples/s"
        if view.item_name != "samples":
            throughput = f"{_fmt(view.items_per_s, '.0f')} {view.item_name}/s ({throughput})"
        norm = f"grad norm {view.grad_norm:.3g}  " if view.grad_norm is not None else ""
        if view.mfu is not None:
            throughput += f"  MFU {view.mfu:.1%}"
        line = Text(f"all ranks: loss {_fmt(view.global_loss, '.4f')}  {norm}{throughput}  "
                    f"elapsed {_duration(view.elapsed)}  ETA {_duration(view.eta)}")
        return Group(table, line)

    def _render_script(self):
        """A script's ranks: one row each, its state and the last line it wrote."""
        from rich.console import Group
        from rich.table import Table
        from rich.text import Text

        table = Table(box=None, pad_edge=False, expand=False)
        ranks = sorted(self.view.ranks.values(), key=lambda s: s.rank)
        show_node = any(s.node for s in ranks)
        reports = any(s.reported for s in ranks)  # the script reports through ddp_amp.loop
        for header in ("rank", *(("node", "local") if show_node else ()), "status",
                       *(("step", "reported") if reports else ()), "last line"):
            table.add_column(header, justify="left" if header in ("status", "reported", "last line") else "right",
                             overflow="ellipsis", no_wrap=True)
        for state in ranks:
            table.add_row(str(state.rank), *((_fmt(state.node, "d"), _fmt(state.local_rank, "d")) if show_node else ()),
                          Text(state.status, style=_STYLES.get(state.status, "")),
                          *((str(state.step), Text(metrics_text(state.reported))) if reports else ()),
                          Text(state.last_line))
        return Group(table, Text(f"elapsed {_duration(self.view.elapsed)}"))

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        for rank, text in self.view.failure_reports():
            # Text, not a str: tracebacks hold brackets ("[/path/pair.cc:553]") that rich would read as markup.
            self.console.print(Panel(Text(text), title=f"rank {rank} failed", border_style="red", expand=False))
        if not self.view.summary:
            return
        table = Table(title="summary")
        for header in ("rank", "steps", "samples/s", "peak MB", "final loss", "status"):
            table.add_column(header, justify="right")
        for row in summary_rows(self.view):
            table.add_row(*row)
        self.console.print(table)
        for line in summary_footer(self.view):
            self.console.print(line, highlight=False, markup=False)


def make_display(log_format: str, *, quiet: bool = False, script: bool = False):
    """auto: rich on a terminal, plain lines otherwise. `script`: the ranks run a user's script."""
    if log_format == "auto":
        log_format = "rich" if sys.stdout.isatty() else "plain"
    rich = log_format == "rich" and not quiet
    display = JsonDisplay() if log_format == "json" else RichDisplay(live=False) if rich else PlainDisplay(quiet=quiet)
    display.view.script = script
    if isinstance(display, RichDisplay):
        display.start()  # after `script` is set: the first frame already has the script's table
    return display
