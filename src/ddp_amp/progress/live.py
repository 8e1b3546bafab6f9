"""The launcher's side of progress: an event server feeding a display, for the lifetime of one launch."""

from __future__ import annotations

import queue
import threading
from pathlib import Path

from ddp_amp.progress.channel import EventServer
from ddp_amp.progress.output import OutputServer

LOG_DIR_VAR = "DDP_AMP_WORKER_LOG_DIR"


class LiveProgress:
    """`with LiveProgress(display, run_dir) as session:` launch ranks with `session.environment()`."""

    def __init__(self, display, run_dir: Path, *, capture_output: bool = False) -> None:
        """capture_output: the ranks run a user's script, whose stdout and stderr come here line by line
        (progress.output) to be logged and shown."""
        self.display = display
        self.log_dir = Path(run_dir) / "logs"
        self._server = EventServer()
        self._output = OutputServer(self.log_dir, self._server.events.put) if capture_output else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._pump, name="ddp-amp-display", daemon=True)

    def environment(self) -> dict[str, str]:
        """For every rank: where to send events, and where to write its own stdout/stderr (so that stray
        prints and warnings cannot garble the display; failures still arrive as events)."""
        if self._output is not None:
            return {**self._server.environment(), **self._output.environment()}
        return {**self._server.environment(), LOG_DIR_VAR: str(self.log_dir)}

    def failure_shown(self) -> bool:
        return bool(self.display.view.failures())

    def first_failure(self) -> tuple[int, str] | None:
        """(rank, traceback) of the failure that reached the display first (its error event's time), if any."""
        failures = self.display.view.failures()
        return (failures[0].rank, failures[0].traceback) if failures else None

    def failed_for_usage(self) -> bool:
        """A rank failed for a flag that does not fit what only a rank can see (its error event's kind)."""
        return any(state.failure_kind == "usage" for state in self.display.view.failures())

    def rank_pids(self) -> list[int]:
        """The process ids of this node's ranks that have reported (for a graceful stop)."""
        return [state.pid for state in self.display.view.ranks.values()
                if state.pid and state.status not in ("done", "stopped", "failed")]

    def stalled(self) -> list:
        return self.display.view.stalled()

    def _pump(self) -> None:
        while not self._stop.is_set():
            self._drain(timeout=0.1)
            for event in self.display.view.stalls():
                self.display.handle(event)

    def _drain(self, timeout: float = 0.0) -> None:
        try:
            event = self._server.events.get(timeout=timeout) if timeout else self._server.events.get_nowait()
            while True:
                if event["type"] == "error" and self._output is not None:
                    self._output.append(event["rank"], event["traceback"])  # shown once, at the end; kept here
                self.display.handle(event)
                event = self._server.events.get_nowait()
        except queue.Empty:
            pass
        flush = getattr(self.display, "flush", None)
        if flush is not None:
            flush()  # a script's lines are written as they come, and flushed once per batch

    def __enter__(self) -> LiveProgress:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._server.__enter__()
        if self._output is not None:
            self._output.__enter__()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._output is not None:
            self._output.__exit__(*exc)  # every line the ranks wrote is queued
        self._stop.set()
        self._thread.join()
        self._server.__exit__(*exc)  # closes the listening socket; handler threads finish reading what was sent
        self._drain()
        # A stop passed on to the ranks (the launch ends 128 + the signal): a script's ranks that the SIGINT
        # interrupted show no KeyboardInterrupt traceback as a failure; their logs keep it.
        self.display.view.stopped = getattr(exc[1], "exit_code", 0) > 128
        self.display.close()
