"""runtime/nccl_version.py: the loaded NCCL's own version, decoded, else torch's build version.

Holds on every machine: the library is a stand-in here, so the decoding and each fallback are
checked whatever NCCL (if any) this machine loads; the GPU check's newer libnccl.so.2 differs from
torch's build version, which is why the module asks the library."""

from __future__ import annotations

import pytest
import torch

from dualpipe_megatron.runtime import nccl_version
from dualpipe_megatron.runtime.nccl_version import loaded_nccl_version

pytestmark = pytest.mark.unit


class _Library:
    """Stands in for libnccl.so.2: ``ncclGetVersion`` writes ``code`` and returns ``status``."""

    def __init__(self, code: int, status: int = 0) -> None:
        self.code, self.status = code, status

    def ncclGetVersion(self, out: object) -> int:  # noqa: N802 - NCCL's name
        out._obj.value = self.code
        return self.status


def _load(library: object) -> object:
    def cdll(name: str) -> object:
        assert name == "libnccl.so.2"
        if isinstance(library, Exception):
            raise library
        return library
    return cdll


def test_the_loaded_librarys_own_version_wins_over_torchs_build_version(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nccl_version.ctypes, "CDLL", _load(_Library(23004)))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert loaded_nccl_version() == (2, 30, 4)


@pytest.mark.parametrize("library", [OSError("not found"), _Library(0, status=1), object()],
                         ids=["not loadable", "call fails", "no ncclGetVersion"])
def test_torchs_build_version_where_the_library_cannot_be_asked(monkeypatch: pytest.MonkeyPatch,
                                                                library: object) -> None:
    monkeypatch.setattr(nccl_version.ctypes, "CDLL", _load(library))
    monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 21, 5))
    assert loaded_nccl_version() == (2, 21, 5)


def test_this_machine_gets_a_version_triple() -> None:
    assert [type(part) for part in loaded_nccl_version()] == [int, int, int]
