"""``python -m commrt.cli``: the ``commrt`` command."""
import sys

from commrt.cli import main

sys.exit(main())
