"""A script's output: each rank's stdout and stderr, captured by its launcher.

A rank running a user's script (ddp_amp.rank.script) connects twice to the launcher's OutputServer on loopback,
says which rank and stream each connection is (with the launch's token), and makes the two connections its fd 1
and 2: whatever the script, its libraries or C code write goes to the launcher unchanged, with no thread of ours
in the rank. The launcher appends every byte to RUN_DIR/logs/rank<N>.log and hands each complete line to the
display as an "output" event (the terminal shows it prefixed by its rank, as torchrun's --tee does).
"""

from __future__ import annotations

import os
import secrets
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

OUTPUT_VAR = "DDP_AMP_OUTPUT"
OUTPUT_TOKEN_VAR = "DDP_AMP_OUTPUT_TOKEN"
STREAMS = ("stdout", "stderr")
MAX_HEADER_BYTES = 256
HEADER_WAIT_S = 5.0
DRAIN_S = 5.0
"""At the end of a launch, how long the streams still open get to reach their end: a process the script started
that outlives its rank (and holds its stdout) must not hold the launcher."""
MAX_LINE_CHARS = 64 * 1024
"""A longer line (a progress bar's carriage returns, a dump) reaches the display in pieces of this size."""
PROGRESS_EVERY_S = 0.25
"""How often a line being rewritten with carriage returns (tqdm's bar) updates the rank's row: the live view's
refresh rate."""


class OutputServer:
    """Launcher side: accepts each rank's two streams; bytes to the rank's log, lines to `on_line(event)`."""

    def __init__(self, log_dir: Path, on_line: Callable[[dict[str, Any]], None]) -> None:
        self.token = secrets.token_hex(16)
        self.log_dir = log_dir
        self._on_line = on_line
        self._logs: dict[int, Any] = {}
        self._unwritable = False
        """A log write failed (a full disk): said once."""
        self._open: set[socket.socket] = set()
        self._last: list[tuple[threading.Thread, socket.socket]] = []
        self._lock = threading.Lock()
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._serve(self.request)

        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = False  # server_close() joins them: every byte a rank wrote is kept
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="ddp-amp-output", daemon=True)

    def environment(self) -> dict[str, str]:
        host, port = self._server.server_address[:2]
        return {OUTPUT_VAR: f"{host}:{port}", OUTPUT_TOKEN_VAR: self.token}

    def _serve(self, connection: socket.socket) -> None:
        with self._lock:
            self._open.add(connection)
        try:
            self._read(connection)
        finally:
            with self._lock:
                self._open.discard(connection)

    def _read(self, connection: socket.socket) -> None:
        connection.settimeout(HEADER_WAIT_S)
        header = b""
        try:
            while not header.endswith(b"\n"):
                chunk = connection.recv(1)
                if not chunk or len(header) > MAX_HEADER_BYTES:
                    return
                header += chunk
        except OSError:
            return
        parts = header.decode(errors="replace").split()
        if len(parts) != 3 or parts[0] != self.token or not parts[1].isdigit() or parts[2] not in STREAMS:
            return  # not one of this launch's ranks
        rank, stream = int(parts[1]), parts[2]
        self._log(rank, b"")  # every rank that started has its log, even one that printed nothing
        connection.settimeout(None)  # a rank may stay silent for hours; EOF comes when it exits
        pending, next_progress, unshown = b"", 0.0, False
        while True:
            # A progress bar's state not yet shown (it came within PROGRESS_EVERY_S of the last): shown when the
            # stream goes quiet that long, not held until the bar's next update.
            connection.settimeout(PROGRESS_EVERY_S if unshown else None)
            try:
                chunk = connection.recv(65536)
            except TimeoutError:
                chunk = None
            except OSError:
                chunk = b""
            if chunk == b"":
                break
            if chunk is not None:
                self._log(rank, chunk)
                *lines, pending = (pending + chunk).split(b"\n")
                while len(pending) > MAX_LINE_CHARS:
                    lines.append(pending[:MAX_LINE_CHARS])
                    pending = pending[MAX_LINE_CHARS:]
                for line in lines:
                    self._line(rank, stream, line)
            unshown = b"\r" in pending
            if unshown and (chunk is None or time.monotonic() >= next_progress):
                # A progress bar rewriting its line, complete only at its newline: what a terminal shows of it
                # now, for the rank's row in the live view (as under torchrun, where the bar moves).
                next_progress, unshown = time.monotonic() + PROGRESS_EVERY_S, False
                self._on_line({"type": "output_progress", "rank": rank, "stream": stream, "line": _shown(pending)})
        if pending:
            self._line(rank, stream, pending)

    def _accept_the_last(self) -> None:
        """The connections still in the listen queue when serve_forever stopped (a launcher short of CPU may not
        have accepted a rank's stream before the rank ended): read here too, or their bytes would be lost."""
        listening = self._server.socket
        listening.setblocking(False)
        while True:
            try:
                connection, _ = listening.accept()
            except OSError:  # none left (BlockingIOError), or the socket is gone
                return
            connection.setblocking(True)
            thread = threading.Thread(target=self._serve, args=(connection,), name="ddp-amp-output-last")
            thread.start()
            self._last.append((thread, connection))

    def _line(self, rank: int, stream: str, raw: bytes) -> None:
        self._on_line({"type": "output", "rank": rank, "stream": stream, "line": _shown(raw)})

    def _log(self, rank: int, data: bytes) -> None:
        with self._lock:
            try:
                log = self._logs.get(rank)
                if log is None:
                    log = self._logs[rank] = open(self.log_dir / f"rank{rank}.log", "ab", buffering=0)  # noqa: SIM115
                log.write(data)
            except OSError as exc:  # a full disk: the lines are still shown; said once, never raised
                if not self._unwritable:
                    self._unwritable = True
                    print(f"ddp-amp: warning: {self.log_dir / f'rank{rank}.log'} could not be written: {exc.strerror} "
                          "(the ranks' output is still shown)", file=sys.stderr, flush=True)

    def append(self, rank: int, text: str) -> None:
        """Text the rank did not write itself (its traceback, reported as an event) added to its log."""
        self._log(rank, text.encode(errors="replace") + (b"" if text.endswith("\n") else b"\n"))

    def __enter__(self) -> OutputServer:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._accept_the_last()
        deadline = time.monotonic() + DRAIN_S
        while self._open and time.monotonic() < deadline:
            time.sleep(0.02)
        with self._lock:
            for connection in self._open:
                try:
                    connection.shutdown(socket.SHUT_RDWR)  # its reader sees the end now
                except OSError:
                    pass
        self._server.server_close()  # joins the handler threads: each has read its stream to the end
        for thread, connection in self._last:
            thread.join()
            connection.close()
        self._last.clear()
        with self._lock:
            for log in self._logs.values():
                log.close()
            self._logs.clear()


def connect_stream(rank: int, stream: str) -> socket.socket | None:
    """Rank side: one of this rank's streams, connected to its launcher; None without one."""
    address, token = os.environ.get(OUTPUT_VAR), os.environ.get(OUTPUT_TOKEN_VAR)
    if not address or not token:
        return None
    host, _, port = address.rpartition(":")
    try:
        connection = socket.create_connection((host, int(port)), timeout=10)
        connection.sendall(f"{token} {rank} {stream}\n".encode())
        connection.settimeout(None)
        connection.shutdown(socket.SHUT_RD)  # only written to
    except OSError:
        return None
    return connection


def _shown(raw: bytes) -> str:
    """A line as a terminal shows it: the text after its last carriage return (a progress bar's last state, not
    every state run together; a CRLF's CR is no rewrite). The log keeps every byte."""
    return raw.decode(errors="replace").rstrip("\r").rsplit("\r", 1)[-1]
