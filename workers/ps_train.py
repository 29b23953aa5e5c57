"""Train a small MLP against parameter servers:
``commrt launch -n 2 --servers 2 -- python -m workers.ps_train --steps 200``.

The program lives in ``commrt.apps.ps_train``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.ps_train import main

if __name__ == "__main__":
    sys.exit(main())
