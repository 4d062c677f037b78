"""Guarded monkeypatching: every replaced symbol is checked, recorded and restorable.

Megatron changes between releases; a patch applied to a symbol whose shape we do not
know would fail silently or corrupt results, so we check before replacing and refuse
unsupported versions outright.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any

SUPPORTED_MEGATRON = (0, 19)

# (id(owner), name) -> (owner, original value, whether owner defined it rather than inherited it)
_originals: dict[tuple[int, str], tuple[Any, Any, bool]] = {}


def check_version() -> str:
    """Return the megatron-core version, raising unless it is a 0.19.x release we support."""
    try:
        version = importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError as exc:
        raise RuntimeError("megatron-core is not installed") from exc
    parts = version.split("+")[0].split(".")
    if tuple(int(p) for p in parts[:2] if p.isdigit()) != SUPPORTED_MEGATRON:
        raise RuntimeError(
            f"megatron-core {version} is not supported; dualpipe_megatron patches "
            f"{'.'.join(map(str, SUPPORTED_MEGATRON))}.x only"
        )
    return version


def _param_names(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None


def patch_attr(owner: Any, name: str, new: Any, expected_params: list[str] | None = None) -> bool:
    """Replace `owner.name` by `new`, once; return False if it was already patched.

    `expected_params` must be a prefix of the original's parameter names; a mismatch (or a
    missing symbol) raises, because it means Megatron or torch changed under us.
    """
    key = (id(owner), name)
    if key in _originals:
        return False
    label = f"{getattr(owner, '__name__', type(owner).__name__)}.{name}"
    if not hasattr(owner, name):
        raise RuntimeError(f"cannot patch {label}: symbol not found (unsupported version?)")
    original = getattr(owner, name)
    if expected_params is not None:
        actual = _param_names(original)
        if actual is None or actual[: len(expected_params)] != expected_params:
            raise RuntimeError(
                f"cannot patch {label}: expected parameters {expected_params}, found {actual} "
                "(unsupported version?)"
            )
    own = not isinstance(owner, type) or name in vars(owner)
    _originals[key] = (owner, original, own)
    setattr(owner, name, new)
    return True


def is_patched(owner: Any, name: str) -> bool:
    return (id(owner), name) in _originals


def restore_all() -> None:
    """Undo every patch, newest first (for tests and diagnosis)."""
    for (_, name), (owner, value, own) in reversed(list(_originals.items())):
        if own:
            setattr(owner, name, value)
        else:
            delattr(owner, name)
    _originals.clear()
