"""Whole-step capture: forward, backward and optimizer step in one graph."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.utils._pytree as pytree

from . import nvtx
from ._inputs import check_and_copy, flatten_sample
from .callables import finish_capture, new_graph


def check_optimizers(optimizers: Sequence[torch.optim.Optimizer]) -> None:
    """Raises ValueError for an optimizer that cannot be stepped inside a graph."""
    for position, optimizer in enumerate(optimizers):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizers[{position}] must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
        for index, group in enumerate(optimizer.param_groups):
            if "capturable" in group and not group["capturable"]:
                raise ValueError(
                    f"optimizers[{position}] ({type(optimizer).__name__}) param group {index} has "
                    "capturable=False: its step reads the step count on the host and cannot be "
                    f"captured. Construct it with capturable=True, e.g. {type(optimizer).__name__}"
                    "(params, lr=..., capturable=True)"
                )


class StepGraph:
    """A captured training step. Call it with new inputs to replay it.

    Attributes:
        graph: the ``torch.cuda.CUDAGraph``.
        static_inputs: the buffers the graph reads (flattened).
        static_outputs: what ``fn`` returned at capture, as static tensors
            (overwritten by every replay).
    """

    def __init__(self, graph, names, spec, static_inputs, static_outputs, output_spec):
        self.graph = graph
        self._names = names
        self._spec = spec
        self.static_inputs = static_inputs
        self.static_outputs = static_outputs
        self._output_spec = output_spec
        # A lone output (tensor or None) is the same static tensor after every replay: no
        # per-call unflatten. A container is rebuilt per call, so callers may mutate it.
        self._single = output_spec.is_leaf()
        # Inputs captured as plain positional tensors (the usual case) need no pytree walk per call.
        self._flat = spec == pytree.tree_flatten((tuple(static_inputs), {}))[1]

    def __call__(self, *inputs):
        if self._flat and len(inputs) == len(self.static_inputs) and all(
            isinstance(value, torch.Tensor) for value in inputs
        ):
            leaves, spec = inputs, self._spec
        else:
            leaves, spec = pytree.tree_flatten((tuple(inputs), {}))
        if spec != self._spec:
            raise TypeError(
                f"the step was captured with inputs {', '.join(self._names)} and must be called "
                f"with the same structure; got {len(inputs)} arguments"
            )
        check_and_copy("the captured step", self._names, self.static_inputs, leaves)
        with nvtx.range("graphs.replay.step"):
            self.graph.replay()
        return self._outputs()

    def _outputs(self):
        if self._single:
            return self.static_outputs[0]
        return pytree.tree_unflatten(self.static_outputs, self._output_spec)

    def replay(self):
        """Replays with whatever the static inputs hold (no copies, no checks)."""
        with nvtx.range("graphs.replay.step"):
            self.graph.replay()
        return self._outputs()


def capture_step(
    fn: Callable[..., Any],
    *static_inputs: torch.Tensor,
    num_warmup_iters: int = 3,
    pool=None,
    optimizers: Sequence[torch.optim.Optimizer] = (),
) -> StepGraph:
    """Captures ``fn(*static_inputs)`` (forward + backward + optimizer step).

    ``fn`` runs ``num_warmup_iters`` times eagerly on a side stream (real
    steps: parameters and optimizer state change, and lazily created state
    such as Adam's moments exists before capture), then once under capture.
    The returned :class:`StepGraph` copies new inputs into the static buffers
    and replays; it returns ``fn``'s outputs as static tensors.

    Args:
        fn: the step; it must return tensors (e.g. the loss) or None.
        static_inputs: CUDA tensors (batch, targets, ``m_splits``...). They
            are used as the static buffers themselves (not copied).
        num_warmup_iters: eager steps before capture; at least 1.
        pool: memory pool handle to capture into; a new one by default.
        optimizers: optimizers that ``fn`` steps, checked for
            ``capturable=True`` before anything runs.

    .. warning::
        Preconditions:

        - every optimizer stepped inside supports capture and was built with
          ``capturable=True`` (Adam, AdamW, ...); a learning-rate schedule must
          update a tensor ``lr`` in place, not a Python float;
        - ``fn`` sets gradients to None before its backward
          (``zero_grad(set_to_none=True)``), so backward allocates them inside
          the graph's pool, or zeroes persistent ones in place;
        - ``fn`` has no host synchronisation (``.item()``, ``.tolist()``, a
          print of a tensor) and its Python control flow does not depend on
          tensor values; every op is graph-safe;
        - the warm-up steps are real training steps on the given inputs;
        - new inputs have the static inputs' shapes, dtypes and device;
          outputs are overwritten by the next replay.
    """
    if not callable(fn):
        raise TypeError(f"fn must be callable, got {type(fn).__name__}")
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(f"num_warmup_iters must be an int >= 1, got {num_warmup_iters!r}")
    check_optimizers(list(optimizers))
    leaves, names, spec = flatten_sample("capture_step", static_inputs, {})
    if not torch.cuda.is_available():
        raise RuntimeError("capture_step needs a CUDA device, and torch sees none")
    devices = {t.device for t in leaves}
    if len(devices) > 1:
        raise ValueError(f"all static inputs must be on one CUDA device, got {sorted(map(str, devices))}")
    device = devices.pop() if devices else torch.device("cuda", torch.cuda.current_device())

    with nvtx.range("graphs.capture_step"), torch.cuda.device(device):
        torch.cuda.synchronize(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with nvtx.range("graphs.warmup"), torch.cuda.stream(side):
            for _ in range(num_warmup_iters):
                fn(*static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        torch.cuda.synchronize(device)

        graph = new_graph()
        with nvtx.range("graphs.capture"):
            with torch.cuda.graph(graph, pool=pool):
                result = fn(*static_inputs)
        finish_capture(graph)
    outputs, output_spec = pytree.tree_flatten(result)
    for position, leaf in enumerate(outputs):
        if leaf is not None and not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"the captured step returned a {type(leaf).__name__} as output {position}; return "
                "tensors or None (a graph cannot recompute a Python value)"
            )
    return StepGraph(graph, names, spec, list(leaves), outputs, output_spec)


__all__ = ["capture_step", "StepGraph", "check_optimizers"]
