"""all_reduce through torch.distributed on backend "commrt" vs commrt's own API, and a DDP step
on "commrt" vs gloo: ``commrt launch -n 2 -- python -m workers.tdist_bench``.

The program lives in ``commrt.apps.tdist_bench``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.tdist_bench import main

if __name__ == "__main__":
    sys.exit(main())
