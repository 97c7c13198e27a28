"""A ``MoELayer``'s router and fused experts as one autograd op.

Where the softmax route kernels (:mod:`moe_grouped.routing`) take the
layer's router and the fused experts path (:mod:`moe_grouped.experts`) its
experts, :class:`RoutedExpertsFunction` runs the gate GEMM, the route
kernel, the routing index and the experts' forward as one op, and their
backward as one autograd node: the experts' backward, then the router's from
the routing weights' gradient, the two token gradients summed as autograd
sums them. The kernels and the order of every sum are those of the two ops
(``SoftmaxRoute`` then ``FusedExpertsFunction``), so the results are
bitwise theirs; one node fewer saves autograd's per-node work in eager
steps (docs/host-overhead.md).

``MOE_GROUPED_ROUTED_EXPERTS=0`` (read at import; or :data:`enabled`) keeps
the two ops, for A/B measurements and tests.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from . import experts as fused_experts
from ._ops import direct_calls, ops
from .experts import Plan
from .routing.library import route_backward, route_forward

ENV = "MOE_GROUPED_ROUTED_EXPERTS"
enabled = os.environ.get(ENV, "1") != "0"


@dataclass(frozen=True)
class Route:
    """The router's and the routing index's static arguments.

    ``mode`` and ``scaling``: the route kernel's (:mod:`moe_grouped.routing`);
    ``capacity``: copies per expert, -1 without dropping; ``by_probs``: an
    over-full expert keeps its copies of highest routing weight (else the
    first in token order).
    """

    top_k: int
    mode: int
    scaling: float
    num_experts: int
    capacity: int
    pad_to_capacity: bool
    by_probs: bool


class RoutedExpertsFunction(torch.autograd.Function):
    """``apply(x, gate_weight, route, plan, stages, fc1_delayed, fc2_delayed, *fc1_weights, *fc2_weights)``.

    Returns ``(out [T, H], weights [T, k], losses [2] = (aux, z), logits [T, E], experts [T, k], counts [E])``:
    the layer's combined experts output and the router's outputs, all
    differentiable in x and the gate weight but the expert choice and counts.
    ``plan`` and ``stages`` as :class:`~moe_grouped.experts.FusedExpertsFunction` takes them.
    """

    @staticmethod
    def forward(ctx, x, gate, route: Route, plan: Plan, stages, fc1_delayed, fc2_delayed, *weights):
        with direct_calls((x, gate, *weights)):
            logits, chosen, counts, probs, lse, losses = route_forward(
                x, gate, route.top_k, route.mode, route.scaling
            )
            row_id_map, m_splits = ops.permute_index(
                chosen, probs if route.by_probs else None, route.num_experts, route.capacity,
                route.pad_to_capacity, plan.permute_backend,
            )
            out, g = fused_experts.forward(plan, None, stages, x, probs, row_id_map, m_splits, weights)
        ctx.save_for_backward(x, gate, logits, lse, chosen, counts, probs, row_id_map, m_splits, g, *weights)
        ctx.route, ctx.plan, ctx.stages, ctx.delayed = route, plan, stages, (fc1_delayed, fc2_delayed)
        ctx.mark_non_differentiable(chosen, counts)
        ctx.set_materialize_grads(False)  # an output no loss reached reads as NULL, not a zero tensor
        return out, probs, losses, logits, chosen, counts

    @staticmethod
    def backward(ctx, grad_out, grad_probs, grad_losses, grad_logits, _chosen, _counts):
        saved = ctx.saved_tensors
        x, gate, logits, lse, chosen, counts, probs, row_id_map, m_splits, g, *weights = saved
        route: Route = ctx.route
        plan: Plan = ctx.plan
        needs = ctx.needs_input_grad
        need_x, need_gate = needs[0], needs[1]
        router_needed = need_x or need_gate
        # The weights follow x, gate, route, plan, stages, fc1_delayed, fc2_delayed.
        fc1_needed, fc2_needed = fused_experts.weight_grads_needed(plan, needs, 7)
        grad_x = d_probs = None
        w1_grads, w2_grads = [None] * plan.num_fc1_weights, [None] * (len(weights) - plan.num_fc1_weights)
        with direct_calls((grad_out, grad_probs, grad_losses, grad_logits, *saved)):
            if grad_out is not None:
                grad_x, d_probs, w1_grads, w2_grads = fused_experts.backward(
                    plan, None, ctx.stages, ctx.delayed, (need_x, router_needed, fc1_needed, fc2_needed),
                    grad_out, x, probs, row_id_map, m_splits, g, weights,
                )
            if grad_probs is not None and router_needed:  # the weights also reached a loss outside the layer
                d_probs = grad_probs if d_probs is None else d_probs + grad_probs
            router_grads = (d_probs, grad_losses, grad_logits)
            grad_gate = None
            # As autograd: the router's backward runs only where a gradient reached one of its outputs.
            if router_needed and any(grad is not None for grad in router_grads):
                grad_x_router, grad_gate = route_backward(
                    (x, gate, logits, lse, chosen, counts), route.top_k, route.mode, route.scaling, router_grads,
                    need_x, need_gate,
                )
                if grad_x_router is not None:
                    # The sum autograd forms for x's two gradients: one bf16 add, operands in either order.
                    grad_x = grad_x_router if grad_x is None else grad_x.add_(grad_x_router)
        return (grad_x, grad_gate, None, None, None, None, None, *w1_grads, *w2_grads)
