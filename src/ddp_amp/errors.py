"""The project's own error type. The CLI turns it into one line on stderr and exit code 2."""


class UsageError(Exception):
    """Bad user input, found before anything is launched. Each message names the offending flag."""

    def __init__(self, *problems: str) -> None:
        super().__init__("; ".join(problems))
        self.problems = list(problems)


class RunFailed(Exception):
    """A launched run failed (a rank raised or died). The message names the rank and its error."""

    def __init__(self, message: str, exit_code: int = 1, details: str = "") -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.details = details
        """What the failing rank printed (its traceback), shown before the one-line message."""


class RankSetupError(Exception):
    """A problem a rank finds before it trains (the task breaks its contract, no room for the weights). The
    message says it all: it is reported as one line, without the traceback that led to it."""
