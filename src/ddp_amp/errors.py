"""The project's own error types: UsageError is one line on stderr and exit code 2, a failed run one line and 1."""

from __future__ import annotations

import re
from typing import Literal


class UsageError(Exception):
    """Bad user input, found before anything is launched. Each message names the offending flag."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class RunFailed(Exception):
    """A launched run failed (a rank raised or died). The message names the rank and its error."""

    def __init__(self, message: str, exit_code: int = 1, details: str = "", *, rank: int | None = None,
                 note: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.details = details
        """What the failing rank printed (its traceback), shown before the one-line message."""
        self.rank = rank
        """The rank the launcher named (from the processes' exits), where the message names one."""
        self.note = note
        """What the message says after the rank and its failure (where the agent's log is)."""

    def retold(self, rank: int, what: str) -> RunFailed:
        """The same failure, naming `rank` and `what` it did: the rank whose error reached the progress display
        first, where the launcher named another (the rank whose process ended first)."""
        return RunFailed(f"rank {rank} {what}{self.note}", self.exit_code, rank=rank, note=self.note)

    def as_usage_error(self) -> RunFailed:
        """A rank failed for a flag that does not fit what only a rank can see (its error event's kind is
        "usage"): exit 2, as for any other bad flag."""
        self.exit_code = 2
        return self


class RankSetupError(Exception):
    """A problem a rank finds before it trains (the task breaks its contract, no room for the weights). The
    message says it all: it is reported as one line, without the traceback that led to it."""


class RankUsageError(RankSetupError):
    """A flag that does not fit what only a rank can see (the task's data set, the metrics its evaluation
    logs): one line, and the launcher exits 2, as for any other bad flag."""


class RankOutOfMemory(Exception):
    """A rank ran out of memory where no halving of --micro-batch can help. Reported as one line, like
    RankSetupError; the allocator's own error and traceback stay in the rank's log."""


FailureKind = Literal["usage", "setup", "out_of_memory", "interrupted", "exception"]
"""What kind of failure ended a rank: sent as the `kind` of its error event (rank.reporter), so that the launcher
decides by it (a usage failure exits 2, as a bad flag does) and never by the text of a traceback."""


def failure_kind(exc: BaseException) -> FailureKind:
    if isinstance(exc, RankUsageError):
        return "usage"
    if isinstance(exc, RankSetupError):
        return "setup"
    if isinstance(exc, RankOutOfMemory):
        return "out_of_memory"
    if isinstance(exc, KeyboardInterrupt):  # a script's rank that SIGINT reached (a stop, when one was passed on)
        return "interrupted"
    return "exception"


SELF_EXPLAINING = ("RankSetupError", "RankUsageError", "RankOutOfMemory")


def failure_line(last_traceback_line: str) -> str:
    """A failed rank's last traceback line as the launcher's one line: the errors whose message says it all
    lose their type ("ddp_amp.errors.RankOutOfMemory: out of memory in step 3..." -> "out of memory...")."""
    return re.sub(rf"^(ddp_amp\.[\w.]+\.)?({'|'.join(SELF_EXPLAINING)}): ", "", last_traceback_line.strip())


def exception_line(traceback_text: str) -> str:
    """The first line of the exception's message in a formatted traceback (its last exception, where one was
    raised while handling another): DDP's and gloo's messages run over several lines, and their last one
    ("In addition, you can set the environment variable ...") names nothing."""
    lines = traceback_text.rstrip().splitlines()
    frames = [i for i, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    for line in lines[start:]:
        if line.strip() and not line.startswith(" "):
            return line
    return lines[-1] if lines else ""


PEER_SYMPTOMS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "Socket closed",
                 "failed to recv", "Timed out", "timed out", "NCCL communicator was aborted",
                 "ProcessGroup abort", "has been destroyed")
"""What a rank says when it failed only because another one vanished: never the cause when another rank
failed with something else."""


def is_peer_symptom(message: str) -> bool:
    return any(symptom in message for symptom in PEER_SYMPTOMS)
