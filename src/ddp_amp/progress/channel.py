"""The event channel between workers and their launcher: newline-delimited JSON over a loopback TCP socket.

One mechanism for every launcher: spawn and torchrun both pass the address and a random token to the workers
through the environment (DDP_AMP_EVENTS, DDP_AMP_EVENTS_TOKEN). The launcher drops any line without the token,
so another local process cannot inject events. Workers send only at log intervals and state changes.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import select
import socket
import socketserver
import threading
import time
from typing import Any

ADDRESS_VAR = "DDP_AMP_EVENTS"
TOKEN_VAR = "DDP_AMP_EVENTS_TOKEN"


MAX_LINE_BYTES = 1 << 20
"""An event is a few hundred bytes; a longer line is not one of ours, and is not buffered."""
TOKEN_WAIT_S = 5.0
"""A connection must present the token this soon (workers send it with their first event, at once)."""
_POLL_S = 0.2


class EventServer:
    """Launcher side: accepts worker connections and queues every event that carries the token.

    Only loopback, and only connections whose every line carries the token: a connection that sends anything
    else, stays silent past TOKEN_WAIT_S before its first line, or sends a line over MAX_LINE_BYTES is closed.
    When the launch ends, the server reads what is already there and closes every connection, whatever its
    peer does, so a stray client can never keep a finished launcher alive.
    """

    def __init__(self) -> None:
        self.token = secrets.token_hex(16)
        self.events: queue.Queue[dict[str, Any]] = queue.Queue()
        self.rejected = 0
        self.closing = False
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                connection = self.request
                connection.settimeout(_POLL_S)
                opened, authenticated, pending = time.monotonic(), False, b""
                while True:
                    try:
                        chunk = connection.recv(65536)
                    except TimeoutError:
                        late = not authenticated and time.monotonic() - opened > TOKEN_WAIT_S
                        if late or server.closing:
                            server.rejected += late
                            return
                        continue
                    except OSError:
                        return
                    if not chunk:
                        return
                    *lines, pending = (pending + chunk).split(b"\n")
                    for raw in lines:
                        if not server._accept(raw):
                            server.rejected += 1
                            return  # not one of ours: close the connection
                        authenticated = True
                    if len(pending) > MAX_LINE_BYTES:
                        server.rejected += 1
                        return

        # Non-daemon handler threads, joined by server_close(): every line a worker sent before exiting is read.
        self._server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler)
        # A short poll: shutdown() waits up to one poll interval, and every launch ends with it.
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="ddp-amp-events", daemon=True)

    def _accept(self, raw: bytes) -> bool:
        try:
            message = json.loads(raw)
        except ValueError:
            return False
        if not isinstance(message, dict) or message.get("token") != self.token or "event" not in message:
            return False
        self.events.put(message["event"])
        return True

    @property
    def address(self) -> str:
        host, port = self._server.server_address[:2]
        return f"{host}:{port}"

    def environment(self) -> dict[str, str]:
        return {ADDRESS_VAR: self.address, TOKEN_VAR: self.token}

    def __enter__(self) -> EventServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        # A worker that connected, sent and exited within one poll of serve_forever may still wait in the
        # listen backlog: accept what is there, so none of its events are lost.
        self._server.timeout = 0
        while select.select([self._server.socket], [], [], 0)[0]:
            self._server.handle_request()
        # Handlers read until EOF (every worker has exited: its lines are all there) or, past this point, until
        # their connection has been quiet for one poll: a silent stray client cannot hold the launcher.
        self.closing = True
        self._server.server_close()  # joins the handler threads: everything sent has been read


class EventSender:
    """Worker side: one connection, one JSON line per event. Never raises: progress must not kill training."""

    def __init__(self, address: str, token: str) -> None:
        host, _, port = address.rpartition(":")
        self._token = token
        self._lock = threading.Lock()
        try:
            self._socket: socket.socket | None = socket.create_connection((host, int(port)), timeout=10)
        except OSError:
            self._socket = None

    @classmethod
    def from_environ(cls) -> EventSender | None:
        address, token = os.environ.get(ADDRESS_VAR), os.environ.get(TOKEN_VAR)
        return cls(address, token) if address and token else None

    def send(self, event: dict[str, Any]) -> None:
        if self._socket is None:
            return
        line = (json.dumps({"token": self._token, "event": event}) + "\n").encode()
        with self._lock:  # the heartbeat thread sends too: lines must not interleave
            try:
                if self._socket is not None:
                    self._socket.sendall(line)
            except OSError:
                self._socket = None  # the launcher is gone; keep training, stop reporting

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
