"""Process plumbing that needs no torch."""

from __future__ import annotations

import signal


def die_with_parent(sig: int = signal.SIGKILL) -> None:
    """Ask Linux to send `sig` to this process when its parent dies, so nothing outlives a killed launcher."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, sig)
    except (OSError, AttributeError):
        pass  # not Linux: rely on the launcher's own clean-up
