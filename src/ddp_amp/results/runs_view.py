"""ddp-amp show's table of runs: a row per run (what it is, how fast, how good, a loss curve), turned to a
column per run where the rows do not fit the terminal, in as many tables as it takes for no word to be cut."""

from __future__ import annotations

from typing import Any

from ddp_amp.results.report import number as _num
from ddp_amp.results.report import percent as _percent

SPARK = "▁▂▃▄▅▆▇█"


def sparkline(values: list[float], width: int = 20) -> str:
    """A loss curve in one line of block characters (log scale when every value is positive, as a loss that
    falls by decades stays readable), averaged down to `width` characters."""
    import math

    values = [v for v in values if math.isfinite(v)]
    if not values:
        return ""
    buckets = min(width, len(values))
    means = [sum(chunk) / len(chunk) for chunk in
             (values[i * len(values) // buckets:(i + 1) * len(values) // buckets] for i in range(buckets))]
    if all(v > 0 for v in means):
        means = [math.log(v) for v in means]
    low, high = min(means), max(means)
    span = high - low or 1.0
    return "".join(SPARK[min(len(SPARK) - 1, int((v - low) / span * len(SPARK)))] for v in means)


def _script_steps(run) -> str:
    """A script's steps: where its ddp_amp.loop stopped or last reported; "-" for a script without it."""
    loop = run.loop
    steps = loop.get("stopped_at_step", loop.get("last_reported_step"))
    return "-" if steps is None else str(steps)


def _last(run, key: str):
    for record in reversed(run.metrics):
        if key in record:
            return record[key]
    return None


RUN_TEXT_COLUMNS = ("run", "state", "runs", "eval", "loss curve")


def _run_rows(runs: list) -> tuple[list[str], list[list[Any]]]:
    """The runs table's headers, and one row of cells per run (rich Text or str)."""
    from rich.text import Text

    from ddp_amp.results.runs import curve

    compare = len(runs) > 1
    utilisation = any(run.summary.mfu is not None for run in runs)
    headers = ["run", "state", "runs", "precision", "world", "steps", "samples/s", *(("vs first",) if compare else ()),
               *(("MFU",) if utilisation else ()), "final loss", *(("Δ loss",) if compare else ()), "eval", "wall",
               "first step", "loss curve"]
    rows = []
    first_speed = first_loss = None
    for index, run in enumerate(runs):
        s = run.summary
        total = s.steps if s.steps is not None else _last(run, "total_steps") or run.config.get("steps")
        steps = s.steps if s.steps is not None else _last(run, "step") or 0
        speed = s.samples_per_s if s.samples_per_s is not None else _last(run, "samples_per_s")
        loss = s.final_loss if s.final_loss is not None else _last(run, run.loss_key)
        if index == 0:
            first_speed, first_loss = speed, loss
        validation = {k: v for k, v in s.validation.items() if k.startswith("val_")}
        evaluation = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in {**validation, **s.eval}.items()) or (
            "error" if s.eval_error is not None else "-")
        row = [run.name, Text(run.state, style="green" if run.state == "finished" else "yellow"), run.work,
               s.precision or run.loop.get("precision", "-"), str(s.world_size or "-"),
               _script_steps(run) if s.outcome is not None else f"{steps}/{total}" if run.state != "finished"
               and total is not None else str(steps),
               _num(speed, ".0f")]
        if compare:
            row.append(f"{speed / first_speed:.2f}x" if speed and first_speed else "-")
        if utilisation:
            row.append(_percent(s.mfu))
        row.append(_num(loss, ".4f") + ("" if run.loss_key == "loss" or loss is None else f" ({run.loss_key})"))
        if compare:
            row.append(f"{loss - first_loss:+.4f}" if loss is not None and first_loss is not None else "-")
        wall = _seconds(s.wall_s) if s.launches is None else \
            f"{_seconds(s.wall_s_all_launches)} ({s.launches} launches)"
        row += [evaluation, wall, _seconds(s.time_to_first_step_s),
                sparkline([value for _, value in curve(run, run.loss_key)], width=16)]
        rows.append(row)
    return headers, rows


def runs_table(runs: list, width: int | None = None) -> Any:
    """One row per run (what it is, how fast, how good), a loss curve each, and for two runs or more the
    options that differ and each run's throughput and final loss against the first. Where the rows do not fit
    in `width` columns (a terminal's), the table turns: one column per run, one row per figure, in as many
    tables as it takes for no number or word to be cut (long text wraps between words)."""
    from rich.console import Console, Group
    from rich.table import Table
    from rich.text import Text

    from ddp_amp.results.runs import config_differences, why_not_finished

    headers, rows = _run_rows(runs)
    table = Table(title="ddp-amp runs", title_justify="left")
    for header in headers:
        table.add_column(header, justify="left" if header in RUN_TEXT_COLUMNS else "right", no_wrap=True)
    for row in rows:
        table.add_row(*row)
    tables = [table]
    if width is not None and Console(width=10_000).measure(table).maximum > width:
        tables = _turned(headers, rows, width)
    parts: list[Any] = [*tables]
    for run in runs:  # why a run did not finish, in the words its launch ended with
        if why := why_not_finished(run):
            parts.append(Text(f"{run.name} {run.state}: {why}"))
    if len(runs) > 1:
        differences = config_differences(runs)
        if differences:
            options = Table(title="options that differ", title_justify="left")
            options.add_column("option")
            for run in runs:
                options.add_column(run.name)
            for key, values in differences.items():
                options.add_row("SCRIPT" if key == "script" else f"--{key.replace('_', '-')}",
                                *(str(v) for v in values))
            parts.append(options)
        else:
            parts.append(Text("same options in every run"))
    return Group(*parts)




def _seconds(value) -> str:
    return f"{value:.1f}s" if isinstance(value, (int, float)) else "-"


def _turned(headers: list[str], rows: list[list[Any]], width: int) -> list[Any]:
    """A column per run and a row per figure, as many runs to a table as fit in `width` with each run's column
    at least as wide as its longest word (a table's borders and padding: 3 characters a column, 1 more at the
    end); the room left is shared out. Every width is set, not left to rich, which narrows all columns evenly
    when a table is too wide and then widens some back to their minimum: past the terminal's edge, cropped. A
    run's name may wrap in its header; a word wider than the terminal folds."""
    from rich.table import Table

    label = max(len(header) for header in headers[1:])
    room = max(width - label - 7, 1)

    def widest_word(row: list[Any]) -> int:
        return min(max((len(word) for cell in row[1:] for word in str(cell).split()), default=1), room)

    def longest_cell(row: list[Any]) -> int:
        return min(max((len(str(cell)) for cell in row[1:]), default=1), room)

    groups: list[list[list[Any]]] = [[]]
    used = label + 4
    for row in rows:
        if groups[-1] and used + widest_word(row) + 3 > width:
            groups.append([])
            used = label + 4
        groups[-1].append(row)
        used += widest_word(row) + 3
    tables = []
    for number, group in enumerate(groups, start=1):
        table = Table(title="ddp-amp runs" + (f" ({number} of {len(groups)})" if len(groups) > 1 else ""),
                      title_justify="left")
        table.add_column("", no_wrap=True, width=label)
        share = (width - label - 4 - sum(widest_word(row) + 3 for row in group)) // len(group)
        for row in group:
            table.add_column(row[0], justify="right", overflow="fold",
                             width=max(widest_word(row), min(longest_cell(row), widest_word(row) + share)))
        for position, header in enumerate(headers[1:], start=1):
            table.add_row(header, *(row[position] for row in group))
        tables.append(table)
    return tables
