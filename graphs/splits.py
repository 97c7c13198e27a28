"""Token-count (``m_splits``) generators for replay tests.

Each generator returns an int tensor of ``num_experts`` non-negative counts
that sum exactly to ``total`` (the static token count of a captured graph).
They use tensor operations only (no ``.item()``, ``.tolist()`` or branches on
values), so on a CUDA device they run without a host synchronisation; on the
CPU they are cheap, and the result is copied into a graph's static
``m_splits`` buffer outside the graph.

Patterns (``PATTERNS``):

- ``balanced``: ``total // E`` each, the remainder spread over the first experts.
- ``skewed``: log-normal shares (``exp(sigma * N(0, 1))``), apportioned by
  largest remainder.
- ``zero_token_experts``: a random subset of experts (at least one, at most
  E - 1) gets no tokens; the others share ``total`` log-normally.
- ``all_to_one``: one random expert gets every token.
"""

from __future__ import annotations

import itertools
from typing import Iterator, Optional, Sequence, Union

import torch

PATTERNS = ("balanced", "skewed", "zero_token_experts", "all_to_one")

DeviceLike = Union[str, torch.device, None]


def _check_sizes(num_experts: int, total: int) -> None:
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 0:
        raise ValueError(f"total must be a non-negative int, got {total!r}")


def _generator_device(generator: Optional[torch.Generator], device: torch.device) -> None:
    if generator is not None and torch.device(generator.device).type != device.type:
        raise ValueError(
            f"the generator lives on {generator.device} but the splits are made on {device}; "
            "pass a generator of the same device type (or none)"
        )


def _apportion(weights: torch.Tensor, total: int) -> torch.Tensor:
    """Largest-remainder apportionment of ``total`` by non-negative ``weights``.

    Experts with zero weight get zero. Pure tensor code: no host reads.
    """
    shares = weights / weights.sum() * total
    counts = shares.floor()
    fraction = torch.where(weights > 0, shares - counts, torch.full_like(shares, -1.0))
    missing = total - counts.sum()  # a tensor: how many experts get one more token
    order = fraction.argsort(descending=True, stable=True)
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    return counts.long() + (rank < missing).long()


def make_splits(
    pattern: str,
    num_experts: int,
    total: int,
    *,
    generator: Optional[torch.Generator] = None,
    device: DeviceLike = None,
    dtype: torch.dtype = torch.int32,
    sigma: float = 1.5,
) -> torch.Tensor:
    """Token counts per expert for ``pattern``, summing to ``total``.

    Args:
        pattern: one of :data:`PATTERNS`.
        num_experts: E, the length of the result.
        total: the sum of the counts (the static token count).
        generator: random source (on ``device``'s type); the global one if None.
        device: where to build the tensor (CPU by default). On CUDA no host
            synchronisation happens.
        dtype: ``torch.int32`` or ``torch.int64``.
        sigma: spread of the log-normal shares of ``skewed`` and
            ``zero_token_experts``.
    """
    _check_sizes(num_experts, total)
    if dtype not in (torch.int32, torch.int64):
        raise TypeError(f"dtype must be torch.int32 or torch.int64, got {dtype}")
    device = torch.device("cpu" if device is None else device)
    _generator_device(generator, device)
    floats = {"dtype": torch.float64, "device": device}
    if pattern == "balanced":
        counts = torch.full((num_experts,), total // num_experts, dtype=torch.int64, device=device)
        counts[: total % num_experts] += 1
    elif pattern == "skewed":
        weights = (torch.randn(num_experts, generator=generator, **floats) * sigma).exp()
        counts = _apportion(weights, total)
    elif pattern == "zero_token_experts":
        weights = (torch.randn(num_experts, generator=generator, **floats) * sigma).exp()
        if num_experts > 1:
            # A random number of zero experts in [1, E - 1], at random places.
            num_zero = torch.randint(1, num_experts, (1,), generator=generator, device=device)
            order = torch.rand(num_experts, generator=generator, **floats).argsort()
            rank = torch.empty_like(order)
            rank[order] = torch.arange(num_experts, device=device)
            weights = torch.where(rank < num_zero, torch.zeros_like(weights), weights)
        counts = _apportion(weights, total)
    elif pattern == "all_to_one":
        expert = torch.randint(num_experts, (1,), generator=generator, device=device)
        counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
        counts.index_fill_(0, expert, total)
    else:
        raise ValueError(f"unknown split pattern {pattern!r}; expected one of {PATTERNS}")
    return counts.to(dtype)


def split_stream(
    patterns: Union[str, Sequence[str]],
    num_experts: int,
    total: int,
    *,
    seed: int = 0,
    device: DeviceLike = None,
    dtype: torch.dtype = torch.int32,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Endless ``(pattern, splits)`` pairs, cycling through ``patterns``.

    Reproducible from ``seed``. Typical use::

        for step, (pattern, splits) in zip(range(1000), split_stream(PATTERNS, 8, 4096)):
            static_splits.copy_(splits)
            graph.replay()
    """
    if isinstance(patterns, str):
        patterns = (patterns,)
    patterns = tuple(patterns)
    if not patterns:
        raise ValueError("patterns must name at least one split pattern")
    for pattern in patterns:
        if pattern not in PATTERNS:
            raise ValueError(f"unknown split pattern {pattern!r}; expected one of {PATTERNS}")
    _check_sizes(num_experts, total)
    device = torch.device("cpu" if device is None else device)
    generator = torch.Generator(device=device).manual_seed(seed)
    for pattern in itertools.cycle(patterns):
        yield pattern, make_splits(pattern, num_experts, total, generator=generator, device=device, dtype=dtype)


def check_splits(splits: torch.Tensor, num_experts: int, total: int) -> None:
    """Raises ValueError unless ``splits`` holds E non-negative ints summing to ``total``.

    Reads the counts on the host: for tests and debugging, never under capture.
    """
    if not isinstance(splits, torch.Tensor):
        raise TypeError(f"splits must be a torch.Tensor, got {type(splits).__name__}")
    if splits.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"splits must be int32 or int64, got {splits.dtype}")
    if splits.shape != (num_experts,):
        raise ValueError(f"splits must have shape ({num_experts},), got {tuple(splits.shape)}")
    values = splits.tolist()
    if min(values) < 0 or sum(values) != total:
        raise ValueError(f"splits must be non-negative and sum to {total}, got {values} (sum {sum(values)})")


__all__ = ["PATTERNS", "make_splits", "split_stream", "check_splits"]
