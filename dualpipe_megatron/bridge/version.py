"""The Megatron-Bridge releases the route is tested with; any other is refused before patching."""

from __future__ import annotations

from importlib import metadata

SUPPORTED_BRIDGE = (0, 6)


def check_bridge_version() -> str:
    """The installed megatron-bridge version, raising unless it is a 0.6.x release."""
    try:
        version = metadata.version("megatron-bridge")
    except metadata.PackageNotFoundError:
        raise RuntimeError("megatron-bridge is not installed (pip install --no-deps megatron-bridge==0.6.2; "
                           "docs/training.md, 'Megatron-Bridge')") from None
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:2] if p.isdigit())
    if parts != SUPPORTED_BRIDGE:
        raise RuntimeError(f"megatron-bridge {version} is not supported; dualpipe_megatron.bridge hooks "
                           f"{SUPPORTED_BRIDGE[0]}.{SUPPORTED_BRIDGE[1]}.x only")
    return version


__all__ = ["SUPPORTED_BRIDGE", "check_bridge_version"]
