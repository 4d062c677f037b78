"""Megatron-Core's own schedules, MoE and optimizer on CPU/gloo through the CPU-compat layer.

One launch of two rank processes (tests/megatron_workers.py) runs every layout; each check
below reads its verdict. A failing or hanging rank fails every check with its log.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpipe_megatron.megatron.cpu_compat import GROUPS

from launcher import assert_verdict, run_script

pytestmark = pytest.mark.multiprocess

WORKER = Path(__file__).with_name("megatron_workers.py")
WORLD_SIZE = 2
TIMEOUT_S = 240


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, object]]:
    return run_script(WORKER, WORLD_SIZE, tmp_path_factory.mktemp("megatron_cpu"), TIMEOUT_S)


def test_all_groups_installed_in_workers(results: dict[str, dict[str, object]]) -> None:
    assert results["installed"]["detail"].split(",") == list(GROUPS)


@pytest.mark.parametrize(
    "check",
    [
        "rng_fork",  # Megatron's RNG tracker really forks the (CPU) generator
        "pp2_1f1b",  # PP=2 1F1B == PP=1, losses and every grad bit for bit
        "pp2_vpp2",  # PP=2 x VPP=2 interleaved == PP=1, bit for bit
        "moe_ep2",  # MoE 4 experts top-2 alltoall, EP=2 == EP=1 (losses and grads, 1e-7)
        "ddp_distopt",  # DDP overlapped reduce + distributed optimizer step == torch Adam
    ],
)
def test_megatron_on_cpu(results: dict[str, dict[str, object]], check: str) -> None:
    assert_verdict(results, check)
