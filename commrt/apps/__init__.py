"""The programs behind the entry folders of the repository (``servers/``, ``workers/``) and the
``commrt server`` command: argument parsing and a main() over the public API. They live in the
package so that an installed commrt has them without installing generic top-level names."""

import logging

from commrt.obs import logfmt


def reporter(name: str, who: str) -> logging.Logger:
    """The logger a program reports through: INFO to stdout, each line prefixed once with
    ``[who]`` (``[rank 0]``, ``[worker 2]``), so interleaved output of several processes stays
    attributable; ``commrt launch`` leaves a line that starts with its own label for the process
    (``[rank N]``, ``[server I]``) as it is and labels the others (``[rank 0] [worker 0] ...``)."""
    logfmt.prefixed(who)
    return logging.getLogger(name)
