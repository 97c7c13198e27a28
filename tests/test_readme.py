"""The README's quick-start commands stay true."""

import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quick_start_commands():
    return re.findall(r"^pip install .*$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)


def test_readme_opens_with_the_example_and_the_test_command():
    commands = quick_start_commands()
    assert commands[0] == "pip install -e . && python examples/train_moe.py"
    assert commands[1] == 'pip install -e ".[test]" && python -m pytest tests'
    ci = (ROOT / ".ci" / "run").read_text()
    assert "grep -m 1 -E '^pip install .*pytest' README.md" in ci, "CI must run the README's test command"


@pytest.mark.parametrize("flags", [[], ["--fp8"]], ids=["fp32", "fp8_emulated"])
def test_example_language_model_learns_from_context(flags):
    """The example's character LM must beat every context-free predictor.

    Its validation loss has to fall clearly below the unigram entropy of the
    corpus (what a model that only learned character frequencies gets), and
    its training loss has to fall. With ``--fp8`` the expert GEMMs run the FP8
    block-scaled recipe (emulated by the reference backend on the CPU).
    """
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_moe.py"), "--steps", "150", "--log-every", "1000", *flags],
        capture_output=True, text=True, check=True, timeout=300,
    )
    if flags:
        assert "FP8 block-scaled experts" in result.stdout, result.stdout
    match = re.search(r"first 10 steps ([0-9.]+), of the last 10 ([0-9.]+)", result.stdout)
    assert match, result.stdout
    first, last = map(float, match.groups())
    assert last < first, result.stdout
    match = re.search(r"validation loss ([0-9.]+) nats/char; unigram entropy ([0-9.]+)", result.stdout)
    assert match, result.stdout
    validation, unigram = map(float, match.groups())
    assert validation < unigram - 0.4, result.stdout
