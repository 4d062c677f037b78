"""The Megatron-Bridge tier: run by `bash scripts/tier.sh bridge` in .venv-bridge (``make setup-bridge``
builds it), never by the main suite (tests/conftest.py leaves this folder out)."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        from megatron.bridge.training.pretrain import pretrain  # noqa: F401 - the tier's premise
    except (ImportError, OSError, RuntimeError) as exc:
        pytest.exit(f"tests/bridge needs Megatron-Bridge: run it with bash scripts/tier.sh bridge, which runs "
                    f".venv-bridge with TE's library paths (make setup-bridge builds it): {exc}", returncode=4)
