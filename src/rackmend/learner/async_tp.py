"""Async tensor parallelism for a rack's TP dimension: ``enable_async_tp(tp_mesh)``.

PyTorch's micro-pipelined TP ("async TP") splits each all-gather before a matmul, and
each reduce-scatter after one, into per-peer chunks that go through symmetric memory
while the matmul works on the chunks already there, so a rack's TP communication hides
behind its compute. It is an inductor graph pass: it needs CUDA, NCCL, ``torch.compile``
with Triton, the TP group registered for symmetric memory, and inductor's switch on.

What lives here: the check of those requirements (one error naming each one that is
missing) and the two calls that turn it on. What does not: the TP plan itself
(``torch.distributed.tensor.parallel``) and compiling the model, which stay the
user's; rackmend's outer loop is unaffected (it syncs whatever tensors the model holds).
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["AsyncTPUnavailable", "enable_async_tp", "async_tp_problems"]


class AsyncTPUnavailable(RuntimeError):
    """``enable_async_tp`` cannot turn async TP on here; the message lists what is missing."""


def _inductor_config() -> Any | None:
    try:
        import torch._inductor.config as config
    except Exception:  # noqa: BLE001 - any import failure means no inductor here
        return None
    return config if hasattr(config, "_micro_pipeline_tp") else None


def _symm_mem() -> Any | None:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except Exception:  # noqa: BLE001 - absent in builds without distributed CUDA support
        return None
    ok = hasattr(symm_mem, "enable_symm_mem_for_group") and hasattr(symm_mem, "is_symm_mem_enabled_for_group")
    return symm_mem if ok else None


def _has_triton() -> bool:
    try:
        from torch.utils._triton import has_triton
    except ImportError:
        return False
    return bool(has_triton())


def async_tp_problems(tp_mesh: Any) -> list[str]:
    """What stands between this process and async TP on ``tp_mesh`` (empty: nothing)."""
    problems = []
    if not torch.cuda.is_available():
        problems.append("CUDA: torch.cuda.is_available() is False (async TP runs on NVIDIA GPUs only)")
    device_type = getattr(tp_mesh, "device_type", None)
    if device_type != "cuda":
        problems.append(f"a CUDA mesh: the TP mesh is on {device_type!r} (build it with "
                        "init_device_mesh('cuda', ...))")
    if getattr(tp_mesh, "ndim", 1) != 1:
        problems.append(f"one mesh dimension: the mesh given has {tp_mesh.ndim}; pass the TP dimension alone, "
                        "e.g. mesh['tp']")
    if not dist.is_available() or not dist.is_nccl_available():
        problems.append("NCCL: this torch build has no NCCL backend")
    elif dist.is_initialized() and getattr(tp_mesh, "ndim", 1) == 1:
        backend = dist.get_backend(tp_mesh.get_group())
        if "nccl" not in str(backend):
            problems.append(f"an NCCL process group: the TP group's backend is {backend!r}")
    if _inductor_config() is None:
        problems.append(f"torch.compile's inductor with its micro-pipeline TP pass "
                        f"(torch._inductor.config._micro_pipeline_tp): torch {torch.__version__} has none; "
                        "upgrade torch")
    if _symm_mem() is None:
        problems.append(f"symmetric memory (torch.distributed._symmetric_memory): torch {torch.__version__} "
                        "has none; upgrade torch or use a CUDA build")
    if torch.cuda.is_available() and not _has_triton():
        problems.append("Triton: torch.compile generates CUDA kernels with it; pip install triton")
    return problems


def enable_async_tp(tp_mesh: Any) -> str:
    """Turn on micro-pipelined (async) TP for the TP dimension ``tp_mesh`` (a
    one-dimensional ``DeviceMesh`` on CUDA); returns the TP group's name.

    Call it on every rank, after the mesh exists and before ``torch.compile`` traces the
    model: the switch is read when inductor compiles. It only pays off in compiled code
    (eager TP keeps its blocking collectives) and for matmuls large enough to split.
    Raises ``AsyncTPUnavailable`` listing every requirement that is not met (no CUDA, a
    mesh on CPU, gloo, no inductor, no Triton, a torch without symmetric memory).
    """
    problems = async_tp_problems(tp_mesh)
    if problems:
        raise AsyncTPUnavailable("rackmend.enable_async_tp needs " + "; ".join(problems))
    symm_mem = _symm_mem()
    config = _inductor_config()
    assert symm_mem is not None and config is not None
    name = tp_mesh.get_group().group_name
    # Recent torch deprecates the explicit call, but its micro-pipeline pass still skips
    # every group not registered this way (inductor's own passes call it the same way).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        symm_mem.enable_symm_mem_for_group(name)
    if not symm_mem.is_symm_mem_enabled_for_group(name):
        raise AsyncTPUnavailable(f"rackmend.enable_async_tp: symmetric memory did not register for the TP group "
                                 f"{name!r} (torch {torch.__version__}); async TP would silently stay off")
    config._micro_pipeline_tp = True
    return name
