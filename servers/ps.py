"""One parameter-server shard: ``python -m servers.ps [--config F] [--index I] [--resume]``
(the same as ``commrt server``).

The program lives in ``commrt.apps.ps_server``; this folder is the repository's entry point for it.
"""
import sys

from commrt.apps.ps_server import main

if __name__ == "__main__":
    sys.exit(main())
