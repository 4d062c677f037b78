"""Our guard's records and checks with Transformer Engine imported, and TE 2.20's delayed-wgrad API.

With TE importable, megatron-core takes its ``HAVE_TE`` branches (its TE extensions, TE's RNG and
FP8 state, the TE layer specs), so every patch set installs here again through the guard, which
checks each patched symbol's signature, and the records must still be docs/training.md's tables
(scripts/route_patches.py's record, taken in a process that imported TE): every row verbatim but
CPU compat's, which gains the ``te_fallbacks`` group (docs/megatron_cpu.md). TE itself we never
patch: we rely on its four linears' ``delay_wgrad_compute=`` and ``backward_dw``/``wgrad_store``,
which Megatron's TE wrappers call, and on the version requirements-te.txt pins.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from pathlib import Path

import pytest
import torch

from dualpipe_megatron.patch_guard import check_signature
from launcher import fork_pretrain, job_env, marked_json
from te_helpers import cuda_reported_available, te_linear_classes
from test_guard import (
    TRAINING_MD,
    route_patches,
    test_each_route_installs_the_same_sets_and_a_job_adds_the_rest as check_routes,
    test_uninstalling_the_routes_leaves_no_patch as check_uninstall,
)

ROOT = Path(__file__).resolve().parents[2]
REQUIREMENTS = ROOT / "requirements-te.txt"
ROUTE_RECORDS = f"""
import json, runpy
print("ROUTE_RECORDS " + json.dumps(runpy.run_path({str(ROOT / "scripts" / "route_patches.py")!r})["record"]()))
"""
# Before the records: TE is what this process imported, and the private Megatron calls still fit.
TE_FIRST = """
import transformer_engine.pytorch
from megatron.core.extensions import transformer_engine as te_extension
from dualpipe_megatron.megatron.guard import check_private_symbols

assert te_extension.HAVE_TE, "megatron-core did not take its Transformer Engine branch"
check_private_symbols()
"""
# Megatron's TE linears that layer slots call backward_dw on (MLA, MLPs, grouped experts, MTP).
MEGATRON_TE_LINEARS = ("TELinear", "TELayerNormColumnParallelLinear", "TEColumnParallelLinear",
                       "TERowParallelLinear", "TEGroupedLinear", "TEColumnParallelGroupedLinear",
                       "TERowParallelGroupedLinear")
# Constructor sizes of TE's four linears.
SIZES = {"Linear": (4, 4), "LayerNormLinear": (4, 4), "LayerNormMLP": (4, 8), "GroupedLinear": (2, 4, 4)}


@pytest.fixture(scope="module")
def route_records(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tests/test_guard.py's records, from a rank of the fork server (which imported TE) that ran
    the launcher's installs, as ``python -m dualpipe_megatron.launch`` does."""
    out = tmp_path_factory.mktemp("te_routes")
    script = out / "record_routes.py"
    script.write_text(TE_FIRST + ROUTE_RECORDS)
    log = fork_pretrain("te_routes", 1, [], job_env(), out / "routes.log", timeout=120, script=script)
    [records] = marked_json(log, "ROUTE_RECORDS")
    return records


def test_the_guard_records_what_the_docs_list(route_records: dict) -> None:
    check_routes(route_records)
    check_uninstall(route_records)
    docs = TRAINING_MD.read_text()
    rows = route_patches.tables(route_records).splitlines()
    assert [row for row in rows if row not in docs and not row.startswith("| `CPU compat` |")] == []
    assert "megatron.core.transformer.transformer_block.LayerNormImpl" in route_records["launcher"]["CPU compat"]


def test_te_is_the_pinned_version() -> None:
    """TE's three distributions, its torch binding (pinned in scripts/setup_te.sh) included, are the
    version requirements-te.txt pins."""
    [pinned] = [line.split("==")[1].strip() for line in REQUIREMENTS.read_text().splitlines()
                if line.startswith("transformer-engine==")]
    found = {name: importlib.metadata.version(name)
             for name in ("transformer-engine", "transformer-engine-cu13", "transformer-engine-torch")}
    assert set(found.values()) == {pinned}, found


@pytest.mark.parametrize("cls", te_linear_classes(), ids=lambda cls: cls.__name__)
def test_te_linears_keep_the_delayed_wgrad_api(cls: type) -> None:
    """Megatron passes ``delay_wgrad_compute=True`` (off by default) and calls ``backward_dw()``;
    TE pops the GEMM there when ``need_backward_dw()``, which its ``wgrad_store`` answers."""
    param = inspect.signature(cls.__init__).parameters["delay_wgrad_compute"]
    assert param.default is False and param.kind is not inspect.Parameter.POSITIONAL_ONLY
    for name in ("backward_dw", "need_backward_dw"):
        check_signature(getattr(cls, name), "(self)", f"{cls.__module__}.{cls.__qualname__}.{name}")
    for delay in (True, False):
        with cuda_reported_available():
            module = cls(*SIZES[cls.__name__], params_dtype=torch.float32, device="cpu", delay_wgrad_compute=delay)
        assert module.wgrad_store.delay_wgrad_compute() is delay and module.need_backward_dw() is delay


@pytest.mark.parametrize("name", MEGATRON_TE_LINEARS)
def test_megatron_te_linears_are_te_linears(name: str) -> None:
    """What layer slots call: subclasses of TE's four, whose ``backward_dw`` reaches TE's own
    (tests/te/test_te_chunks.py records it being reached)."""
    from megatron.core.extensions import transformer_engine as te_extension

    cls = getattr(te_extension, name)
    assert issubclass(cls, te_linear_classes()), cls.__mro__
    check_signature(cls.backward_dw, "(self)", f"{cls.__module__}.{name}.backward_dw")
