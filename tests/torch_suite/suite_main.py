"""PyTorch's own distributed test suite (torch.testing._internal.distributed.distributed_test),
driven the way PyTorch's test/distributed/test_distributed_spawn.py drives it: env BACKEND,
WORLD_SIZE, TEMP_DIR (INIT_METHOD: the suite's file:// store), one process per rank per test.
Run through tests/torch_suite/run.py, which runs commrt and gloo and writes the table."""
import json
import os
import sys
import unittest

import torch.distributed as dist  # noqa: F401
from torch.testing._internal.common_distributed import DistTestCases

import commrt  # noqa: F401 (registers the "commrt" backend)

# what the suite needs to be told about a plugin backend (test_distributed_spawn does the same for
# gloo/nccl/ucc by name)
for feature in ("plugin", "ddp", "subgroup"):
    DistTestCases.backend_feature[feature].add("commrt")

from torch.testing._internal.distributed import distributed_test  # noqa: E402
from torch.testing._internal.distributed.distributed_test import DistributedTest, TestDistBackend  # noqa: E402

# SUITE_RUN_BACKEND: run on this backend the tests the suite selects for $BACKEND. The suite
# believes it runs $BACKEND (its skips by name, and the branches by name inside test bodies, such
# as "if BACKEND == 'gloo': build the CPU model"), while every process group it creates is
# SUITE_RUN_BACKEND's. This runs gloo-only-by-name tests (coalesced all_reduce, batch_isend_irecv
# on CPU, sparse all_reduce, barrier timeouts, DDP no_sync) on commrt unchanged.
if os.environ.get("SUITE_RUN_BACKEND"):
    _run_on, _named = os.environ["SUITE_RUN_BACKEND"], os.environ["BACKEND"]
    _init, _new_group = dist.init_process_group, dist.new_group

    def _swap(backend):
        return _run_on if backend in (None, _named) else backend

    def init_process_group(backend=None, *args, **kwargs):
        return _init(_swap(backend), *args, **kwargs)

    def new_group(ranks=None, timeout=None, backend=None, *args, **kwargs):
        return _new_group(ranks, timeout, _swap(backend), *args, **kwargs)

    dist.init_process_group, dist.new_group = init_process_group, new_group

if os.environ.get("BACKEND") in ("commrt", "gloo"):
    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):
        def setUp(self):
            super().setUp()
            self._spawn_processes()


class Recording(unittest.TextTestResult):
    """unittest's verdicts by test name (the suite's ranks log to the same streams), written after
    every test so that a run cut short still reports what it ran."""
    outcomes: dict = {}

    def stopTest(self, test):
        super().stopTest(test)
        with open(os.environ["TORCH_SUITE_RESULTS"], "w") as f:
            json.dump(self.outcomes, f)

    def addSuccess(self, test):
        super().addSuccess(test)
        self.outcomes[test._testMethodName] = "pass"

    def addFailure(self, test, err):
        super().addFailure(test, err)
        self.outcomes[test._testMethodName] = "fail"

    def addError(self, test, err):
        super().addError(test, err)
        self.outcomes[getattr(test, "_testMethodName", str(test))] = "fail"

    def addSkip(self, test, reason):
        super().addSkip(test, reason)
        self.outcomes[test._testMethodName] = f"skip: {reason}"


if __name__ == "__main__":
    runner = unittest.TextTestRunner(resultclass=Recording, verbosity=2)
    unittest.main(module="__main__", testRunner=runner, exit=False)
    with open(os.environ["TORCH_SUITE_RESULTS"], "w") as f:
        json.dump(Recording.outcomes, f)
