"""Static input buffers: checks at capture and the copy-in at replay.

A captured graph reads its inputs from fixed addresses. Each call copies the
new arguments into those buffers, after checking that they fit: same shape,
dtype and device as the sample the graph was captured with.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree


def describe(tensor: torch.Tensor) -> str:
    return f"shape {tuple(tensor.shape)}, dtype {tensor.dtype}, device {tensor.device}"


def flatten_sample(what: str, args: Sequence[Any], kwargs: dict) -> tuple[list[torch.Tensor], list[str], Any]:
    """Flattens sample args/kwargs into tensors, their names and the tree spec.

    Every leaf must be a CUDA tensor: a graph cannot see a Python value change.
    """
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"{what}: sample args must be a tuple of tensors, got {type(args).__name__}")
    if not isinstance(kwargs, dict):
        raise TypeError(f"{what}: sample kwargs must be a dict, got {type(kwargs).__name__}")
    kwargs = dict(sorted(kwargs.items()))
    leaves, spec = pytree.tree_flatten((tuple(args), kwargs))
    names = leaf_names(args, kwargs)
    for name, leaf in zip(names, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"{what}: every sample argument must be a tensor (the graph cannot see a Python value "
                f"change), but {name} is {type(leaf).__name__} {leaf!r}; bind constants with "
                "functools.partial and pass m_splits as a device tensor"
            )
        if leaf.device.type != "cuda":
            raise ValueError(f"{what}: sample {name} must be a CUDA tensor, got {describe(leaf)}")
    return leaves, names, spec


def leaf_names(args: Sequence[Any], kwargs: dict) -> list[str]:
    """Readable names of the leaves, in pytree order: ``args[1]``, ``kwargs['m_splits']``."""
    names: list[str] = []
    for path, _ in pytree.tree_flatten_with_path((tuple(args), dict(kwargs)))[0]:
        head, *rest = path
        label = "args" if head.idx == 0 else "kwargs"
        names.append(label + "".join(str(key) for key in rest))
    return names


def make_static(sample: torch.Tensor) -> torch.Tensor:
    """A buffer the graph owns, filled with the sample, keeping its requires_grad."""
    static = sample.detach().clone()
    static.requires_grad_(sample.requires_grad)
    return static


_ONE_COPY_BYTES = 1 << 20  # inputs at least this large are copied one by one


def check_and_copy(what: str, names: Sequence[str], statics: Sequence[torch.Tensor], values: Sequence[Any]) -> None:
    """Checks new inputs against the static buffers and copies them in."""
    if len(values) != len(statics):
        raise TypeError(
            f"{what} was captured with {len(statics)} tensor arguments ({', '.join(names)}) "
            f"but got {len(values)}"
        )
    targets, sources = [], []
    for name, static, value in zip(names, statics, values):
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}: {name} must be a tensor like the sample ({describe(static)}), got {type(value).__name__}")
        if value.shape != static.shape or value.dtype != static.dtype or value.device != static.device:
            raise ValueError(
                f"{what}: {name} has {describe(value)} but the graph was captured with "
                f"{describe(static)}; a graph replays fixed shapes, so pad the input to the captured "
                "size or capture another graph"
            )
        if value.requires_grad and not static.requires_grad:
            raise ValueError(
                f"{what}: {name} requires grad but its sample did not, so the captured backward "
                "computes no gradient for it; capture with a sample that requires grad"
            )
        if value.data_ptr() != static.data_ptr() or value.stride() != static.stride():
            targets.append(static)
            sources.append(value)
    if targets:
        with torch.no_grad():
            # Inputs of _ONE_COPY_BYTES or more get one copy_ each, whose kernel runs
            # near HBM bandwidth where _foreach_copy_'s multi-tensor kernel does not.
            # Smaller ones share one _foreach_copy_ dispatch: for them the host cost
            # of a replay, what graphs save, is what counts (docs/graphs.md).
            small_targets, small_sources = [], []
            for target, source in zip(targets, sources):
                if target.numel() * target.element_size() >= _ONE_COPY_BYTES:
                    target.copy_(source)
                else:
                    small_targets.append(target)
                    small_sources.append(source)
            if small_targets:
                torch._foreach_copy_(small_targets, small_sources)
