"""The one rank prefix of a log line (issue 31.7).

A line of a multi-rank job carries exactly one ``[rank N]`` (or ``[server I]``, ``[worker W]``)
at its start. Whoever writes the line first adds it: a program's log format (``prefixed``,
below), else ``commrt launch``, whose output pump labels only the lines that do not already start
with their label (raw prints, tracebacks). The library's own messages therefore never begin with
the rank: the format adds it, so a line does not read ``[rank 1] rank 1: rank 1: ...``. Under
torchrun, or any launcher that does not label lines, the same format gives the same lines.
"""
from __future__ import annotations

import logging
import sys
from typing import IO


def label(who: str) -> str:
    """The prefix for ``who`` (``rank 0``, ``server 1``): ``[rank 0]``, as ``commrt launch`` writes it."""
    return f"[{who}]"


def prefixed(who: str, stream: IO[str] | None = None, level: int = logging.INFO) -> logging.Handler:
    """Route every log record of this process to ``stream`` (stdout by default), each line
    prefixed once with ``[who]``; replaces the root logger's handlers (the process is a program's
    main, not a library). Returns the handler."""
    handler = logging.StreamHandler(sys.stdout if stream is None else stream)
    handler.setFormatter(logging.Formatter(f"{label(who)} %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level)
    return handler
