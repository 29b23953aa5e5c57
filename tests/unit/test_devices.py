"""The NCCL precondition check (runtime/devices.py), from hello tables alone: no GPU anywhere,
two ranks on one GPU (by UUID, so CUDA_VISIBLE_DEVICES tricks are caught), and the same GPU
index on two nodes, which is fine."""
from commrt.runtime import devices
from commrt.topology.nodes import Topology


def _gpu(index: int, uuid: str | None = None) -> dict:
    return {"device": f"cuda:{index}", "uuid": uuid or f"GPU-{index}"}


def test_one_gpu_per_rank_on_each_node_passes():
    layout = Topology((0, 0, 1, 1))
    assert devices.problems([_gpu(0), _gpu(1), _gpu(0), _gpu(1)], layout) == []


def test_a_rank_without_a_gpu_is_named_with_its_cause():
    why = devices.problems([_gpu(0), {"cause": "CUDA is not available on this host"}], Topology((0, 1)))
    assert why == ["rank 1: CUDA is not available on this host"]


def test_ranks_sharing_a_gpu_are_named_with_the_device_and_the_fix():
    layout = Topology((0, 0, 0, 1))
    why = devices.problems([_gpu(0), _gpu(1), _gpu(0, "GPU-1"), _gpu(0)], layout)
    assert why == ['ranks 1, 2 share GPU cuda:1 on node 0: NCCL needs one GPU per rank; run one rank '
                   'per GPU, or set [comm] backend = "auto" (zmq, which lets ranks share a GPU)']


def test_describe_without_cuda(monkeypatch):
    import torch  # devices.py imports it when describe() is called (a zmq rank never does)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "cause" in devices.describe(0)
