"""PyTorch's own distributed test suite (torch.testing._internal.distributed.distributed_test),
driven the way PyTorch's test/distributed/test_distributed_spawn.py drives it: env BACKEND,
WORLD_SIZE, TEMP_DIR (INIT_METHOD: the suite's file:// store), one process per rank per test.
Run through tests/torch_suite/run.py, which runs commrt and gloo and writes the table."""
import os
import sys

import torch.distributed as dist  # noqa: F401
from torch.testing._internal.common_distributed import DistTestCases
from torch.testing._internal.common_utils import run_tests

import commrt  # noqa: F401 (registers the "commrt" backend)

# what the suite needs to be told about a plugin backend (test_distributed_spawn does the same for
# gloo/nccl/ucc by name); commrt has no recv from any source (matching is by (src, tag))
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("commrt")
DistTestCases.skip_collective["sendrecv anysource"].add("commrt")

from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

if os.environ.get("BACKEND") in ("commrt", "gloo"):
    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()

if __name__ == "__main__":
    sys.argv[1:1] = []
    run_tests()
