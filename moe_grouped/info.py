"""What an installed moe_grouped has: ``python -m moe_grouped info``."""

from __future__ import annotations

import platform

import torch

from . import __version__, _core, backends


def collect() -> dict:
    """Versions, the core's build state and the backends usable per device."""
    facts = {
        "moe_grouped": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "core": "built and loaded" if _core.available() else "not available",
    }
    if _core.available():
        facts["core_library"] = _core.library_path
        facts["core_build"] = _core.lib.mg_build_info().decode()
    else:
        facts["core_reason"] = _core.unavailable_reason
    facts["cpu_backends"] = backends.available_backends(torch.device("cpu"))
    facts["default_backend_cpu"] = backends.default_backend(torch.device("cpu"))
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            device = torch.device("cuda", index)
            major, minor = torch.cuda.get_device_capability(device)
            facts[f"gpu{index}"] = f"{torch.cuda.get_device_name(device)} (sm_{major}{minor})"
            facts[f"gpu{index}_backends"] = backends.available_backends(device)
            facts[f"gpu{index}_default_backend"] = backends.default_backend(device)
            reason = backends.cuda_unavailable_reason(device)
            if reason is not None:
                facts[f"gpu{index}_cuda_backend"] = f"unavailable: {reason}"
    else:
        facts["gpu"] = "none visible to torch"
    return facts


def format_facts(facts: dict) -> str:
    width = max(len(key) for key in facts)
    return "\n".join(f"{key:<{width}}  {value}" for key, value in facts.items())
