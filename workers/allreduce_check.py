"""Check every collective, then an all_reduce bandwidth table:
``commrt launch -n 4 -- python -m workers.allreduce_check``.

The program lives in ``commrt.apps.allreduce_check``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.allreduce_check import main

if __name__ == "__main__":
    sys.exit(main())
