"""Ctrl-C and SIGTERM from a supervisor's first moment: ``manage.py`` installs ``install``'s handlers for ``up``
before Django is imported, and ``up`` reads what came meanwhile once its own handlers are in place.

*Why:* Python's default SIGINT handler raises KeyboardInterrupt wherever the main thread happens to be, and
one raised inside a ``__del__`` or a finalizer is printed and ignored. ``up`` imports for a second or more
before its handlers are in place (longer on a loaded machine). Once, on a fresh clone under the test suite's
load, a Ctrl-C 1.5 s into start-up was lost: ``up`` started every child and ran on
(``tests/test_up_command.py::test_ctrl_c_during_start_up_leaves_nothing[1.5]``; not reproduced in 60 tries,
so that this was the path is the likely cause, not a proven one). Recorded here, it cannot be lost.

Pure: no Django.
"""

from __future__ import annotations

import signal
from typing import Any

received: list[int] = []
"""The signals that came before ``up`` installed its own handlers."""


def _record(signum: int, frame: Any) -> None:
    received.append(signum)


def install() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _record)
