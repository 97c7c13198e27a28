"""The core's build keeps what a second ``pip install`` can reuse.

Under pip's build isolation every install runs CMake from a fresh
``pip-build-env-*`` folder, and scikit-build-core then deletes the build
tree's top-level ``CMakeCache.txt`` and ``CMakeFiles/``. Compiling again
only what changed needs the objects outside that folder and compile
commands that name no path of the isolated environment (ninja recompiles a
translation unit whose command changed). This configures the project once
and checks both in the generated ``build.ninja``.
"""

import glob
import importlib.util
import os
import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def nvcc_dir():
    found = shutil.which("nvcc")
    if found:
        return os.path.dirname(found)
    for candidate in sorted(glob.glob("/usr/local/cuda*/bin/nvcc")):
        return os.path.dirname(candidate)
    return None


def missing_tools():
    if not shutil.which("cmake") or not shutil.which("ninja"):
        return "needs cmake and ninja"
    if nvcc_dir() is None:
        return "needs nvcc (the core is only configured where it can be built)"
    if importlib.util.find_spec("cutlass_library") is None:
        return "needs the nvidia-cutlass wheel in this environment"
    return None


@pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))
def test_core_objects_and_commands_survive_a_new_isolated_environment(tmp_path):
    env = dict(os.environ, PATH=f"{nvcc_dir()}{os.pathsep}{os.environ['PATH']}")
    build = tmp_path / "build"
    subprocess.run(["cmake", "-S", str(ROOT), "-B", str(build), "-G", "Ninja", "-DMOE_GROUPED_REQUIRE_CORE=ON"],
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    ninja = (build / "build.ninja").read_text()
    objects = re.findall(r"^build ([^:]+\.o):", ninja, flags=re.MULTILINE)
    assert objects and all(o.startswith("csrc/CMakeFiles/") for o in objects), objects[:3]
    includes = set(re.findall(r"^\s*INCLUDES = (.*)$", ninja, flags=re.MULTILINE))
    assert includes
    for line in includes:
        assert f"-I{build}/cutlass-" in line, line  # the headers' copy, keyed by the CUTLASS version
        assert "site-packages" not in line and "pip-build-env" not in line, line
    assert (build / "libmoe_grouped_core.so").name in ninja  # the library at the top of the tree, as before
