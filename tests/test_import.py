"""``import moe_grouped`` stays cheap: it loads no heavy module it does not need yet.

What it costs beyond ``import torch`` is measured, not asserted (a test never
asserts speed): ``python -X importtime -c "import torch, moe_grouped"``. This
checks the cause instead: the modules that made the import slow (Dynamo and
what it pulls in, about 2 s; transformers) are imported where they are used.
"""

import subprocess
import sys

import pytest
import torch

from moe_grouped import backends

# Loaded by torch.compile, Dynamo or the transformers integration, never by the import itself.
HEAVY = ("torch._dynamo", "torch._inductor", "sympy", "transformers", "torch.distributed.fsdp")


def modules_after(statement: str) -> set[str]:
    code = f"import sys\n{statement}\nprint('\\n'.join(sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    return set(result.stdout.split())


def test_import_loads_no_heavy_module():
    torch_modules = modules_after("import torch")
    loaded = modules_after("import torch, moe_grouped") - torch_modules
    heavy = sorted(name for name in loaded if any(name == h or name.startswith(h + ".") for h in HEAVY))
    assert not heavy, heavy


def test_constant_result_marks_a_function_as_torch_does():
    """backends.assume_constant_result sets exactly what torch.compiler.assume_constant_result sets."""

    def ours():
        return 1

    def theirs():
        return 1

    assert backends.assume_constant_result(ours) is ours
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) and vars(ours), (vars(ours), vars(theirs))


def test_compile_folds_a_constant_result():
    """torch.compile calls a marked function once while tracing and keeps its value."""
    calls = []

    @backends.assume_constant_result
    def scale() -> float:
        calls.append(1)
        return 3.0

    compiled = torch.compile(lambda x: x * scale(), backend="eager", fullgraph=True)
    x = torch.ones(4)
    assert torch.equal(compiled(x), x * 3.0) and torch.equal(compiled(x), x * 3.0)
    assert len(calls) == 1
