"""runtime/nccl_version.py: the loaded NCCL's own version, decoded.

Here the wheel's libnccl.so.2 is the one torch was built against, so both agree; on the GPU
check a newer library replaces it and only the loaded version says so."""

from __future__ import annotations

import torch

from dualpipe_megatron.runtime.nccl_version import loaded_nccl_version


def test_the_loaded_version_decodes_to_torchs_build_version_here() -> None:
    assert loaded_nccl_version() == tuple(torch.cuda.nccl.version())
