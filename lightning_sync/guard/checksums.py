"""Checksums of parameters and buffers (replicas must agree bit for bit)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor

__all__ = ["parameter_checksums"]


def parameter_checksums(module: torch.nn.Module, buffers: bool = True,
                        skip: set[str] | None = None) -> Iterator[tuple[str, float]]:
    """``(name, checksum)`` per parameter (and buffer): the float64 sum plus an index-weighted sum.

    The weighted term makes permutations of the same values visible; both are exact for identical
    tensors, so replicas must agree bit for bit.
    """
    named: list[tuple[str, Tensor]] = list(module.named_parameters())
    if buffers:
        named += list(module.named_buffers())
    for name, tensor in named:
        if skip and name in skip:
            continue
        flat = tensor.detach().reshape(-1).to(torch.float64)
        if flat.numel() == 0:
            yield name, 0.0
            continue
        weights = torch.arange(1, flat.numel() + 1, dtype=torch.float64, device=flat.device).remainder_(7919)
        yield name, float(flat.sum()) + float((flat * weights).sum()) * 1e-3
