"""The package's ``torch.library`` ops, and a cheap way to call them from eager code.

Every op is defined with :func:`custom_op`, which registers it as
``torch.ops.moe_grouped.<name>`` and keeps its Python body. ``ops.<name>(...)``
runs that body directly when nothing needs what the dispatcher adds around it:

- nothing traces: not torch.compile, no dispatch or torch-function mode
  (FakeTensor, functionalization, export, ``with torch.device(...)``), no
  functorch transform, and every tensor argument a plain ``torch.Tensor``
  (or ``nn.Parameter``), not a subclass, and not on the meta device;
- no autograd through the op: grad mode off, or no tensor argument that
  requires grad (inside an ``autograd.Function``'s forward and backward,
  where the layers call their ops, grad mode is off);
- only positional arguments.

Otherwise it calls ``torch.ops.moe_grouped.<name>``. The direct call skips
the dispatcher's round trip, which costs more host time than the op's own
work (docs/host-overhead.md), and does what the dispatcher would have done
that matters here: it bumps the version counter of each tensor the op
mutates, so autograd still refuses a backward through a saved tensor that
was changed in place. An op that would mutate a tensor created in
inference mode, outside inference mode, goes through the dispatcher (which
refuses it).
"""

from __future__ import annotations

import contextlib
import inspect
import operator
import threading
from typing import Callable, Sequence

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_PLAIN_SET = frozenset(_PLAIN)
_IS_META = operator.attrgetter("is_meta")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_BODIES: dict[str, tuple[Callable, tuple[int, ...]]] = {}
_peek_transforms = torch._C._functorch.peek_interpreter_stack
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode_enabled = torch.is_inference_mode_enabled
_increment_version = torch.autograd.graph.increment_version


class _State(threading.local):
    direct = False  # inside a DirectCalls region of this thread


_state = _State()


def custom_op(name: str, *, mutates_args: Sequence[str]):
    """``torch.library.custom_op("moe_grouped::<name>", mutates_args=...)`` that also records the body for
    :data:`ops`."""

    def register(fn: Callable):
        op = torch.library.custom_op(f"moe_grouped::{name}", mutates_args=tuple(mutates_args))(fn)
        params = list(inspect.signature(fn).parameters)
        _BODIES[name] = (fn, tuple(params.index(arg) for arg in mutates_args))
        return op

    return register


def _plain(value, grad: bool) -> bool:
    """Whether ``value`` (an argument) lets the body run directly."""
    kind = type(value)
    if kind in _PLAIN:
        # Meta tensors take the op's fake implementation, which only the dispatcher picks.
        return not (value.is_meta or (grad and value.requires_grad))
    if kind is list or kind is tuple:
        if not value:
            return True
        if not set(map(type, value)) <= _PLAIN_SET:  # C-level loops: lists hold every expert's matrix
            return all(_plain(item, grad) for item in value)  # non-tensors (ints, None) or subclasses
        return not any(map(_IS_META, value)) and not (grad and any(map(_REQUIRES_GRAD, value)))
    return not isinstance(value, torch.Tensor)  # a tensor subclass (FakeTensor, DTensor, ...) is not plain


def _args_plain(args: tuple, grad: bool) -> bool:
    """:func:`_plain` of every argument, in one loop (the op wrapper runs it on every call)."""
    for value in args:
        kind = type(value)
        if kind in _PLAIN:
            if value.is_meta or (grad and value.requires_grad):
                return False
        elif kind is list or kind is tuple:
            if not _plain(value, grad):
                return False
        elif isinstance(value, torch.Tensor):
            return False
    return True


def _eager_only() -> bool:
    """True when no compiler, mode or transform could be watching the call."""
    return not (
        torch.compiler.is_compiling()
        or torch._C._len_torch_dispatch_stack() > 0
        or torch._C._is_torch_function_mode_enabled()
        or _peek_transforms() is not None
    )


def _mutated(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    return [t for t in value if isinstance(t, torch.Tensor)] if isinstance(value, (list, tuple)) else []


def _caller(name: str) -> Callable:
    body, mutated = _BODIES[name]
    op = getattr(torch.ops.moe_grouped, name)

    def call(*args):
        if _state.direct:
            if not mutated:
                return body(*args)
        elif not _eager_only():
            return op(*args)
        else:
            if not _args_plain(args, _is_grad_enabled()):
                return op(*args)
            if not mutated:
                return body(*args)
        targets = [t for i in mutated for t in _mutated(args[i])]
        inference = _is_inference_mode_enabled()
        if not inference and any(t.is_inference() for t in targets):
            return op(*args)
        out = body(*args)
        if targets and not inference:
            _increment_version(targets)
        return out

    call.__name__ = call.__qualname__ = name
    call.__doc__ = f"``torch.ops.moe_grouped.{name}``, its body called directly in plain eager code."
    return call


def direct_region() -> bool:
    """Whether this thread is inside an active :class:`DirectCalls` region (its tensors plain, eager)."""
    return _state.direct


class DirectCalls:
    """``with DirectCalls(tensors):`` ops called on this thread inside run their bodies without the per-call checks.

    For an ``autograd.Function``'s forward or backward, whose ops take only
    its own tensors and what it makes from them: where the checks would pass
    for these tensors now (plain eager code, grad mode off, each a plain
    non-meta tensor or None), they pass for every op inside, and are made once
    here. Otherwise the region changes nothing. Mutated tensors still get
    their version bumped, and inference tensors still go through the
    dispatcher.
    """

    __slots__ = ("_on", "_previous")

    def __init__(self, tensors):
        self._on = not _is_grad_enabled() and _eager_only() and _plain(list(tensors), False)

    def __enter__(self):
        self._previous = _state.direct
        if self._on:
            _state.direct = True
        return self

    def __exit__(self, *exc):
        _state.direct = self._previous
        return False


def direct_calls(tensors):
    """A :class:`DirectCalls` region over ``tensors`` for an ``autograd.Function``'s forward or backward; none
    when traced (the ops then go through ``torch.ops``)."""
    if torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return DirectCalls(tensors)


class _Ops:
    """``ops.<name>(*args)``: the op ``torch.ops.moe_grouped.<name>``, called cheaply where it can be."""

    def __getattr__(self, name: str) -> Callable:
        if name not in _BODIES:
            raise AttributeError(f"moe_grouped defines no op {name!r}")
        if torch.compiler.is_compiling():
            # The op itself, which is what the wrapper calls when traced. Caching the wrapper here would be
            # a traced setattr, and Dynamo resolves it through this method again, recursing until Python's
            # limit (an op first reached inside torch.compile: a compiled first call or backward).
            return getattr(torch.ops.moe_grouped, name)
        call = _caller(name)
        setattr(self, name, call)  # built once per op
        return call


ops = _Ops()
