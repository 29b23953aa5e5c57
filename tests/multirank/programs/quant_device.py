"""The torch-codec path of the quantized collectives gives bit for bit what the numpy path
gives, with ranks of both kinds in one collective.

    quant_device cpu    the even ranks run the torch codec on CPU tensors (no GPU needed)
    quant_device cuda   the even ranks hold CUDA tensors (encoded, exchanged, decoded there)

Every case runs once with every rank on the numpy path (the reference), then, after a re-init
with ``[quant] cpu_codec = "torch"`` on the even ranks (cpu) or CUDA tensors there (cuda), mixed;
the results must be equal bit for bit (and so the same on every rank, as the numpy path's are).
"""
from __future__ import annotations

import sys

import torch

import commrt
import commrt.quant as cq
from commrt.quant import collectives
from commrt.runtime.config import load_config
from tests.multirank.programs.quant_job import check_non_finite_fails_everywhere, data

SIZES = [0, 1, 1003, 70001]
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


class Pass:
    """One pass over the cases: the reference (``want`` is None) records every result, the mixed
    pass compares each with the reference's, in the same order."""

    def __init__(self, device: torch.device, want: list | None = None):
        self.device, self.want, self.results = device, want, []

    def __call__(self, run, what: str) -> None:
        got = run(self.device).cpu()
        self.results.append(got)
        if self.want is None:
            return
        want = self.want[len(self.results) - 1]
        if got.shape != want.shape or (want.numel() and not torch.equal(
                got.contiguous().view(-1).view(torch.uint8), want.contiguous().view(-1).view(torch.uint8))):
            raise AssertionError(f"{what}: the torch-codec path differs from the numpy path")


def cases(rank: int, n: int, both_ways: Pass) -> int:
    count = 0
    for quant in ("int8", "int4"):
        for dtype in DTYPES:
            for numel in SIZES:
                x = data(numel, rank, dtype, seed=numel)
                tag = f"{quant} {dtype} n={numel}"

                def reduce(dev, op):
                    t = x.to(dev, copy=True)
                    cq.all_reduce(t, op=op, quant=quant)
                    return t
                both_ways(lambda d: reduce(d, "SUM"), f"all_reduce SUM {tag}")
                both_ways(lambda d: reduce(d, "AVG"), f"all_reduce AVG {tag}")

                def gather(dev):
                    out = torch.empty(n * numel, dtype=dtype, device=dev)
                    cq.all_gather_into_tensor(out, x.to(dev, copy=True), quant=quant)
                    return out
                both_ways(gather, f"all_gather {tag}")

                def scatter(dev):
                    out = torch.empty(numel, dtype=dtype, device=dev)
                    cq.reduce_scatter_tensor(out, data(n * numel, rank, dtype, 5).to(dev, copy=True), op="AVG", quant=quant)
                    return out
                both_ways(scatter, f"reduce_scatter {tag}")
                count += 4
    return count


def feedback_steps(rank: int, both_ways: Pass) -> None:
    """Three int4 steps with error feedback: the state is kept on the device path too."""
    def run(dev):
        fb, t = cq.ErrorFeedback(0.8, 0), None
        for step in range(3):
            t = data(1003, rank, torch.float32, step).to(dev, copy=True)
            cq.all_reduce(t, op="AVG", quant="int4", feedback=fb)
        return t
    both_ways(run, "all_reduce with feedback")


def main() -> None:
    kind = sys.argv[1]
    commrt.init_process_group()  # every rank on the numpy path: the reference
    rank, n = commrt.get_rank(), commrt.get_world_size()
    reference = Pass(torch.device("cpu"))
    cases(rank, n, reference)
    feedback_steps(rank, reference)
    commrt.destroy_process_group()
    mine = rank % 2 == 0
    codec = "torch" if mine and kind == "cpu" else "numpy"
    commrt.init_process_group(config=load_config(overrides={"quant": {"cpu_codec": codec}}))
    torch_path = isinstance(collectives._values(torch.zeros(3), "probe"), torch.Tensor)
    assert torch_path == (codec == "torch"), f"rank {rank}: [quant] cpu_codec = {codec!r} was not followed"
    mixed = Pass(torch.device("cuda") if mine and kind == "cuda" else torch.device("cpu"), reference.results)
    count = cases(rank, n, mixed)
    feedback_steps(rank, mixed)
    # the last rank's NaN, on whichever path it runs: every rank raises, nothing is written
    check_non_finite_fails_everywhere(rank, n, mixed.device)
    commrt.destroy_process_group()
    print(f"rank {rank}: quant device path identical in {count} cases", flush=True)


if __name__ == "__main__":
    main()
