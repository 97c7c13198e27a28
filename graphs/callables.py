"""``make_graphed_callables``: forward, backward (and delayed wgrad) graphs.

Each callable (a module or a function) is warmed up on a side stream, then its
forward and backward are captured as CUDA graphs into one shared memory pool,
in the order the training schedule runs them. The returned
:class:`GraphedCallable` copies new inputs (``m_splits`` included) into the
static buffers and replays.

Memory in a shared pool is only safe when graphs replay in the order they
were captured: a block freed at the end of one capture can hold live data of
a later one. So the replay order is checked, cyclically, and a different
order is an error rather than silent corruption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.utils._pytree as pytree

from . import nvtx
from ._inputs import check_and_copy, flatten_sample, make_static

FORWARD, BACKWARD, WGRAD = "forward", "backward", "wgrad"


# Called with the pool between two captures. For graphs.testing, which perturbs
# the allocator there to make results that depend on allocation history show.
_between_captures: list[Callable[[Any], None]] = []


class ReplayOrderError(RuntimeError):
    """Graphs sharing a pool were replayed in an order other than the captured one."""


def new_graph() -> torch.cuda.CUDAGraph:
    """A CUDA graph that keeps its cudaGraph_t, so that ``graphs.inspect`` can read it."""
    return torch.cuda.CUDAGraph(keep_graph=True)


def finish_capture(graph: torch.cuda.CUDAGraph) -> None:
    """Instantiates a kept graph now rather than at its first replay."""
    graph.instantiate()


class Schedule:
    """The captured order of the graphs of one :func:`make_graphed_callables` call.

    Replays must follow it cyclically; :meth:`reset` starts a new cycle (after
    an exception interrupted a step, for instance).
    """

    def __init__(self, steps: Sequence[tuple[str, int]]):
        self.steps = list(steps)
        self.position = 0

    def advance(self, step: tuple[str, int]) -> None:
        expected = self.steps[self.position]
        if step != expected:
            raise ReplayOrderError(
                f"graphs captured into one memory pool in the order {self.describe()} must be "
                f"replayed in that order, but {_label(step)} was called when {_label(expected)} "
                "was next. Replaying out of order lets one graph overwrite memory another still "
                "needs. Pass order=... to make_graphed_callables to capture the schedule you run, "
                "or call .schedule.reset() after an interrupted step."
            )
        self.position = (self.position + 1) % len(self.steps)

    def reset(self) -> None:
        self.position = 0

    def describe(self) -> str:
        return "[" + ", ".join(_label(step) for step in self.steps) + "]"


def _label(step: tuple[str, int]) -> str:
    return f"{step[0]} of callable {step[1] + 1}"


@dataclass
class _State:
    """Everything one graphed callable needs at replay."""

    index: int
    function: Callable
    module: Optional[torch.nn.Module]
    schedule: Schedule
    arg_names: list[str]
    arg_spec: Any
    static_args: list[torch.Tensor]
    params: tuple[torch.Tensor, ...]
    training_flags: tuple[tuple[torch.nn.Module, bool], ...]
    delayed_modules: list[torch.nn.Module]
    forward_graph: torch.cuda.CUDAGraph = field(default_factory=new_graph)
    backward_graph: Optional[torch.cuda.CUDAGraph] = None
    wgrad_graph: Optional[torch.cuda.CUDAGraph] = None
    static_outputs: list[torch.Tensor] = field(default_factory=list)
    output_spec: Any = None
    differentiable: list[bool] = field(default_factory=list)
    static_grad_outputs: list[torch.Tensor] = field(default_factory=list)
    static_grad_inputs: list[Optional[torch.Tensor]] = field(default_factory=list)
    static_wgrads: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    ranges: dict[str, str] = field(default_factory=dict)

    @property
    def surface(self) -> list[torch.Tensor]:
        """The graph's full input surface: user arguments, then module parameters."""
        return [*self.static_args, *self.params]

    @property
    def name(self) -> str:
        return f"callable {self.index + 1} ({type(self.function).__name__})"


class _Replay(torch.autograd.Function):
    """Replays the forward graph; its backward replays the backward graph."""

    @staticmethod
    def forward(ctx, state: _State, leaf_mask: tuple[bool, ...], *inputs):
        ctx.state = state
        ctx.leaf_mask = leaf_mask
        with nvtx.range(state.ranges[FORWARD]):
            state.schedule.advance((FORWARD, state.index))
            state.forward_graph.replay()
        outputs = tuple(o.detach() for o in state.static_outputs)
        ctx.mark_non_differentiable(*[o for o, d in zip(outputs, state.differentiable) if not d])
        return outputs

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, *grads):
        state: _State = ctx.state
        if state.backward_graph is None:
            raise RuntimeError(f"{state.name} was captured without a backward graph (no output required grad)")
        with nvtx.range(state.ranges[BACKWARD]):
            state.schedule.advance((BACKWARD, state.index))
            for static, grad, differentiable in zip(state.static_grad_outputs, grads, state.differentiable):
                if differentiable and static.data_ptr() != grad.data_ptr():
                    static.copy_(grad)
            state.backward_graph.replay()
        return (None, None, *_hand_out(state, ctx.leaf_mask))


def _hand_out(state: _State, leaf_mask: tuple[bool, ...]) -> list[Optional[torch.Tensor]]:
    """The static input gradients, safe to hand to autograd.

    Autograd steals a gradient tensor it can (when ``.grad`` is None), which
    would make ``.grad`` alias a buffer the next replay overwrites. Leaves
    whose ``.grad`` is None therefore get a copy.
    """
    grads: list[Optional[torch.Tensor]] = []
    num_args = len(state.static_args)
    for position, static in enumerate(state.static_grad_inputs):
        if static is None:
            grads.append(None)
            continue
        if position >= num_args:
            fresh = state.params[position - num_args].grad is None
        else:
            fresh = leaf_mask[position]
        grads.append(static.clone() if fresh else static.detach())
    return grads


class GraphedCallable:
    """A callable whose forward and backward replay captured CUDA graphs.

    Call it like the original. Outputs are the graph's static tensors: the
    next replay overwrites them, so consume or copy them before that.

    Attributes:
        forward_graph, backward_graph, wgrad_graph: the ``torch.cuda.CUDAGraph``
            objects (``backward_graph`` is None when no output requires grad,
            ``wgrad_graph`` None without delayed-wgrad modules).
        static_args: the input buffers the graphs read.
        static_outputs: the output buffers (flattened).
        schedule: the replay order shared with the callables captured together.
    """

    def __init__(self, state: _State):
        self._state = state

    def __call__(self, *args, **kwargs):
        state = self._state
        for module, training in state.training_flags:
            if module.training != training:
                raise RuntimeError(
                    f"{state.name}: module {type(module).__name__} was captured in "
                    f"{'training' if training else 'eval'} mode but is now in "
                    f"{'training' if module.training else 'eval'} mode; a graph cannot follow the "
                    "switch (dropout, batch-norm statistics). Restore the mode or capture another graph."
                )
        leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
        if spec != state.arg_spec:
            raise TypeError(
                f"{state.name} was captured with arguments {', '.join(state.arg_names)} and must be "
                f"called with the same structure; got {len(args)} positional and keyword arguments "
                f"{sorted(kwargs)}"
            )
        if state.backward_graph is not None and not torch.is_grad_enabled():
            raise RuntimeError(
                f"{state.name} was captured for training (forward and backward graphs) but is called "
                "with gradients disabled; its backward would never replay and break the replay "
                "order. Call it with gradients enabled, or capture an eval-mode graph for inference."
            )
        check_and_copy(state.name, state.arg_names, state.static_args, leaves)
        leaf_mask = tuple(isinstance(t, torch.Tensor) and t.is_leaf and t.requires_grad for t in leaves)
        outputs = _Replay.apply(state, leaf_mask, *leaves, *state.params)
        return pytree.tree_unflatten(list(outputs), state.output_spec)

    def backward_dw(self) -> None:
        """Replays the delayed weight-gradient graph.

        Gradients go to ``main_grad`` (fused accumulation, inside the graph)
        or are added to ``.grad`` (after the replay).
        """
        state = self._state
        if state.wgrad_graph is None:
            raise RuntimeError(
                f"{state.name} has no delayed weight-gradient graph: none of its modules has "
                "delay_wgrad_compute=True and a backward_dw() method"
            )
        with nvtx.range(state.ranges[WGRAD]):
            state.schedule.advance((WGRAD, state.index))
            state.wgrad_graph.replay()
        for param, static in state.static_wgrads:
            if param.grad is None:
                param.grad = static.clone()
            else:
                param.grad.add_(static)

    @property
    def forward_graph(self) -> torch.cuda.CUDAGraph:
        return self._state.forward_graph

    @property
    def backward_graph(self) -> Optional[torch.cuda.CUDAGraph]:
        return self._state.backward_graph

    @property
    def wgrad_graph(self) -> Optional[torch.cuda.CUDAGraph]:
        return self._state.wgrad_graph

    @property
    def static_args(self) -> list[torch.Tensor]:
        return list(self._state.static_args)

    @property
    def static_outputs(self) -> list[torch.Tensor]:
        return list(self._state.static_outputs)

    @property
    def schedule(self) -> Schedule:
        return self._state.schedule

    @property
    def module(self) -> Optional[torch.nn.Module]:
        return self._state.module

    def __repr__(self) -> str:
        graphs = [FORWARD] + ([BACKWARD] if self.backward_graph is not None else []) + (
            [WGRAD] if self.wgrad_graph is not None else []
        )
        return f"GraphedCallable({self._state.name}, graphs={graphs})"


def _delayed_wgrad_modules(module: Optional[torch.nn.Module]) -> list[torch.nn.Module]:
    """Submodules that defer their weight gradients to ``backward_dw()`` (duck-typed)."""
    if module is None:
        return []
    return [
        m for m in module.modules()
        if getattr(m, "delay_wgrad_compute", False) is True and callable(getattr(m, "backward_dw", None))
    ]


def _parse_order(order: Optional[Sequence[int]], count: int) -> list[tuple[str, int]]:
    """``order``: ``i`` runs the forward of callable i (1-based), ``-i`` its backward."""
    if order is None:
        return [(FORWARD, i) for i in range(count)] + [(BACKWARD, i) for i in reversed(range(count))]
    if isinstance(order, (str, bytes)) or not isinstance(order, Sequence):
        raise TypeError(f"order must be a sequence of ints such as [1, 2, -2, -1], got {order!r}")
    steps: list[tuple[str, int]] = []
    for item in order:
        if isinstance(item, bool) or not isinstance(item, int) or item == 0 or abs(item) > count:
            raise ValueError(
                f"order entries must be ints i (forward of callable i) or -i (its backward) with "
                f"1 <= i <= {count}, got {item!r} in {list(order)}"
            )
        steps.append((FORWARD if item > 0 else BACKWARD, abs(item) - 1))
    for i in range(count):
        for kind, sign in ((FORWARD, ""), (BACKWARD, "-")):
            seen = steps.count((kind, i))
            if seen != 1:
                raise ValueError(
                    f"order must name {sign}{i + 1} exactly once (the {kind} of callable {i + 1}), "
                    f"found it {seen} times in {list(order)}"
                )
        if steps.index((BACKWARD, i)) < steps.index((FORWARD, i)):
            raise ValueError(f"order runs the backward of callable {i + 1} before its forward: {list(order)}")
    return steps


def _check_module(index: int, module: torch.nn.Module) -> None:
    hooks = (module._forward_hooks, module._forward_pre_hooks, module._backward_hooks)
    if any(len(h) for h in hooks):
        raise ValueError(
            f"callable {index + 1} ({type(module).__name__}) has module hooks registered; they would "
            "run once at capture and never at replay. Register hooks after make_graphed_callables."
        )
    trainable_buffers = [name for name, b in module.named_buffers() if b.requires_grad]
    if trainable_buffers:
        raise ValueError(
            f"callable {index + 1} ({type(module).__name__}) has buffers that require grad "
            f"({', '.join(trainable_buffers)}); only parameters may be trainable in a graphed module"
        )


def _normalize(callables, sample_args, sample_kwargs):
    single = not isinstance(callables, (tuple, list))
    if single:
        callables = (callables,)
        sample_args = (sample_args,)
        sample_kwargs = (sample_kwargs if sample_kwargs is not None else {},)
    else:
        callables = tuple(callables)
        if not isinstance(sample_args, (tuple, list)) or len(sample_args) != len(callables):
            raise ValueError(
                f"with {len(callables)} callables, sample_args must be a tuple of {len(callables)} "
                f"argument tuples, got {type(sample_args).__name__} of length "
                f"{len(sample_args) if isinstance(sample_args, (tuple, list)) else 'n/a'}"
            )
        if sample_kwargs is None:
            sample_kwargs = tuple({} for _ in callables)
        elif not isinstance(sample_kwargs, (tuple, list)) or len(sample_kwargs) != len(callables):
            raise ValueError(f"sample_kwargs must be None or a tuple of {len(callables)} dicts, got {sample_kwargs!r}")
    if not callables:
        raise ValueError("make_graphed_callables needs at least one callable")
    for i, fn in enumerate(callables):
        if not callable(fn):
            raise TypeError(f"callable {i + 1} is a {type(fn).__name__}, not a module or function")
    return single, callables, tuple(sample_args), tuple(sample_kwargs)


def _snapshot_grads(params: Sequence[torch.Tensor]):
    """``.grad`` references and ``main_grad`` values, to undo warm-up side effects."""
    grads = [p.grad for p in params]
    main_grads = [p.main_grad.clone() if isinstance(getattr(p, "main_grad", None), torch.Tensor) else None for p in params]
    return grads, main_grads


def _restore_grads(params: Sequence[torch.Tensor], snapshot) -> None:
    grads, main_grads = snapshot
    with torch.no_grad():
        for param, grad, main_grad in zip(params, grads, main_grads):
            param.grad = grad
            if main_grad is not None:
                param.main_grad.copy_(main_grad)


def make_graphed_callables(
    callables: Union[Callable, Sequence[Callable]],
    sample_args,
    *,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    order: Optional[Sequence[int]] = None,
    sample_kwargs=None,
):
    """Captures the forward and backward of callables as CUDA graphs.

    Args:
        callables: a module or function, or a tuple of them (e.g. one entry
            per layer and microbatch; the same module may appear several times,
            each entry getting its own graphs and buffers).
        sample_args: a tuple of tensors for one callable, or a tuple of such
            tuples (one per callable). Every leaf must be a CUDA tensor, and
            ``m_splits`` a device tensor. Samples whose ``requires_grad`` is
            set get gradients.
        num_warmup_iters: eager iterations on a side stream before capture,
            run in ``order`` (lazy initialisation, workspace growth, autotuning
            happen there, never during capture). At least 1.
        allow_unused_input: allow inputs that require grad but get none.
            Parameters that carry ``main_grad`` or belong to a delayed-wgrad
            module are exempt: their gradient arrives elsewhere.
        pool: memory pool handle (``torch.cuda.graph_pool_handle()``) to
            capture into; a new one by default.
        order: the schedule, as ints: ``i`` runs the forward of callable i
            (1-based), ``-i`` its backward, e.g. ``[1, 2, -1, 3, -2, -3]`` for
            a 1F1B pipeline. Default: all forwards, then the backwards in
            reverse. Replays must follow it (checked).
        sample_kwargs: keyword arguments, a dict (or a tuple of dicts); they
            become static inputs like ``sample_args``.

    Returns:
        A :class:`GraphedCallable`, or a tuple of them in the order of
        ``callables``. Modules are not modified: calling the module itself
        still runs eagerly.

    Delayed weight gradients: a module (or submodule) with
    ``delay_wgrad_compute=True`` and a ``backward_dw()`` method gets a third
    graph, captured right after its backward; replay it with
    :meth:`GraphedCallable.backward_dw` right after that backward (the replay
    order includes it).

    Warm-up leaves no trace: ``.grad`` and ``main_grad`` of the parameters
    are restored afterwards.

    .. warning::
        Preconditions (each broken one raises, with the fix, where it can be
        detected):

        - every sample leaf is a CUDA tensor on one device; new inputs have the
          sample's shape, dtype and device (they are copied into static buffers);
        - the module is in the same training/eval mode at every call as at capture;
        - graphs are replayed in the captured order, cyclically: each forward
          is followed by its backward (and ``backward_dw``) as in ``order``;
          calling with gradients disabled is an error;
        - only parameters may be trainable (no buffers that require grad), no
          module hooks are registered at capture, parameters are neither added,
          removed nor replaced afterwards (the graphs hold their addresses);
        - every op inside is graph-safe: no host synchronisation, no
          allocation that must outlive the graph that made it (persistent
          workspaces), deterministic control flow on the host;
        - a function's gradients flow only to its arguments: parameters it
          closes over get none (graph the module instead);
        - outputs and input gradients are static buffers, overwritten by the
          next replay; no double backward.
    """
    single, callables, sample_args, sample_kwargs = _normalize(callables, sample_args, sample_kwargs)
    if isinstance(num_warmup_iters, bool) or not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(
            f"num_warmup_iters must be an int >= 1 (lazy initialisation must happen before capture), "
            f"got {num_warmup_iters!r}"
        )
    if torch.is_autocast_enabled() and torch.is_autocast_cache_enabled():
        raise RuntimeError(
            "make_graphed_callables cannot capture under autocast with its weight cache enabled; "
            "use torch.autocast(..., cache_enabled=False)"
        )
    steps = _parse_order(order, len(callables))
    flat = []
    for i, (fn, args, kwargs) in enumerate(zip(callables, sample_args, sample_kwargs)):
        leaves, names, spec = flatten_sample(f"callable {i + 1} ({type(fn).__name__})", args, kwargs)
        if isinstance(fn, torch.nn.Module):
            _check_module(i, fn)
        flat.append((leaves, names, spec))
    if not torch.cuda.is_available():
        raise RuntimeError("make_graphed_callables needs a CUDA device, and torch sees none")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError("make_graphed_callables cannot run while another CUDA graph is being captured")

    schedule = Schedule([])
    states: list[_State] = []
    devices = set()
    for i, (fn, (leaves, names, spec)) in enumerate(zip(callables, flat)):
        module = fn if isinstance(fn, torch.nn.Module) else None
        params = tuple(module.parameters()) if module is not None else ()
        devices.update(t.device for t in leaves)
        devices.update(p.device for p in params)
        state = _State(
            index=i,
            function=fn,
            module=module,
            schedule=schedule,
            arg_names=names,
            arg_spec=spec,
            static_args=[make_static(t) for t in leaves],
            params=params,
            training_flags=tuple((m, m.training) for m in module.modules()) if module is not None else (),
            delayed_modules=_delayed_wgrad_modules(module),
        )
        state.ranges = {kind: f"graphs.replay.{kind}[{i + 1}]" for kind in (FORWARD, BACKWARD, WGRAD)}
        states.append(state)
    if len(devices) != 1 or next(iter(devices)).type != "cuda":
        raise ValueError(f"all sample tensors and parameters must be on one CUDA device, got {sorted(map(str, devices))}")
    device = devices.pop()

    all_params = list({id(p): p for s in states for p in s.params}.values())
    with nvtx.range("graphs.make_graphed_callables"), torch.cuda.device(device):
        snapshot = _snapshot_grads(all_params)
        with nvtx.range("graphs.warmup"):
            _warm_up(states, steps, num_warmup_iters, device)
        _restore_grads(all_params, snapshot)
        pool = torch.cuda.graph_pool_handle() if pool is None else pool
        with nvtx.range("graphs.capture"):
            _capture(states, steps, pool, allow_unused_input)
        _restore_grads(all_params, snapshot)

    schedule.steps = [step for step in _with_wgrad(states, steps) if _has_graph(states, step)]
    graphed = tuple(GraphedCallable(state) for state in states)
    return graphed[0] if single else graphed


def _with_wgrad(states: Sequence[_State], steps: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The schedule with each delayed-wgrad graph right after its backward."""
    out = []
    for kind, i in steps:
        out.append((kind, i))
        if kind == BACKWARD and states[i].delayed_modules:
            out.append((WGRAD, i))
    return out


def _has_graph(states: Sequence[_State], step: tuple[str, int]) -> bool:
    kind, i = step
    return {FORWARD: True, BACKWARD: states[i].backward_graph is not None, WGRAD: states[i].wgrad_graph is not None}[kind]


def _call(state: _State):
    args, kwargs = pytree.tree_unflatten(state.static_args, state.arg_spec)
    return state.function(*args, **kwargs)


def _differentiable_outputs(state: _State, outputs: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    return [o for o in outputs if o.requires_grad]


def _grad_targets(state: _State) -> list[torch.Tensor]:
    return [t for t in state.surface if t.requires_grad]


def _warm_up(states: Sequence[_State], steps, iterations: int, device: torch.device) -> None:
    torch.cuda.synchronize(device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(iterations):
            outputs: dict[int, list[torch.Tensor]] = {}
            for kind, i in steps:
                state = states[i]
                if kind == FORWARD:
                    outputs[i] = pytree.tree_leaves(_call(state))
                    continue
                differentiable = [o for o in outputs.pop(i) if isinstance(o, torch.Tensor) and o.requires_grad]
                targets = _grad_targets(state)
                if differentiable and targets:
                    torch.autograd.grad(
                        differentiable, targets,
                        grad_outputs=[torch.zeros_like(o) for o in differentiable],
                        allow_unused=True,
                    )
                    for module in state.delayed_modules:
                        module.backward_dw()
    torch.cuda.current_stream(device).wait_stream(side)
    torch.cuda.synchronize(device)


def _capture(states: Sequence[_State], steps, pool, allow_unused_input: bool) -> None:
    for kind, i in steps:
        state = states[i]
        for hook in _between_captures:
            hook(pool)
        if kind == FORWARD:
            with torch.cuda.graph(state.forward_graph, pool=pool):
                result = _call(state)
            finish_capture(state.forward_graph)
            leaves, state.output_spec = pytree.tree_flatten(result)
            for position, leaf in enumerate(leaves):
                if not isinstance(leaf, torch.Tensor):
                    raise TypeError(
                        f"{state.name} returned a {type(leaf).__name__} as output {position}; graphed "
                        "callables must return tensors (a graph cannot recompute a Python value)"
                    )
            state.static_outputs = leaves
            state.differentiable = [o.requires_grad for o in leaves]
            continue
        _capture_backward(state, pool, allow_unused_input)
        if state.backward_graph is not None and state.delayed_modules:
            _capture_wgrad(state, pool)


def _capture_backward(state: _State, pool, allow_unused_input: bool) -> None:
    differentiable = _differentiable_outputs(state, state.static_outputs)
    targets = _grad_targets(state)
    state.static_grad_outputs = [torch.empty_like(o) for o in state.static_outputs]
    if not differentiable:
        state.static_grad_inputs = [None] * len(state.surface)
        return
    if not targets:
        raise ValueError(
            f"{state.name} returns outputs that require grad, but none of its sample arguments "
            "or parameters does; for a function that closes over parameters, graph a module "
            "instead (its parameters become graph inputs) or pass them as arguments"
        )
    state.backward_graph = new_graph()
    grad_outputs = [g for g, d in zip(state.static_grad_outputs, state.differentiable) if d]
    with torch.cuda.graph(state.backward_graph, pool=pool):
        grads = torch.autograd.grad(differentiable, targets, grad_outputs=grad_outputs, allow_unused=True)
    finish_capture(state.backward_graph)
    by_target = dict(zip(map(id, targets), grads))
    delayed_params = {id(p) for m in state.delayed_modules for p in m.parameters()}
    static_grad_inputs: list[Optional[torch.Tensor]] = []
    for position, tensor in enumerate(state.surface):
        grad = by_target.get(id(tensor))
        if tensor.requires_grad and grad is None and not allow_unused_input:
            exempt = isinstance(getattr(tensor, "main_grad", None), torch.Tensor) or id(tensor) in delayed_params
            if not exempt:
                what = state.arg_names[position] if position < len(state.static_args) else (
                    f"parameter {position - len(state.static_args)} of shape {tuple(tensor.shape)}"
                )
                raise ValueError(
                    f"{state.name}: {what} requires grad but the backward produced no gradient for "
                    "it; pass allow_unused_input=True if that is expected"
                )
        static_grad_inputs.append(grad)
    state.static_grad_inputs = static_grad_inputs


def _capture_wgrad(state: _State, pool) -> None:
    params = [p for m in state.delayed_modules for p in m.parameters()]
    saved = [p.grad for p in params]
    for param in params:
        param.grad = None
    state.wgrad_graph = new_graph()
    with torch.cuda.graph(state.wgrad_graph, pool=pool):
        for module in state.delayed_modules:
            module.backward_dw()
    finish_capture(state.wgrad_graph)
    state.static_wgrads = [(p, p.grad) for p in params if p.grad is not None]
    for param, grad in zip(params, saved):
        param.grad = grad


__all__ = ["make_graphed_callables", "GraphedCallable", "Schedule", "ReplayOrderError"]
