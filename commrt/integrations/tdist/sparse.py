"""SUM all-reduce of a sparse COO tensor, as gloo offers it: every rank's (indices, values) are
gathered (padded to the largest count, then trimmed), summed by coalescing, and copied back into
the caller's tensor. Runs synchronously: the sizes must be known before the data can move."""
from __future__ import annotations

import torch

from commrt.integrations.tdist.compose import wire_view


def all_reduce_sparse(backend, t: torch.Tensor, size: int) -> None:
    c = t.coalesce()
    idx, vals = c.indices(), wire_view(c.values().contiguous())
    counts = torch.empty(size, dtype=torch.int64)
    backend.all_gather_into_tensor(counts, torch.tensor([idx.shape[1]], dtype=torch.int64))
    most = int(counts.max())
    pad_idx = torch.zeros((idx.shape[0], most), dtype=torch.int64)
    pad_idx[:, :idx.shape[1]] = idx
    pad_vals = torch.zeros((most, *vals.shape[1:]), dtype=vals.dtype)
    pad_vals[:vals.shape[0]] = vals
    all_idx = torch.empty((size, *pad_idx.shape), dtype=torch.int64)
    all_vals = torch.empty((size, *pad_vals.shape), dtype=vals.dtype)
    backend.all_gather_into_tensor(all_idx, pad_idx)
    backend.all_gather_into_tensor(all_vals, pad_vals)
    n = counts.tolist()
    summed = torch.sparse_coo_tensor(torch.cat([all_idx[r, :, :n[r]] for r in range(size)], dim=1),
                                     torch.cat([all_vals[r, :n[r]] for r in range(size)]).view(c.values().dtype),
                                     t.shape).coalesce()
    t.copy_(summed)
