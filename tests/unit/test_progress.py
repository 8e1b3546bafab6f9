"""Progress: the rich display rendered byte for byte from scripted events, and the event channel. Real runs'
progress: tests/system/test_progress_runs.py."""

import io
import json
import socket

import pytest

from ddp_amp.progress.channel import MAX_LINE_BYTES, TOKEN_WAIT_S, EventSender, EventServer
from ddp_amp.progress.display import PlainDisplay, RichDisplay
from ddp_amp.progress.events import plain_line, warning_event


class FakeClock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def log_event(rank, step, loss, **extra):
    return {"type": "log", "rank": rank, "step": step, "total_steps": 100, "epoch": 1, "loss": loss,
            "global_loss": 0.25, "lr": 3e-3, "samples_per_s": 512.0, "global_samples_per_s": 1024.0,
            "skipped_steps": 0, "item_name": "samples", **extra}


SUMMARY = {"wall_s": 12.5, "time_to_first_step_s": 3.25, "samples_per_s": 1000.0, "precision": "bf16",
           "model_path": "runs/x/model.pt", "summary_path": "runs/x/summary.json", "eval": {"accuracy": 0.95}}


def scripted_display():
    clock = FakeClock()
    console_file = io.StringIO()
    from rich.console import Console

    console = Console(file=console_file, force_terminal=True, width=120, color_system=None)
    display = RichDisplay(console, clock=clock, live=False)
    for rank in (0, 1):
        display.handle({"type": "state", "rank": rank, "status": "starting", "local_rank": rank, "node": 0})
    clock.now += 10
    display.handle(log_event(0, 40, 0.2))
    display.handle(log_event(1, 40, 0.3))
    return display, console, console_file, clock


def test_rich_rows_and_global_line():
    display, console, console_file, _ = scripted_display()
    console.print(display.render())
    text = console_file.getvalue()
    rows = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2
    assert "40/100" in rows[0] and "0.2000" in rows[0] and "3.0e-03" in rows[0] and "512" in rows[0]
    assert "0.3000" in rows[1] and "running" in rows[1]
    # 40% done after 10 s: 15 s to go.
    assert "all ranks: loss 0.2500  1024 samples/s  elapsed 0:10  ETA 0:15" in text


def test_mfu_is_in_each_ranks_row_the_global_line_the_plain_lines_and_the_summary():
    display, console, console_file, _ = scripted_display()
    display.handle(log_event(0, 50, 0.2, mfu=0.412))
    display.handle(log_event(1, 50, 0.3, mfu=0.398))
    console.print(display.render())
    text = console_file.getvalue()
    header = next(line for line in text.splitlines() if line.split()[:1] == ["rank"])
    assert header.split()[-2:] == ["MFU", "status"]
    rows = [line for line in text.splitlines() if line.strip().startswith(("0 ", "1 "))]
    assert "41.2%" in rows[0] and "39.8%" in rows[1]
    assert "1024 samples/s  MFU 40.5%" in text
    assert plain_line(log_event(0, 50, 0.2, mfu=0.412)).endswith("512 samples/s MFU 41.2%")
    record = {**SUMMARY, "mfu": 0.4, "achieved_tflops_per_rank": 0.034, "peak_tflops_per_rank": 0.085,
              "peak_source": "measured matmul, bf16, 1 thread"}
    from ddp_amp.progress.display import summary_footer
    from ddp_amp.progress.view_state import ProgressState

    view = ProgressState(summary=record)
    assert "MFU 40.0%: 0.034 TFLOP/s per rank of 0.085 (measured matmul, bf16, 1 thread)" in summary_footer(view)


def test_without_a_flop_count_there_is_no_mfu_column():
    display, console, console_file, _ = scripted_display()
    console.print(display.render())
    assert "MFU" not in console_file.getvalue()


def test_rich_failed_rank_and_summary_table():
    display, console, console_file, _ = scripted_display()
    display.handle({"type": "error", "rank": 1, "traceback": "Traceback...\nValueError: boom"})
    display.handle({"type": "done", "rank": 0, "steps": 100, "samples_per_s": 500.0, "peak_memory_mb": 123.0,
                    "final_loss": 0.125, "summary": SUMMARY})
    console.print(display.render())
    live_text = console_file.getvalue()
    assert any(line.strip().startswith("1 ") and "failed" in line for line in live_text.splitlines())
    assert "boom" not in live_text, "a traceback must not be drawn into the live rows"
    display.close()
    text = console_file.getvalue()[len(live_text):]
    assert "rank 1 failed" in text and text.count("ValueError: boom") == 1
    summary_row = next(line for line in text.splitlines() if line.startswith("│    0"))
    assert [cell.strip() for cell in summary_row.strip("│").split("│")] == ["0", "100", "500", "123", "0.1250",
                                                                            "done"]
    assert "wall time 12.5s, time to first step 3.2s, 1000 samples/s global, precision bf16" in text
    assert "wrote runs/x/model.pt and runs/x/summary.json" in text


def test_plain_lines_put_the_rank_first_and_fp16_scale():
    out = io.StringIO()
    display = PlainDisplay(out)
    display.handle(log_event(1, 40, 0.1234, loss_scale=65536.0, skipped_steps=2))
    assert out.getvalue().strip() == ("[rank 1] step 40/100 loss 0.1234 lr 3.0e-03 512 samples/s "
                                      "scale 65536 skipped 2")


def test_quiet_plain_output_keeps_ddp_amps_own_warnings_alone():
    """--quiet prints the final summary, and ddp-amp's warnings (a tracker that failed), not progress or the
    ranks' other lines."""
    out = io.StringIO()
    display = PlainDisplay(out, quiet=True)
    display.handle(log_event(0, 40, 0.1234))
    display.handle({"type": "output", "rank": 0, "stream": "stdout", "line": "a print of the task"})
    display.handle(warning_event(0, "warning: --tracker mlflow: gone"))  # what the core's and the loop's ranks send
    assert out.getvalue().splitlines() == ["[rank 0] warning: --tracker mlflow: gone"]


def test_channel_accepts_the_token_and_rejects_everything_else():
    with EventServer() as server:
        good = EventSender(server.address, server.token)
        good.send({"type": "log", "rank": 0})
        host, _, port = server.address.rpartition(":")
        for bad in (b'{"token": "wrong", "event": {"type": "log", "rank": 9}}\n',
                    b'{"event": {"type": "log", "rank": 8}}\n', b"not json\n"):
            with socket.create_connection((host, int(port))) as intruder:
                intruder.sendall(bad)
                intruder.settimeout(10)
                assert intruder.recv(1) == b"", "a connection without the token stays open"
        good.send({"type": "done", "rank": 0})
        good.close()
        received = [server.events.get(timeout=5), server.events.get(timeout=5)]
    assert received == [{"type": "log", "rank": 0}, {"type": "done", "rank": 0}]
    assert server.events.empty()
    assert server.rejected == 3


def heartbeat(rank, step, micro, phase):
    phases = ("data", "forward", "backward", "step", "log")
    return {"type": "heartbeat", "rank": rank, "step": step, "micro": micro, "phase_index": phases.index(phase),
            "phase": phase, "stall_after_s": 5.0}


def test_the_rank_furthest_behind_is_stalled_once_no_loop_moves():
    display, console, console_file, clock = scripted_display()
    model = display.view
    display.handle(heartbeat(0, 41, 0, "backward"))  # waiting in the all-reduce of step 42
    display.handle(heartbeat(1, 41, 0, "forward"))  # stuck before it
    clock.now += 4
    assert model.stalls() == []  # not yet: within stall_after_s
    display.handle(heartbeat(0, 41, 0, "backward"))  # alive, but not moving
    clock.now += 2
    stalls = model.stalls()
    assert [(e["rank"], e["step"], e["phase"]) for e in stalls] == [(1, 42, "forward")]
    for event in stalls:
        display.handle(event)
    assert [s.rank for s in model.stalled()] == [1] and model.stalls() == []  # reported once
    console.print(display.render())
    assert "stalled" in console_file.getvalue()
    display.handle(heartbeat(1, 41, 0, "backward"))  # it moved on: no longer stalled
    assert model.ranks[1].status == "running" and model.stalls() == []


def test_a_rank_marked_slow_that_stops_is_the_one_stalled():
    """The straggler mark must not hide a rank from the stall check: else the rank waiting for it is blamed."""
    display, _, _, clock = scripted_display()
    display.handle(log_event(1, 4, 0.5, slow=True))
    display.handle(heartbeat(0, 4, 0, "backward"))
    display.handle(heartbeat(1, 4, 0, "forward"))
    clock.now += 6
    assert [(e["rank"], e["phase"]) for e in display.view.stalls()] == [(1, "forward")]


def test_no_stall_while_any_rank_moves():
    display, _, _, clock = scripted_display()
    display.handle(heartbeat(0, 41, 0, "backward"))
    display.handle(heartbeat(1, 41, 0, "forward"))
    clock.now += 10
    display.handle(heartbeat(0, 42, 0, "data"))  # rank 0 still trains (e.g. rank 1 is just slow to report)
    assert display.view.stalls() == []


def test_a_silent_connection_is_closed_and_cannot_hold_the_launcher():
    server = EventServer()
    with server:
        host, _, port = server.address.rpartition(":")
        silent = socket.create_connection((host, int(port)))  # connects, never sends
        quiet_after_token = socket.create_connection((host, int(port)))
        quiet_after_token.sendall(json.dumps({"token": server.token, "event": {"type": "log", "rank": 0}}).encode()
                                  + b"\n")
        assert server.events.get(timeout=5) == {"type": "log", "rank": 0}
        silent.settimeout(TOKEN_WAIT_S + 10)
        assert silent.recv(1) == b"", "a connection that never presented the token was kept open"
    # Leaving the block returned although `quiet_after_token` is still open and silent: the launcher can end.
    quiet_after_token.settimeout(5)
    assert quiet_after_token.recv(1) == b""
    silent.close()
    quiet_after_token.close()


def test_an_endless_line_closes_the_connection_without_buffering_it():
    with EventServer() as server:
        host, _, port = server.address.rpartition(":")
        with socket.create_connection((host, int(port))) as flood:
            sent = 0
            chunk = b"x" * 65536
            with pytest.raises(OSError):  # the server hangs up soon after MAX_LINE_BYTES
                while sent < 64 * MAX_LINE_BYTES:
                    flood.sendall(chunk)
                    sent += len(chunk)
            assert sent < 64 * MAX_LINE_BYTES
    assert server.rejected == 1


def test_rich_shows_a_traceback_with_brackets_as_it_is():
    # gloo's errors name their source as "[/path/pair.cc:553]": rich must not read that as a closing tag.
    display, console, console_file, _ = scripted_display()
    error = "RuntimeError: [/__w/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting [bold]x[/]"
    display.handle({"type": "error", "rank": 0, "traceback": f"Traceback...\n{error}"})
    display.close()
    assert error in console_file.getvalue()


def test_an_elastic_renumbering_replaces_the_process_earlier_rank():
    """An elastic job that grew numbers its ranks anew: this node's local rank 0 was global rank 1, is now 2.
    The table shows the rank it is now, not a second row stuck at the old one."""
    from ddp_amp.progress.view_state import ProgressState

    model = ProgressState(clock=FakeClock())
    model.apply({"type": "state", "rank": 1, "status": "starting", "local_rank": 0, "node": 1, "world_size": 2})
    model.apply(log_event(1, 10, 0.5))
    model.apply({"type": "state", "rank": 2, "status": "starting", "local_rank": 0, "node": 1, "world_size": 3})
    assert list(model.ranks) == [2]
    assert model.ranks[2].status == "starting"


def test_a_plain_start_line_names_the_world_size():
    from ddp_amp.progress.events import plain_line

    assert plain_line({"type": "state", "rank": 2, "status": "starting", "world_size": 3}) == \
        "[rank 2] starting (world size 3)"
    assert plain_line({"type": "state", "rank": 0, "status": "restarting", "restart": 1, "world_size": 2}) == \
        "[rank 0] restarting (restart 1, world size 2)"


def test_a_restart_remembers_which_global_rank_each_local_rank_was():
    """On node 1 of a multinode job, local rank 0 is global rank 2: the recovered line must say rank 2."""
    from ddp_amp.progress.view_state import ProgressState

    model = ProgressState(clock=FakeClock())
    for local in (0, 1):
        model.apply({"type": "state", "rank": 2 + local, "status": "starting", "local_rank": local, "node": 1})
    model.apply(log_event(2, 10, 0.5))
    model.apply({"type": "state", "rank": 2, "status": "restarting", "restart": 1, "local_rank": 0, "node": 1})
    assert model.ranks_before_restart == {0: 2, 1: 3}
    assert model.steps_before_restart[2] == 11


def test_a_restart_names_the_later_of_the_heartbeat_and_the_last_log_step():
    """Heartbeats come once a second: with fast steps the last one can be older than the last log line (a rank
    that logged step 30 was last seen by its heartbeat in step 23)."""
    from ddp_amp.progress.view_state import ProgressState

    model = ProgressState(clock=FakeClock())
    model.apply({"type": "state", "rank": 1, "status": "starting", "local_rank": 1, "node": 0})
    model.apply(heartbeat(1, 22, 0, "forward"))  # position[0] is the 0-based step: in step 23
    model.apply(log_event(1, 30, 0.5))
    model.apply({"type": "state", "rank": 1, "status": "restarting", "restart": 1, "local_rank": 1, "node": 0})
    assert model.steps_before_restart[1] == 31


def test_how_a_ranks_loop_ended_is_kept_until_a_restart():
    """A loop script's "loop" events fold into the rank's state: a stop agreed after an earlier steps() loop had
    completed stays a stop (as loop.json keeps both); a restart's new attempt starts with none."""
    from ddp_amp.progress.view_state import ProgressState

    model = ProgressState(clock=FakeClock())
    model.apply({"type": "state", "rank": 1, "status": "starting", "local_rank": 0, "node": 1})
    model.apply({"type": "loop", "rank": 1, "completed_steps": 5})
    model.apply({"type": "loop", "rank": 1, "stopped_at_step": 7, "stopped_by": "SIGTERM"})
    assert model.ranks[1].loop == {"completed_steps": 5, "stopped_at_step": 7, "stopped_by": "SIGTERM"}
    assert plain_line({"type": "loop", "rank": 1, "completed_steps": 5}) is None
    model.apply({"type": "state", "rank": 1, "status": "restarting", "restart": 1, "local_rank": 0, "node": 1})
    assert model.ranks[1].loop == {}


def test_a_done_line_without_a_logged_loss():
    """A restarted group that resumes from a checkpoint at the last step logs no step, so has no loss."""
    from ddp_amp.progress.events import plain_line

    event = {"type": "done", "rank": 0, "steps": 40, "samples_per_s": 100.0, "peak_memory_mb": 12.0,
             "final_loss": None}
    assert plain_line(event) == "[rank 0] done: 40 steps, 100 samples/s, peak memory 12 MB, final loss none logged"


@pytest.mark.parametrize("width, dropped", [(120, []), (60, ["progress", "epoch"]), (40, ["progress", "epoch", "lr"]),
                                            (30, ["progress", "epoch", "lr", "samples/s"])])
def test_a_narrow_terminal_drops_whole_columns_and_crops_no_value(width, dropped):
    """At 60 columns the rows cropped every value ("0.01…" for a loss, "runni…"): the columns a user needs least
    go first, and every value shown is whole."""
    from rich.console import Console

    display, _, _, _ = scripted_display()
    console_file = io.StringIO()
    console = Console(file=console_file, force_terminal=True, width=width, color_system=None)
    display.console = console
    console.print(display.render())
    lines = console_file.getvalue().splitlines()
    header = next(line for line in lines if line.split()[:1] == ["rank"]).split()
    everything = ["rank", "progress", "step", "epoch", "loss", "lr", "samples/s", "status"]
    assert header == [name for name in everything if name not in dropped]
    rows = [line for line in lines if line.strip().startswith(("0 ", "1 "))]
    assert len(rows) == 2 and "…" not in "".join(rows)
    assert "0.2000" in rows[0] and "running" in rows[0] and "40/100" in rows[0]
    assert all(len(line) <= width for line in rows)
