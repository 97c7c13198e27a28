"""examples/train_moe.py --graphs: the captured step trains like the eager loop."""

import importlib.util
import pathlib
import re
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_moe.py"


def load_example():
    spec = importlib.util.spec_from_file_location("train_moe_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def small_model(example, master_weights):
    args = example.parse_args(["--dim", "16", "--heads", "2", "--ffn", "8", "--layers", "1", "--experts", "4",
                               "--seq", "8"])
    torch.manual_seed(0)
    model = example.MoELanguageModel(12, args, torch.float32, torch.device("cpu"))
    master = example.MasterWeights(model.parameters()) if master_weights else None
    params = master.master if master is not None else model.parameters()
    return model, master, torch.optim.AdamW(params, lr=1e-2)


@pytest.mark.parametrize("master_weights", [False, True], ids=["plain", "master"])
def test_restore_training_state_undoes_warm_up_steps(master_weights):
    """What make_graphed_step relies on: the state after restore is the state before warm-up."""
    example = load_example()
    model, master, optimizer = small_model(example, master_weights)
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randint(12, (2, 8), generator=gen), torch.randint(12, (2, 8), generator=gen)) for _ in range(4)]
    # A fresh run: two steps.
    fresh = [example.training_step(model, optimizer, master, x, y).item() for x, y in batches[:2]]
    # Again from the start, with three "warm-up" steps undone before the two.
    model2, master2, optimizer2 = small_model(example, master_weights)
    saved = example.save_training_state(model2, optimizer2, master2)
    for x, y in batches[1:4]:
        example.training_step(model2, optimizer2, master2, x, y)
    example.restore_training_state(model2, optimizer2, master2, saved)
    again = [example.training_step(model2, optimizer2, master2, x, y).item() for x, y in batches[:2]]
    assert fresh == again
    for (name, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), name


def test_compare_eager_needs_cuda():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--compare-eager", "--steps", "2"], capture_output=True, text=True, timeout=120
    )
    assert result.returncode != 0 and "--compare-eager needs --device cuda" in result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("flags", [[], ["--fp8"]], ids=["bf16", "fp8"])
def test_graphed_training_matches_eager_for_100_steps(flags):
    """Same seed, fp32 master weights: the whole-step graph's losses equal the eager ones to 1e-3."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--device", "cuda", "--compare-eager", "--master-weights", "--steps", "100",
         "--log-every", "1000", "--sample", "0", *flags],
        capture_output=True, text=True, timeout=600,
    )
    output = result.stdout + result.stderr
    match = re.search(r"max \|loss difference\| over (\d+) steps ([0-9.e+-]+)", output)
    assert match, output
    steps, gap = int(match.group(1)), float(match.group(2))
    assert steps == 100 and gap <= 1e-3, output
    assert result.returncode == 0, output
    assert "whole step in a CUDA graph" in output and "fp32 master weights" in output, output
    if flags:
        assert "FP8 block-scaled experts" in output, output


def test_fp8_refuses_the_torch_backend():
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--fp8", "--backend", "torch", "--steps", "2"], capture_output=True, text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "--fp8 runs on the cuda backend" in result.stderr
