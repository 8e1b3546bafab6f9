"""Imported first in the fork server only (see forkserver.PRELOAD): the fork server dies with its launcher.

Importing it anywhere else would tie that process to its parent; nothing else imports it.
"""

import os
import signal

from ddp_amp.process import FORKSERVER_PID_VAR, LAUNCHER_PID_VAR, die_with_parent

_launcher = os.environ.get(LAUNCHER_PID_VAR)
if _launcher:
    if str(os.getppid()) != _launcher:
        os.kill(os.getpid(), signal.SIGKILL)  # the launcher died before we got here
    die_with_parent(signal.SIGKILL)
    os.environ[FORKSERVER_PID_VAR] = str(os.getpid())  # every rank forked from here inherits it
