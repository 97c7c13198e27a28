"""Fuzz: GroupedLinear, GroupedMLP and MoELayer, forward and backward, against float64 oracles (see fuzz_strategies).

Each layer gets random parameters drawn from the example's generator, runs
forward and backward on its backend, and is compared with per-expert (or
per-token) loops in float64 autograd over copies of the same parameters.
MoELayer's oracle takes the routing the layer chose (its ``last_routing``),
so near-ties in the router cannot make the comparison flaky; the ``reference``
backend is one of the backends drawn on the CPU, so it and ``torch`` meet
the same oracle.
"""

from __future__ import annotations

import importlib
import math

import torch
import torch.nn.functional as F
from hypothesis import strategies as st

from moe_grouped import GroupedLinear, GroupedMLP, MoELayer, activation

from fuzz_strategies import (
    assert_close, backends_for, bounds, call, check_splits_outcome, coarser, expect_error, expect_ok, feature_dims,
    float_dtypes, fuzz_tests, gemm_refused, generator, num_experts, num_tokens, randn, splits,
)

# moe_grouped.permute is also the name of the function the package exports.
permute_module = importlib.import_module("moe_grouped.permute")

# x faults of GroupedLinear / GroupedMLP: what the error must name.
X_FAULTS = {
    "in_features": ("in_features", "hidden"),
    "x_dtype": ("dtype",),
    "x_1d": ("x must",),
    "x_list": ("x must",),
}


def layer_backends(device: str, *, mlp: bool, routed: bool = False) -> list[str]:
    """backends_for, without ``cuda`` where a kernel family the layer needs besides the GEMMs is missing:
    SwiGLU and its weighted backward (MLPs), the permutation (MoELayer)."""
    names = backends_for(device)
    if "cuda" in names:
        where = torch.device(device)
        reasons = [activation.weighted_backward_unavailable_reason(where) if mlp else None]
        reasons.append(permute_module.cuda_unavailable_reason(where) if routed else None)
        if any(reason is not None for reason in reasons):
            names.remove("cuda")
    return names


def draw_layer_problem(data, device, mlp):
    backend = data.draw(st.sampled_from(layer_backends(device, mlp=mlp)), label="backend")
    dtype = data.draw(st.sampled_from(float_dtypes(device, backend)), label="dtype")
    groups = data.draw(num_experts(), label="E")
    rows = data.draw(num_tokens(), label="M")
    fault = data.draw(st.sampled_from([None] * 6 + list(X_FAULTS)), label="x fault")
    # Half the examples draw valid splits only, so that most reach the comparison with the oracle.
    allow_invalid = fault is None and data.draw(st.booleans(), label="invalid splits allowed")
    split = data.draw(splits(rows, groups, device, allow_invalid=allow_invalid), label="m_splits")
    grouped = data.draw(st.booleans(), label="single grouped weight") or groups > 64
    bias = data.draw(st.booleans(), label="bias")
    return backend, dtype, groups, rows, fault, split, grouped, bias


def other_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype != torch.float32 else torch.float64


def spoil_x(x: torch.Tensor, fault):
    if fault == "in_features":
        return torch.cat([x, x[:, :1]], dim=1)
    if fault == "x_dtype":
        return x.detach().to(other_dtype(x.dtype))
    if fault == "x_1d":
        return x.detach().reshape(-1)
    if fault == "x_list":
        return x.tolist()
    return x


def randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Parameters from the example's generator, scaled by 1/sqrt(fan in) so low-precision sums stay small."""
    with torch.no_grad():
        for param in module.parameters():
            fan_in = param.shape[-1] if param.dim() >= 2 else 4
            param.copy_(torch.randn(param.shape, generator=gen) / math.sqrt(fan_in))


def leaf64(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().cpu().double().requires_grad_(True)


def per_expert(layer: GroupedLinear, params: dict, prefix: str):
    """(weights, biases) of one GroupedLinear as per-expert float64 leaves (biases None without bias)."""
    if layer.single_grouped_weight:
        weights = list(params[f"{prefix}weight"].unbind(0))
        biases = list(params[f"{prefix}bias"].unbind(0)) if layer.use_bias else None
    else:
        weights = [params[f"{prefix}weight{e}"] for e in range(layer.num_experts)]
        biases = [params[f"{prefix}bias{e}"] for e in range(layer.num_experts)] if layer.use_bias else None
    return weights, biases


def linear64(x, weights, biases, e):
    y = x @ weights[e].t()
    return y if biases is None else y + biases[e]


def check_grads(module, params: dict, x, x64, loss64, dtype, case, accumulated=None):
    """x.grad and every parameter's gradient against the float64 autograd of ``loss64``.

    ``accumulated``: {name: float32 gradient} for the weights whose gradient went into ``main_grad``.
    """
    inputs = [x64, *params.values()]
    grads = torch.autograd.grad(loss64, inputs, allow_unused=True)
    grads = [torch.zeros_like(i) if g is None else g for i, g in zip(inputs, grads)]
    assert_close(x.grad, grads[0].reshape(x.shape), dtype, f"dx: {case}")
    for (name, param), expected in zip(module.named_parameters(), grads[1:]):
        if accumulated and name in accumulated:
            assert param.grad is None, f"{name} has .grad besides main_grad: {case}"
            assert accumulated[name].dtype == torch.float32, f"main_grad of {name}: {case}"
            assert_close(accumulated[name], expected, coarser(dtype, torch.float32), f"main_grad of {name}: {case}")
            continue
        got = torch.zeros_like(param) if param.grad is None else param.grad  # unused: no gradient
        assert got.shape == param.shape and got.dtype == param.dtype, f"{name}: {case}"
        assert_close(got, expected, dtype, f"grad of {name}: {case}")


def prop_grouped_linear(data, device):
    backend, dtype, groups, rows, fault, split, grouped, bias = draw_layer_problem(data, device, mlp=False)
    n = data.draw(feature_dims(backend), label="out_features")
    k = data.draw(feature_dims(backend), label="in_features")
    wgrad = data.draw(st.sampled_from(["plain", "fuse_wgrad_accumulation", "delay_wgrad_compute"]), label="wgrad")
    # On a GPU, tensor splits sometimes stay on the host: validated there like a list.
    host = device != "cpu" and split.is_tensor and data.draw(st.booleans(), label="host m_splits")
    gen = generator(data)
    layer = GroupedLinear(groups, k, n, bias=bias, single_grouped_weight=grouped, dtype=dtype, device=device,
                          backend=backend, fuse_wgrad_accumulation=wgrad == "fuse_wgrad_accumulation",
                          delay_wgrad_compute=wgrad == "delay_wgrad_compute")
    randomize(layer, gen)
    names = [name for name, p in layer.named_parameters() if name.startswith("weight")]
    starts = {}
    if wgrad == "fuse_wgrad_accumulation":  # Megatron's fp32 main_grad buffers, with something already in them
        for name, weight in zip(names, layer.weights()):
            starts[name] = randn(gen, *weight.shape, device=device)
            weight.main_grad = starts[name].clone()
    x = randn(gen, rows, k, dtype=dtype, device=device).requires_grad_(True)
    case = (f"{backend=} {dtype=} E={groups} M={rows} {n=} {k=} {split.kind=} {host=} {grouped=} {bias=} {wgrad=} "
            f"{fault=}")
    y, error = call(lambda: layer(spoil_x(x, fault), split.value.cpu() if host else split.value))
    if fault is not None:
        expect_error(error, *X_FAULTS[fault], case=case)
        return
    if host and not split.valid:
        expect_error(error, "m_splits", case=case)
        return
    if not check_splits_outcome(split, backend, error, case, too_many_groups=gemm_refused(backend, device, groups)):
        return
    assert y.shape == (rows, n) and y.dtype == dtype, case
    params = {name: leaf64(p) for name, p in layer.named_parameters()}
    weights, biases = per_expert(layer, params, "")
    x64 = leaf64(x)
    y64 = torch.cat([linear64(x64[s:e], weights, biases, g) for g, (s, e) in enumerate(bounds(split.counts))])
    assert_close(y, y64, dtype, case)
    dy = randn(gen, rows, n, dtype=dtype, device=device)
    y.backward(dy)
    if wgrad == "delay_wgrad_compute":
        assert all(p.grad is None for p in layer.parameters()), f"parameter gradients before backward_dw: {case}"
        layer.backward_dw()
    accumulated = {name: layer.get_parameter(name).main_grad - start for name, start in starts.items()}
    check_grads(layer, params, x, x64, (y64 * dy.cpu().double()).sum(), dtype, case, accumulated)


def swiglu64(h):
    gate, up = h.chunk(2, dim=-1)
    return F.silu(gate) * up


def prop_grouped_mlp(data, device):
    backend, dtype, groups, rows, fault, split, grouped, bias = draw_layer_problem(data, device, mlp=True)
    hidden = data.draw(feature_dims(backend), label="hidden")
    ffn = data.draw(feature_dims(backend), label="ffn_hidden")
    path = data.draw(st.sampled_from([None, "unfused", "fused"]), label="experts_path")
    gen = generator(data)
    mlp = GroupedMLP(groups, hidden, ffn, bias=bias, single_grouped_weight=grouped, dtype=dtype, device=device,
                     backend=backend, experts_path=path)
    randomize(mlp, gen)
    x = randn(gen, rows, hidden, dtype=dtype, device=device).requires_grad_(True)
    case = (f"{backend=} {dtype=} E={groups} M={rows} {hidden=} {ffn=} {split.kind=} {grouped=} {bias=} {path=} "
            f"{fault=}")
    y, error = call(lambda: mlp(spoil_x(x, fault), split.value))
    if path == "fused" and bias and fault not in ("x_1d", "x_list"):  # x is checked first
        expect_error(error, "experts_path", case=case)
        return
    if fault is not None:
        expect_error(error, *X_FAULTS[fault], case=case)
        return
    if not check_splits_outcome(split, backend, error, case, too_many_groups=gemm_refused(backend, device, groups)):
        return
    assert y.shape == (rows, hidden) and y.dtype == dtype, case
    params = {name: leaf64(p) for name, p in mlp.named_parameters()}
    w1, b1 = per_expert(mlp.fc1, params, "fc1.")
    w2, b2 = per_expert(mlp.fc2, params, "fc2.")
    x64 = leaf64(x)
    parts = [
        linear64(swiglu64(linear64(x64[s:e], w1, b1, g)), w2, b2, g) for g, (s, e) in enumerate(bounds(split.counts))
    ]
    y64 = torch.cat(parts)
    assert_close(y, y64, dtype, case)
    dy = randn(gen, rows, hidden, dtype=dtype, device=device)
    y.backward(dy)
    check_grads(mlp, params, x, x64, (y64 * dy.cpu().double()).sum(), dtype, case)


# MoELayer faults: (where it shows: "init" or "forward", what the error must name).
MOE_FAULTS = {
    "top_k": ("init", "top_k"),
    "num_experts": ("init", "num_experts"),
    "capacity_factor": ("init", "capacity_factor"),
    "aux_loss_coeff": ("init", "aux_loss_coeff"),
    "experts_path": ("init", "experts_path"),
    "score_function": ("init", "score_function"),
    "n_group": ("init", "n_group"),
    "x_hidden": ("forward", "x must have shape"),
    "x_4d": ("forward", "x must have shape"),
    "x_dtype": ("forward", "dtype"),
}


def kept_copies(experts: list, weights: list, num_experts: int, top_k: int, capacity_factor, policy):
    """[T][top_k] bool: the copies each expert's capacity keeps, by per-expert loops."""
    tokens = len(experts)
    kept = [[True] * top_k for _ in range(tokens)]
    if capacity_factor is None:
        return kept
    capacity = math.ceil(tokens * top_k / num_experts * capacity_factor)
    for e in range(num_experts):
        mine = [(t, j) for t in range(tokens) for j in range(top_k) if experts[t][j] == e]
        if policy == "probs":
            mine.sort(key=lambda c: (-weights[c[0]][c[1]], c))
        for t, j in mine[capacity:]:
            kept[t][j] = False
    return kept


def moe_oracle(layer: MoELayer, params: dict, x64, experts, kept, aux_coeff, z_coeff):
    """(output, loss terms of the router) in float64 per-token loops, with the layer's routing choices."""
    w1, b1 = per_expert(layer.experts.fc1, params, "experts.fc1.")
    w2, b2 = per_expert(layer.experts.fc2, params, "experts.fc2.")
    router = layer.router
    tokens = x64.reshape(-1, layer.hidden)
    logits = tokens @ params["router.weight"].t()
    if router.score_function == "sigmoid":
        scores = torch.sigmoid(logits)
        probs = scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        probs = torch.softmax(logits, dim=-1)
        scores = logits if router.topk_before_softmax else probs
    rows = []
    for t, choice in enumerate(experts):
        selected = scores[t, choice]  # never the selection bias
        if router.topk_before_softmax:
            weights = torch.softmax(selected, dim=0)
        elif router.normalize_topk:
            weights = selected / (selected.sum() + 1e-20)
        else:
            weights = selected
        weights = weights * router.scaling_factor
        y = torch.zeros(layer.hidden, dtype=torch.float64)
        for j, e in enumerate(choice):
            if kept[t][j]:
                y = y + weights[j] * linear64(swiglu64(linear64(tokens[t], w1, b1, e)), w2, b2, e)
        if layer.shared_expert is not None:
            h = params["shared_expert.fc1.weight"] @ tokens[t]
            y = y + params["shared_expert.fc2.weight"] @ swiglu64(h)
        rows.append(y)
    out = torch.stack(rows) if rows else tokens.new_zeros(0, layer.hidden)
    extra = tokens.sum() * 0
    if len(experts):
        counts = torch.bincount(torch.tensor(experts).reshape(-1), minlength=layer.num_experts).double()
        aux = layer.num_experts * (counts / (len(experts) * layer.top_k) * probs.mean(0)).sum()
        z = torch.logsumexp(logits, -1).square().mean()
        extra = aux_coeff * aux + z_coeff * z
    return out, extra


def prop_moe_layer(data, device):
    backend = data.draw(st.sampled_from(layer_backends(device, mlp=True, routed=True)), label="backend")
    dtype = data.draw(st.sampled_from(float_dtypes(device, backend)), label="dtype")
    groups = data.draw(num_experts(), label="E")
    top_k = data.draw(st.integers(1, min(groups, 4)), label="top_k")
    hidden = data.draw(feature_dims(backend), label="hidden")
    ffn = data.draw(feature_dims(backend), label="ffn_hidden")
    shared = data.draw(st.sampled_from([None, ffn]), label="shared expert")
    bias = data.draw(st.booleans(), label="bias")
    path = data.draw(st.sampled_from([None, "unfused", "fused"]), label="experts_path")
    capacity_factor = data.draw(st.sampled_from([None, None, 0.0, 0.5, 1.0, 2.0]), label="capacity_factor")
    policy = data.draw(st.sampled_from(["probs", "position"]), label="drop_policy")
    pad = capacity_factor is not None and data.draw(st.booleans(), label="pad_to_capacity")
    aux_coeff = data.draw(st.sampled_from([0.0, 0.1]), label="aux_loss_coeff")
    z_coeff = data.draw(st.sampled_from([0.0, 0.1]), label="z_loss_coeff")
    grouped = data.draw(st.booleans(), label="single grouped weight") or groups > 64
    shape = data.draw(st.sampled_from(["2d", "3d"]), label="x shape")
    count = data.draw(num_tokens(), label="T")
    fault = data.draw(st.sampled_from([None] * 8 + list(MOE_FAULTS)), label="fault")
    score = data.draw(st.sampled_from(["softmax", "sigmoid"]), label="score_function")
    router = dict(
        score_function=score,
        topk_before_softmax=score == "softmax" and data.draw(st.booleans(), label="topk_before_softmax"),
        normalize_topk=data.draw(st.booleans(), label="normalize_topk"),
        scaling_factor=data.draw(st.sampled_from([1.0, 2.5]), label="scaling_factor"),
        expert_bias=data.draw(st.booleans(), label="expert_bias"),
    )
    if groups % 2 == 0 and data.draw(st.booleans(), label="group-limited routing"):
        router.update(n_group=2, topk_group=1 if groups // 2 >= top_k else 2)
    options = dict(
        router_options=router, shared_expert_ffn_hidden=shared, aux_loss_coeff=aux_coeff, z_loss_coeff=z_coeff,
        capacity_factor=capacity_factor, drop_policy=policy, pad_to_capacity=pad, bias=bias,
        single_grouped_weight=grouped, dtype=dtype, device=device, backend=backend, experts_path=path,
    )
    args = [hidden, ffn, groups, top_k]
    if fault == "top_k":
        args[3] = data.draw(st.sampled_from([0, -1, groups + 1]), label="bad top_k")
    elif fault == "num_experts":
        args[2] = data.draw(st.sampled_from([0, -3]), label="bad E")
    elif fault == "capacity_factor":
        options["capacity_factor"] = -0.5
    elif fault == "aux_loss_coeff":
        options["aux_loss_coeff"] = -1.0
    elif fault == "experts_path":
        options["experts_path"] = "fast"
    elif fault == "score_function":
        router["score_function"] = "relu"
    elif fault == "n_group":
        router.update(n_group=1, topk_group=None)
    case = f"{backend=} {dtype=} E={groups} {top_k=} T={count} {shape} {hidden=} {ffn=} {fault=} " + ", ".join(
        f"{key}={value}" for key, value in options.items() if key not in ("dtype", "device", "backend")
    )
    layer, error = call(lambda: MoELayer(*args, **options))
    if fault is not None and MOE_FAULTS[fault][0] == "init":
        expect_error(error, MOE_FAULTS[fault][1], case=case)
        return
    expect_ok(error, case)
    gen = generator(data)
    randomize(layer, gen)
    if layer.router.expert_bias is not None:  # as after some update_bias() steps: moves the selection only
        layer.router.expert_bias.copy_(torch.randn(groups, generator=gen) / 4)
    leading = (count,) if shape == "2d" else (1, count) if count % 2 else (2, count // 2)
    x = randn(gen, *leading, hidden, dtype=dtype, device=device).requires_grad_(True)
    given = x
    if fault == "x_hidden":
        given = torch.cat([x, x[..., :1]], dim=-1)
    elif fault == "x_4d":
        given = x.reshape(1, 1, -1, hidden)
    elif fault == "x_dtype":
        given = x.detach().to(other_dtype(dtype))
    out, error = call(lambda: layer(given))
    if path == "fused" and bias and fault not in ("x_hidden", "x_4d"):  # x's shape is checked first
        expect_error(error, "experts_path", case=case)
        return
    if fault is not None:
        expect_error(error, MOE_FAULTS[fault][1], case=case)
        return
    if gemm_refused(backend, device, groups):  # the experts' GEMMs: more experts than torch._grouped_mm takes
        expect_error(error, "m_splits", case=case)
        return
    expect_ok(error, case)
    assert out.shape == x.shape and out.dtype == dtype, case
    routing = layer.last_routing
    experts = routing.experts.cpu().tolist()
    assert all(0 <= e < groups for choice in experts for e in choice), case
    assert all(len(set(choice)) == top_k for choice in experts), f"an expert chosen twice: {case}"
    if "n_group" in router:  # each token's experts come from its topk_group best groups
        assert all(len({e // (groups // 2) for e in choice}) <= router["topk_group"] for choice in experts), case
    kept = kept_copies(experts, routing.weights.float().cpu().tolist(), groups, top_k, capacity_factor, policy)
    params = {name: leaf64(p) for name, p in layer.named_parameters()}
    x64 = leaf64(x)
    out64, extra = moe_oracle(layer, params, x64, experts, kept, aux_coeff, z_coeff)
    assert_close(out.reshape(out64.shape), out64, dtype, case)
    dout = randn(gen, *out.shape, dtype=dtype, device=device)
    out.backward(dout)
    loss = (out64 * dout.cpu().double().reshape(out64.shape)).sum() + extra
    check_grads(layer, params, x, x64, loss, dtype, case)


test_grouped_linear_cpu, test_grouped_linear_gpu = fuzz_tests(prop_grouped_linear)
test_grouped_mlp_cpu, test_grouped_mlp_gpu = fuzz_tests(prop_grouped_mlp)
test_moe_layer_cpu, test_moe_layer_gpu = fuzz_tests(prop_moe_layer)
