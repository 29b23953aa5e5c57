"""Train a small transformer LM with the commrt engine:
``commrt launch -n 2 -- python -m workers.train_lm --stage 3``.

The program lives in ``commrt.apps.train_lm``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.train_lm import main

if __name__ == "__main__":
    sys.exit(main())
