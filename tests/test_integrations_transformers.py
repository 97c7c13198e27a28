"""moe_grouped as a transformers experts implementation: the same outputs and
gradients as transformers' own implementations, refusals of what it cannot
run, FP8 and CUDA-graph replay (GPU)."""

from __future__ import annotations

import importlib
import pathlib
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers", minversion="5.0")

from transformers.integrations import moe as hf_moe  # noqa: E402

import moe_grouped  # noqa: E402
from moe_grouped import fp8  # noqa: E402
from moe_grouped.graphs import capture_step  # noqa: E402
from moe_grouped.integrations import transformers as mg_transformers  # noqa: E402

from cases import calc_diff  # noqa: E402

NAME = mg_transformers.register()
TORCH_NAME = mg_transformers.register("moe_grouped_torch", backend="torch")

# family -> (config class, block class path, its keyword names for E, FFN width)
FAMILIES = {
    "qwen3_moe": ("Qwen3MoeConfig", "qwen3_moe.modeling_qwen3_moe.Qwen3MoeSparseMoeBlock", "num_experts",
                  "moe_intermediate_size"),
    "mixtral": ("MixtralConfig", "mixtral.modeling_mixtral.MixtralSparseMoeBlock", "num_local_experts",
                "intermediate_size"),
    "olmoe": ("OlmoeConfig", "olmoe.modeling_olmoe.OlmoeSparseMoeBlock", "num_experts", "intermediate_size"),
}


def make_config(family="qwen3_moe", *, hidden=32, ffn=16, experts=8, top_k=2, **options):
    config_name, _, experts_key, ffn_key = FAMILIES[family]
    config_cls = getattr(transformers, config_name)
    return config_cls(
        hidden_size=hidden, num_experts_per_tok=top_k, vocab_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, **{experts_key: experts, ffn_key: ffn}, **options,
    )


def make_block(config, family="qwen3_moe", dtype=torch.float32, device="cpu", seed=0):
    """One sparse MoE block of ``family`` with random weights (std 1/sqrt(fan-in), so routing is varied)."""
    module_path, _, class_name = FAMILIES[family][1].rpartition(".")
    block_cls = getattr(importlib.import_module(f"transformers.models.{module_path}"), class_name)
    block = block_cls(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5)
    return block.to(dtype=dtype, device=device)


def run_block(block, implementation, x, dy):
    """(output, dx, parameter grads by name) of the block under ``implementation``."""
    block.experts.config._experts_implementation = implementation
    block.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out = block(x)
    out.backward(dy)
    return out.detach(), x.grad, {name: p.grad for name, p in block.named_parameters()}


def rel_err(actual, expected) -> float:
    actual, expected = actual.detach().double().cpu(), expected.detach().double().cpu()
    return float((actual - expected).norm() / expected.norm().clamp_min(1e-30))


def assert_same_results(got, want, limit, case):
    (out, dx, grads), (out_want, dx_want, grads_want) = got, want
    assert out.dtype == out_want.dtype and out.shape == out_want.shape, case
    assert rel_err(out, out_want) <= limit, (case, "output", rel_err(out, out_want))
    assert rel_err(dx, dx_want) <= limit, (case, "hidden_states grad", rel_err(dx, dx_want))
    assert grads.keys() == grads_want.keys()
    for name, grad in grads.items():
        assert grad is not None and grad.shape == grads_want[name].shape, (case, name)
        assert rel_err(grad, grads_want[name]) <= limit, (case, name, rel_err(grad, grads_want[name]))


# --- registration --------------------------------------------------------------------------------------------


def test_register_is_idempotent_and_returns_the_name():
    before = len(hf_moe.ALL_EXPERTS_FUNCTIONS)
    assert mg_transformers.register() == "moe_grouped"
    assert mg_transformers.register() == "moe_grouped"
    assert len(hf_moe.ALL_EXPERTS_FUNCTIONS) == before
    registered = hf_moe.ALL_EXPERTS_FUNCTIONS["moe_grouped"]
    assert isinstance(registered, mg_transformers.ExpertsForward) and registered.backend is None
    # The same name with another backend replaces ours (and back).
    assert mg_transformers.register("moe_grouped", backend="reference") == "moe_grouped"
    assert hf_moe.ALL_EXPERTS_FUNCTIONS["moe_grouped"].backend == "reference"
    mg_transformers.register()
    assert hf_moe.ALL_EXPERTS_FUNCTIONS["moe_grouped"].backend is None
    assert len(hf_moe.ALL_EXPERTS_FUNCTIONS) == before


@pytest.mark.parametrize("name", ["grouped_mm", "eager", "batched_mm"])
def test_register_refuses_transformers_own_names(name):
    own = hf_moe.ALL_EXPERTS_FUNCTIONS.get(name)
    with pytest.raises(ValueError, match="already taken|register moe_grouped under another name"):
        mg_transformers.register(name)
    assert hf_moe.ALL_EXPERTS_FUNCTIONS.get(name) is own


def test_register_refuses_bad_arguments():
    with pytest.raises(ValueError, match="non-empty string"):
        mg_transformers.register("")
    with pytest.raises(ValueError, match="backend must be one of"):
        mg_transformers.register("moe_grouped_bad", backend="triton")
    assert "moe_grouped_bad" not in hf_moe.ALL_EXPERTS_FUNCTIONS


# --- numerics on the CPU against transformers' own implementations ---------------------------------------------


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("theirs", ["eager", "grouped_mm"])
@pytest.mark.parametrize("ours", [NAME, TORCH_NAME], ids=["default_backend", "torch_backend"])
def test_block_matches_transformers(family, dtype, theirs, ours):
    config = make_config(family)
    block = make_block(config, family, dtype)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, config.hidden_size, generator=gen).to(dtype)
    dy = torch.randn(3, 7, config.hidden_size, generator=gen).to(dtype)
    want = run_block(block, theirs, x, dy)
    got = run_block(block, ours, x, dy)
    # fp32: the same sums in another order; bf16: roundings in other places (as transformers' own two differ).
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    assert_same_results(got, want, limit, f"{family} {dtype} {ours} vs {theirs}")


def check_routing_weight_gradients(routing, ours, seed):
    """The experts module alone, with routing weights as a leaf: output and gradients (the routing weights'
    too) of ``ours`` as transformers' eager experts give them."""
    config = make_config(experts=8, top_k=2)
    experts = make_block(config).experts
    tokens, top_k, gen = 11, 2, torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, config.hidden_size, generator=gen)
    if routing == "random":
        index = torch.stack([torch.randperm(8, generator=gen)[:top_k] for _ in range(tokens)])
    elif routing == "all_to_one":
        index = torch.tensor([[5, 5]] * tokens)  # both choices one expert: a token copy twice in one group
    else:
        index = torch.tensor([[1, 6]] * tokens)
    weights = torch.rand(tokens, top_k, generator=gen)
    dy = torch.randn(tokens, config.hidden_size, generator=gen)
    results = {}
    for implementation in ("eager", ours):
        config._experts_implementation = implementation
        experts.zero_grad(set_to_none=True)
        xi, wi = x.clone().requires_grad_(True), weights.clone().requires_grad_(True)
        out = experts(xi, index, wi)
        out.backward(dy)
        results[implementation] = [out, xi.grad, wi.grad, experts.gate_up_proj.grad, experts.down_proj.grad]
    for label, got, want in zip(["out", "dx", "d_top_k_weights", "d_gate_up_proj", "d_down_proj"],
                                results[ours], results["eager"]):
        assert rel_err(got, want) <= 1e-5, (routing, label, rel_err(got, want))


ROUTINGS = ["random", "all_to_one", "most_experts_empty"]


@pytest.mark.parametrize("routing", ROUTINGS)
def test_experts_gradients_reach_the_routing_weights(routing):
    check_routing_weight_gradients(routing, NAME, seed=2)


@pytest.fixture
def fused_path(monkeypatch):
    """Our forward takes GroupedMLP's fused experts path on the CPU too (by default only the cuda backend
    does); the test fails unless the fused op ran."""
    from moe_grouped.experts import FusedExpertsFunction

    monkeypatch.setattr(moe_grouped.GroupedMLP, "uses_fused_path", lambda self, x: True)
    calls = []
    apply = FusedExpertsFunction.apply
    monkeypatch.setattr(FusedExpertsFunction, "apply", lambda *args: calls.append(1) or apply(*args))
    yield
    assert calls, "the fused experts op never ran"


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fused_path_block_matches_transformers(family, dtype, fused_path):
    config = make_config(family)
    block = make_block(config, family, dtype)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(2, 9, config.hidden_size, generator=gen).to(dtype)
    dy = torch.randn(2, 9, config.hidden_size, generator=gen).to(dtype)
    want = run_block(block, "eager", x, dy)
    got = run_block(block, TORCH_NAME, x, dy)
    limit = 1e-5 if dtype == torch.float32 else 1e-2
    assert_same_results(got, want, limit, f"fused path {family} {dtype}")


@pytest.mark.parametrize("routing", ROUTINGS)
def test_fused_path_gradients_reach_the_routing_weights(routing, fused_path):
    check_routing_weight_gradients(routing, TORCH_NAME, seed=4)


def test_fused_path_follows_replaced_weights(fused_path):
    config = make_config()
    experts = make_block(config).experts
    x, index, weights = torch.randn(6, config.hidden_size), torch.randint(8, (6, 2)), torch.rand(6, 2)
    config._experts_implementation = TORCH_NAME
    experts(x, index, weights)
    experts.gate_up_proj = nn.Parameter(-experts.gate_up_proj.detach())
    got = experts(x, index, weights)
    config._experts_implementation = "eager"
    torch.testing.assert_close(got, experts(x, index, weights), rtol=1e-5, atol=1e-6)


def test_gate_is_the_first_half_of_gate_up_proj():
    """Layout check independent of transformers' code: gate rows first, then up rows, not interleaved."""
    config = make_config(experts=2, top_k=1, hidden=4, ffn=3)
    experts = make_block(config).experts
    x = torch.randn(5, 4)
    index, weights = torch.tensor([[1]] * 5), torch.ones(5, 1)
    gate_w, up_w = experts.gate_up_proj[1, :3], experts.gate_up_proj[1, 3:]
    expected = (nn.functional.silu(x @ gate_w.T) * (x @ up_w.T)) @ experts.down_proj[1].T
    config._experts_implementation = NAME
    torch.testing.assert_close(experts(x, index, weights), expected.detach(), rtol=1e-5, atol=1e-6)


def test_replaced_expert_weights_are_used_and_trained():
    """Parameters swapped after a first forward (to_empty, FSDP, a user): the next forward uses the new ones."""
    config = make_config()
    experts = make_block(config).experts
    config._experts_implementation = NAME
    x, index, weights = torch.randn(6, config.hidden_size), torch.randint(8, (6, 2)), torch.rand(6, 2)
    experts(x, index, weights)
    old = experts.down_proj
    experts.down_proj = nn.Parameter(2 * old.detach())
    scaled = experts(x, index, weights)
    config._experts_implementation = "eager"
    torch.testing.assert_close(scaled, experts(x, index, weights), rtol=1e-5, atol=1e-6)
    config._experts_implementation = NAME
    experts(x, index, weights).sum().backward()
    assert experts.down_proj.grad is not None and old.grad is None


def test_whole_model_switches_implementation():
    """A tiny Qwen3-MoE causal LM loaded with ours, switched to grouped_mm and back: same loss and gradients."""
    config = make_config(hidden=32, ffn=16, experts=8, top_k=2, norm_topk_prob=True, head_dim=8,
                         intermediate_size=64)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, experts_implementation=NAME)
    assert model.config._experts_implementation == NAME
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(64, (2, 9), generator=gen)

    def loss_and_grads():
        model.zero_grad(set_to_none=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}

    ours = loss_and_grads()
    model.set_experts_implementation("grouped_mm")
    assert model.config._experts_implementation == "grouped_mm"
    theirs = loss_and_grads()
    model.set_experts_implementation(NAME)
    again = loss_and_grads()
    assert rel_err(ours[0], theirs[0]) <= 1e-5
    assert ours[1].keys() == theirs[1].keys() and any("experts.gate_up_proj" in name for name in ours[1])
    for name, grad in ours[1].items():
        assert rel_err(grad, theirs[1][name]) <= 1e-4, (name, rel_err(grad, theirs[1][name]))
        assert torch.equal(grad, again[1][name]), name


# --- refusals ----------------------------------------------------------------------------------------------------


def _custom_gate(experts):
    """An experts class with its own _apply_gate (e.g. a clamped SwiGLU)."""
    cls = type(experts)
    experts.__class__ = type(f"Clamped{cls.__name__}", (cls,), {"_apply_gate": lambda self, h: h.chunk(2, -1)[0]})


UNSUPPORTED = {
    "bias": (lambda e: setattr(e, "has_bias", True), "expert biases"),
    "interleaved": (lambda e: setattr(e, "is_concatenated", False), "interleaved gate/up"),
    "transposed": (lambda e: setattr(e, "is_transposed", True), "transposed expert weights"),
    "no_gate": (lambda e: setattr(e, "has_gate", False), "without a gate"),
    "gelu": (lambda e: setattr(e, "act_fn", nn.GELU()), "needs SiLU"),
    "custom_gate": (_custom_gate, "custom gate"),
    "post_norm": (lambda e: setattr(e, "has_post_expert_norm", True), "norm after each expert"),
    "expert_parallel": (lambda e: setattr(e, "_is_expert_parallel", True), "expert parallelism"),
}


@pytest.mark.parametrize("case", list(UNSUPPORTED))
def test_refuses_what_it_cannot_run(case):
    change, words = UNSUPPORTED[case]
    config = make_config()
    block = make_block(config)
    change(block.experts)
    config._experts_implementation = NAME
    with pytest.raises(NotImplementedError, match=words) as info:
        block(torch.randn(1, 4, config.hidden_size))
    assert 'experts_implementation="grouped_mm"' in str(info.value)


def test_refuses_a_non_silu_config():
    config = make_config(hidden_act="gelu")
    block = make_block(config)
    config._experts_implementation = NAME
    with pytest.raises(NotImplementedError, match="needs SiLU"):
        block(torch.randn(1, 4, config.hidden_size))


def test_refuses_gpt_oss_experts():
    """GPT-OSS: interleaved, transposed, with biases and a clamped gate."""
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    config = transformers.GptOssConfig(hidden_size=32, intermediate_size=16, num_local_experts=4,
                                       num_experts_per_tok=2, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, vocab_size=64)
    experts = modeling.GptOssExperts(config)
    reasons = " ".join(mg_transformers.unsupported_reasons(experts))
    for words in ("expert biases", "interleaved gate/up", "transposed expert weights"):
        assert words in reasons, reasons
    with pytest.raises(NotImplementedError, match="GptOssExperts"):
        mg_transformers.experts_forward(experts, torch.randn(3, 32), torch.zeros(3, 2, dtype=torch.long),
                                        torch.ones(3, 2))


def test_refuses_a_dtype_the_backend_cannot_run():
    config = make_config()
    block = make_block(config, dtype=torch.float64)
    config._experts_implementation = TORCH_NAME  # torch._grouped_mm: no float64
    with pytest.raises(TypeError, match="cannot run torch.float64 experts on backend 'torch'"):
        block(torch.randn(1, 4, config.hidden_size, dtype=torch.float64))


# Two chained FP8 GEMMs (E4M3 everywhere): about twice one GEMM's 1e-3 (tests/test_fp8_grouped_linear.py).
FP8_DIFF = 4e-3


def test_fp8_refuses_float32_experts():
    config = make_config(hidden=128, ffn=128, experts=4)
    block = make_block(config)
    config._experts_implementation = NAME
    with fp8.fp8_autocast(), pytest.raises(TypeError, match="bfloat16"):
        block(torch.randn(1, 4, config.hidden_size))


def test_fp8_autocast_runs_fp8_experts_on_the_reference_backend():
    """Inside fp8_autocast both expert GEMMs run FP8 block-scaled (emulated on the CPU): close to bf16, not equal."""
    config = make_config(hidden=128, ffn=128, experts=4, top_k=2)
    block = make_block(config, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 32, 128, generator=gen).bfloat16()
    dy = torch.randn(2, 32, 128, generator=gen).bfloat16()
    bf16 = run_block(block, "grouped_mm", x, dy)
    with fp8.fp8_autocast():
        got = run_block(block, NAME, x, dy)
    assert not torch.equal(got[0], bf16[0])  # it did run in FP8
    for label, a, b in [("out", got[0], bf16[0]), ("dx", got[1], bf16[1])] + [
        (name, grad, bf16[2][name]) for name, grad in got[2].items()
    ]:
        assert calc_diff(a, b) < FP8_DIFF, (label, calc_diff(a, b))


# --- GPU ---------------------------------------------------------------------------------------------------------

CUDA_NAME = "moe_grouped_cuda"


def gpu_block(seed=0, experts=16, top_k=4, hidden=512, ffn=256):
    config = make_config(hidden=hidden, ffn=ffn, experts=experts, top_k=top_k, norm_topk_prob=True)
    return config, make_block(config, dtype=torch.bfloat16, device="cuda", seed=seed)


@pytest.mark.gpu
def test_cuda_backend_matches_grouped_mm():
    mg_transformers.register(CUDA_NAME, backend="cuda")
    config, block = gpu_block()
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(4, 512, config.hidden_size, generator=gen).bfloat16().cuda()
    dy = torch.randn(4, 512, config.hidden_size, generator=gen).bfloat16().cuda()
    want = run_block(block, "grouped_mm", x, dy)
    got = run_block(block, CUDA_NAME, x, dy)
    assert_same_results(got, want, 1e-2, "cuda vs grouped_mm")


@pytest.mark.gpu
def test_cuda_graph_replays_with_new_inputs_equal_eager():
    """A captured fwd+bwd step of the block (routing changes with every input) gives eager's results.

    Not compared bitwise: the router's matmuls are cuBLAS's, which may pick
    other algorithms on the capture stream; a stale or aliased buffer in ours
    would show as an error of order 1.
    """
    mg_transformers.register(CUDA_NAME, backend="cuda")
    config, block = gpu_block(seed=1)
    config._experts_implementation = CUDA_NAME
    params = list(block.parameters())
    tokens, hidden = 2048, config.hidden_size

    def step(x, dy):
        for param in params:
            param.grad = None
        h = x.detach().requires_grad_(True)
        out = block(h.view(1, tokens, hidden))
        out.backward(dy.view(1, tokens, hidden))
        return (out.detach(), h.grad, *[param.grad for param in params])

    gen = torch.Generator(device="cuda").manual_seed(6)

    def new_inputs():
        x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
        return x, torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()

    graphed = capture_step(step, *new_inputs())
    worst = 0.0
    for replay in range(30):
        x, dy = new_inputs()
        replayed = [t.clone() for t in graphed(x, dy)]
        eager = step(x, dy)
        for label, got, want in zip(["out", "dx"] + [name for name, _ in block.named_parameters()], replayed, eager):
            error = rel_err(got, want)
            worst = max(worst, error)
            assert error <= 1e-3, (replay, label, error)
    print(f"\n[transformers graphs] 30 replays, worst relative error vs eager {worst:.2e}")


@pytest.mark.gpu
def test_cuda_fp8_autocast_is_close_to_bf16():
    if not moe_grouped._core.has(moe_grouped._core.CAP_GROUPED_GEMM_FP8_BLOCKWISE):
        pytest.fail("the core was built without its FP8 grouped GEMMs")
    mg_transformers.register(CUDA_NAME, backend="cuda")
    config, block = gpu_block(seed=2)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 1024, config.hidden_size, generator=gen).bfloat16().cuda()
    dy = torch.randn(2, 1024, config.hidden_size, generator=gen).bfloat16().cuda()
    bf16 = run_block(block, "grouped_mm", x, dy)
    with fp8.fp8_autocast():
        got = run_block(block, CUDA_NAME, x, dy)
    assert not torch.equal(got[0], bf16[0])  # it did run in FP8
    for label, a, b in [("out", got[0], bf16[0]), ("dx", got[1], bf16[1])] + [
        (name, grad, bf16[2][name]) for name, grad in got[2].items()
    ]:
        assert calc_diff(a, b) < FP8_DIFF, (label, calc_diff(a, b))


# --- examples/transformers_moe.py ----------------------------------------------------------------------------------

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "examples" / "transformers_moe.py"
TINY = ["--hidden", "32", "--ffn", "16", "--experts", "4", "--top-k", "2", "--layers", "1", "--seq", "16",
        "--batch", "2", "--vocab", "64", "--steps", "3", "--warmup", "1"]
STEP_LINE = r"experts_implementation='{}'\s+{}\s+step\s+[0-9.]+ ms \(median of \d+\), loss ([0-9.]+) -> ([0-9.]+)"


def run_example(*flags):
    result = subprocess.run([sys.executable, str(EXAMPLE), *flags], capture_output=True, text=True, timeout=600)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output
    return output


def example_losses(output, implementation, mode):
    match = re.search(STEP_LINE.format(implementation, mode), output)
    assert match, output
    return float(match.group(1)), float(match.group(2))


def test_example_trains_on_the_cpu_with_both_implementations():
    output = run_example(*TINY)
    ours, theirs = example_losses(output, "moe_grouped", "eager"), example_losses(output, "grouped_mm", "eager")
    assert ours == pytest.approx(theirs, rel=1e-4), output  # same weights, same batches, same maths
    assert ours[1] < ours[0], output  # it trains
    assert "CUDA graph" not in output, output


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_example_trains_eager_and_graphed_on_the_gpu(flags):
    output = run_example("--device", "cuda", "--steps", "20", *flags)
    for implementation in ("moe_grouped", "grouped_mm"):
        for mode in ("eager", "whole step in a CUDA graph"):
            first, last = example_losses(output, implementation, mode)
            assert last < first, output
    print("\n" + output)
