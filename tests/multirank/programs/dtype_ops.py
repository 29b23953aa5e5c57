"""programs/int_avg.py, half_avg.py and bool_ops.py in one launch (each launch imports torch on
every rank, which costs more than their checks): each one's checks in turn on one world, each
printing its own 'passed' line (tests/multirank/test_matrix.py)."""
from __future__ import annotations

import commrt
from tests.multirank.programs import bool_ops, half_avg, int_avg


def main() -> None:
    commrt.init_process_group()
    for program in (int_avg, half_avg, bool_ops):
        program.checks()
    commrt.destroy_process_group()


if __name__ == "__main__":
    main()
