"""The NCCL version a process runs with.

``torch.cuda.nccl.version()`` is the NCCL torch was built against; the library loaded at run
time may be newer (a newer ``libnccl.so.2`` in place of the wheel's, as the GPU check does to get
NCCL >= 2.30, which allows two ranks on one GPU). What NCCL allows is the loaded library's."""

from __future__ import annotations

import ctypes

import torch


def loaded_nccl_version() -> tuple[int, int, int]:
    """The loaded ``libnccl.so.2``'s version by its own ``ncclGetVersion``; torch's build-time
    version where the library cannot be asked (no CUDA build, or none loaded)."""
    built = tuple(torch.cuda.nccl.version())
    try:
        code = ctypes.c_int()
        if ctypes.CDLL("libnccl.so.2").ncclGetVersion(ctypes.byref(code)) != 0:
            return built
    except (OSError, AttributeError):
        return built
    # NCCL >= 2.9 encodes major * 10000 + minor * 100 + patch
    return code.value // 10000, code.value // 100 % 100, code.value % 100


__all__ = ["loaded_nccl_version"]
