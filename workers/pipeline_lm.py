"""Train a small next-token model as a pipeline, one stage per rank:
``commrt launch -n 2 -- python -m workers.pipeline_lm --schedule 1f1b``.

The program lives in ``commrt.apps.pipeline_lm``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.pipeline_lm import main

if __name__ == "__main__":
    sys.exit(main())
