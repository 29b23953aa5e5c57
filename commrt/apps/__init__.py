"""The programs behind the entry folders of the repository (``servers/``, ``workers/``) and the
``commrt server`` command: argument parsing and a main() over the public API. They live in the
package so that an installed commrt has them without installing generic top-level names."""

import logging
import sys


def reporter(name: str, who: str) -> logging.Logger:
    """The logger a program reports through: INFO to stdout, each line prefixed with ``who``
    (``worker 2``, ``rank 0``), so interleaved output of several processes stays attributable."""
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format=f"{who}: %(message)s", force=True)
    return logging.getLogger(name)
