"""The collective matrix (matrix.py) on fewer dtypes and sizes, for slow set-ups (ranks in
network namespaces): still both the direct and the ring path of every collective and op."""
from __future__ import annotations

import torch

from tests.multirank.programs import matrix

matrix.DTYPES = [torch.float32, torch.bfloat16, torch.int64]
matrix.SIZES = [0, 7, 70001]
matrix.SHARD_SIZES = [0, 5, 20001]

if __name__ == "__main__":
    matrix.main()
