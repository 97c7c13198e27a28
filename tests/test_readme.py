"""The README's quick-start commands stay true."""

import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent


def quick_start_commands():
    return re.findall(r"^pip install .*$", (ROOT / "README.md").read_text(), flags=re.MULTILINE)


def test_readme_opens_with_the_example_and_the_test_command():
    commands = quick_start_commands()
    assert commands[0] == "pip install -e . && python examples/train_moe.py"
    assert commands[1] == 'pip install -e ".[test]" && python -m pytest tests'
    ci = (ROOT / ".ci" / "run").read_text()
    assert "grep -m 1 -E '^pip install .*pytest' README.md" in ci, "CI must run the README's test command"


def test_example_training_loop_lowers_the_loss():
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_moe.py"), "--steps", "150", "--log-every", "1000"],
        capture_output=True, text=True, check=True, timeout=300,
    )
    match = re.search(r"first 10 steps ([0-9.]+), of the last 10 ([0-9.]+)", result.stdout)
    assert match, result.stdout
    first, last = map(float, match.groups())
    assert last < 0.5 * first, result.stdout
