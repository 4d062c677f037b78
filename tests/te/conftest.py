"""The Transformer Engine tier: run by `bash scripts/tier.sh te` in .venv-te (``make setup-te`` builds it),
never by the main suite (tests/conftest.py leaves this folder out)."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    try:
        import transformer_engine.pytorch  # noqa: F401 - the tier's premise; ~4 s, paid once here
    except (ImportError, OSError, RuntimeError) as exc:
        pytest.exit(f"tests/te needs Transformer Engine: run it with bash scripts/tier.sh te, which runs "
                    f".venv-te with TE's library paths (make setup-te builds it): {exc}", returncode=4)
