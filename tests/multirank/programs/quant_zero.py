"""ZeRO++ (ZeRO-3 + qwZ + qgZ + hpZ) on a multi-node world against exact ZeRO-3 on the same one.

The quantized gathers and reductions over the world take the two-hop path (exact inside each
node, quantized across). A TinyLM learns its counting corpus; the quantized run's mean loss over
the last 10 steps is within 10% of the loss the exact run shed, and every rank ends with the
same parameters. argv: steps."""
from __future__ import annotations

import sys

import torch

import commrt
from tests.multirank.programs.quant_train import loss_of, model

STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 30


def run(rank: int, **zero) -> tuple[list[float], dict]:
    from commrt.train import initialize
    engine = initialize(model=model(), config={"zero_optimization": {"stage": 3, **zero},
                                               "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}})
    losses = []
    for step in range(STEPS):
        loss = loss_of(engine.module, rank, step)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine.full_state_dict()


def same_everywhere(state: dict) -> None:
    flat = torch.cat([v.reshape(-1).float() for _, v in sorted(state.items())])
    got = torch.empty(flat.numel() * commrt.get_world_size())
    commrt.all_gather_into_tensor(got, flat)
    rows = got.view(commrt.get_world_size(), -1)
    assert all(torch.equal(rows[0], r) for r in rows), "ranks ended with different parameters"


def main() -> None:
    torch.set_num_threads(1)
    commrt.init_process_group()
    rank = commrt.get_rank()
    exact, _ = run(rank)
    quantized, state = run(rank, zero_hpz_partition_size=commrt.get_local_world_size(),
                           zero_quantized_weights=True, zero_quantized_gradients=True)
    same_everywhere(state)
    drop = exact[0] - sum(exact[-10:]) / 10
    gap = abs(sum(quantized[-10:]) / 10 - sum(exact[-10:]) / 10)
    print(f"rank {rank}: exact {exact[0]:.4f} -> {sum(exact[-10:]) / 10:.4f}, ZeRO++ gap {gap:.4f}", flush=True)
    assert gap <= 0.10 * drop, (gap, drop)
    stats = commrt.comm_stats()["quant"]
    assert stats["all_gather"]["hierarchical_calls"] > 0 and stats["reduce_scatter"]["hierarchical_calls"] > 0, stats
    commrt.destroy_process_group()
    print(f"rank {rank}: quant zero passed", flush=True)


if __name__ == "__main__":
    main()
