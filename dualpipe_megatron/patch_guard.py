"""Guarded monkeypatching: every replaced symbol is checked, recorded and restorable.

A patch applied to a symbol whose shape we do not know would fail silently or corrupt results,
so we check before replacing and refuse unsupported versions outright. Each subsystem (CPU
compat, the training flag, each weight-grad deferral, mirror replicas, EPLB, strict mode) owns
one :class:`PatchSet`, so undoing one leaves the others live. A symbol belongs to one set at a
time; only strict mode's recorders stack on another set's patch (CPU compat's
``all_to_all_single``), and they are restored first. This module imports no other
sub-package, so the runtime, the Megatron adapter and EPLB all patch through it; the
Megatron-specific checks (version, private symbols) live in :mod:`.megatron.guard`.

Expected signatures come in two strengths. Megatron is pinned to 0.19.x, so its symbols are
checked in full: the signature as ``inspect.signature`` prints it without annotations, e.g.
``"(args, defaults={})"`` (names, kinds, defaults). torch is a range (>= 2.6) whose releases add
trailing options, so torch symbols are checked by a list of leading parameter names.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import inspect
import sys
import types
from pathlib import Path
from typing import Any, Sequence

SUPPORTED_MEGATRON = (0, 19)
SUPPORTED = f"megatron-core {'.'.join(map(str, SUPPORTED_MEGATRON))}.x"

_INHERITED = object()  # restore by deleting: the owner did not define the attribute itself
_MISSING = object()
_DESCRIPTORS = (staticmethod, classmethod)


def installed_megatron_version() -> str | None:
    """The megatron-core distribution's version from package metadata (None: no distribution,
    as with a source checkout on ``PYTHONPATH``)."""
    try:
        return importlib.metadata.version("megatron-core")
    except importlib.metadata.PackageNotFoundError:
        return None


def imported_megatron_version() -> str | None:
    """``megatron.core.package_info.__version__`` of the megatron Python imports (or would import):
    the loaded module, else its file run alone, since importing ``megatron.core`` costs seconds.
    None where no ``megatron.core`` is found."""
    loaded = sys.modules.get("megatron.core.package_info")
    if loaded is not None:
        return loaded.__version__
    try:
        spec = importlib.util.find_spec("megatron.core")  # imports only the namespace ``megatron``
    except ModuleNotFoundError:
        return None
    if spec is None or spec.origin is None:
        return None
    path = Path(spec.origin).with_name("package_info.py")
    if not path.is_file():
        return None
    info = importlib.util.spec_from_file_location("_dualpipe_megatron_package_info", path)
    module = importlib.util.module_from_spec(info)
    info.loader.exec_module(module)
    return module.__version__


def _release(version: str) -> str:
    """A version without its local part (package_info appends ``+<git hash>`` inside any checkout)."""
    return version.split("+")[0]


def megatron_version() -> str | None:
    """The version of the megatron that runs: the imported package's own, else the metadata's."""
    return imported_megatron_version() or installed_megatron_version()


def megatron_version_mismatch() -> str | None:
    """One line when the metadata and the imported megatron disagree (a source checkout shadowing
    an installed wheel), else None."""
    installed, imported = installed_megatron_version(), imported_megatron_version()
    if installed is None or imported is None or _release(installed) == _release(imported):
        return None
    return (f"megatron-core {installed} is installed, but the megatron imported here is "
            f"{imported} (a source tree ahead on the path); checking and running against {imported}")


def _bare_signature(obj: Any) -> str | None:
    """``obj``'s signature without annotations (their spelling varies), or None for builtins."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return None
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


def unsupported(label: str, what: str) -> RuntimeError:
    return RuntimeError(f"{label}: {what}; dualpipe_megatron supports {SUPPORTED} only "
                        f"(installed: megatron-core {megatron_version() or 'none'})")


def _param_names(obj: Any) -> list[str] | None:
    try:
        return list(inspect.signature(obj).parameters)
    except (TypeError, ValueError):  # builtins without a Python signature
        return None


def check_signature(obj: Any, expected: str | Sequence[str], label: str) -> None:
    """Raise, naming ``label`` and the supported versions, unless ``obj`` has the expected shape."""
    if isinstance(expected, str):
        found = _bare_signature(obj)
        if found == expected:
            return
        what = f"expected signature {expected}, found {found}"
    else:
        found_names = _param_names(obj)
        if found_names is not None and found_names[: len(expected)] == list(expected):
            return
        what = f"expected parameters {list(expected)}, found {found_names}"
    raise unsupported(label, what)


def _label(owner: Any, name: str) -> str:
    if isinstance(owner, types.ModuleType):
        return f"{owner.__name__}.{name}"
    cls = owner if isinstance(owner, type) else type(owner)
    where = f"{cls.__module__}.{cls.__qualname__}"
    return f"{where}.{name}" if cls is owner else f"{where}.{name} (instance attribute)"


def _saved_value(owner: Any, name: str) -> Any:
    """What restore must put back: the raw object from the owner's own ``__dict__`` (a
    staticmethod stays a staticmethod), :data:`_INHERITED` when the attribute comes from a
    class, or the plain value for attributes served dynamically (torch's config modules)."""
    own = getattr(owner, "__dict__", {})
    if name in own:
        return own[name]
    if inspect.getattr_static(owner, name, _MISSING) is not _MISSING:
        return _INHERITED
    return getattr(owner, name)


def _same_kind(owner: Any, name: str, new: Any, label: str) -> Any:
    """``new`` in the descriptor kind of the class attribute it replaces, so callers bind it as
    they bound the original."""
    if not isinstance(owner, type):
        return new
    kind = type(inspect.getattr_static(owner, name, None))
    if isinstance(new, _DESCRIPTORS):
        if type(new) is not kind:
            raise RuntimeError(f"cannot patch {label}: a {type(new).__name__} cannot replace a "
                               f"{kind.__name__}")
        return new
    return kind(new) if kind in _DESCRIPTORS else new


# (id(owner), name) -> the sets holding that patch, the newest (the one callers reach) last. A
# symbol belongs to one subsystem at a time, except that a recorder may stack on top of it.
_holders: dict[tuple[int, str], list[PatchSet]] = {}


class PatchSet:
    """The patches of one subsystem: installed one by one, undone together.

    Holds each owner it patched (so ids stay unique) until :meth:`restore`.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._saved: dict[tuple[int, str], tuple[Any, str, Any]] = {}

    def patch(self, owner: Any, name: str, new: Any,
              signature: str | Sequence[str] | None = None, stack: bool = False) -> bool:
        """Replace ``owner.name`` by ``new``; False if this set already did.

        ``signature`` is the full bare signature (Megatron) or leading parameter names (torch) of
        the attribute as callers see it (``getattr(owner, name)``); None for non-callables and
        builtins. A mismatch, a missing symbol or another set's patch raises and patches nothing,
        unless ``stack``: then ``new`` wraps the other set's patch (strict mode's recorders
        observe whatever callers reach), and this set must be restored before that one.
        """
        key = (id(owner), name)
        label = _label(owner, name)
        holders = _holders.get(key, [])
        if self in holders:
            return False
        if holders and not stack:
            raise RuntimeError(f"cannot patch {label} for {self.name}: {holders[-1].name} patched it")
        if not hasattr(owner, name):
            raise unsupported(f"cannot patch {label}", "symbol not found")
        if signature is not None:
            check_signature(getattr(owner, name), signature, f"cannot patch {label}")
        new = _same_kind(owner, name, new, label)
        self._saved[key] = (owner, name, _saved_value(owner, name))
        _holders.setdefault(key, []).append(self)
        setattr(owner, name, new)
        return True

    def is_patched(self, owner: Any, name: str) -> bool:
        return self in _holders.get((id(owner), name), [])

    def labels(self) -> list[str]:
        """The qualified names this set holds now, in patch order: the record docs are checked
        against."""
        return [_label(owner, name) for owner, name, _ in self._saved.values()]

    def restore(self) -> None:
        """Put back exactly what each patch replaced, newest first (idempotent). Refuses, and
        restores nothing, while another set's patch is stacked on one of this set's."""
        for key, (owner, name, _) in self._saved.items():
            top = _holders[key][-1]
            if top is not self:
                raise RuntimeError(f"cannot restore {_label(owner, name)} for {self.name}: "
                                   f"{top.name} patched over it; restore that first")
        for key, (owner, name, saved) in reversed(list(self._saved.items())):
            if saved is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, saved)
            _holders[key].pop()
            if not _holders[key]:
                del _holders[key]
        self._saved.clear()


def around(original: Any, hook: Any) -> Any:
    """``original`` wrapped so that each call runs ``hook(original, *args, **kwargs)``: the shape
    of every hook our patch sets install."""
    @functools.wraps(original)
    def patched(*args: Any, **kwargs: Any) -> Any:
        return hook(original, *args, **kwargs)
    return patched


def is_patched(owner: Any, name: str) -> bool:
    """Whether any subsystem has replaced ``owner.name``."""
    return (id(owner), name) in _holders


def installed() -> dict[str, list[str]]:
    """Every live patch by subsystem: ``{set name: its labels()}``, sets in the order of their
    first patch. The record docs/training.md's route table is checked against."""
    sets: dict[int, PatchSet] = {}
    for holders in _holders.values():
        for holder in holders:
            sets.setdefault(id(holder), holder)
    return {holder.name: holder.labels() for holder in sets.values()}


__all__ = ["SUPPORTED", "SUPPORTED_MEGATRON", "PatchSet", "around", "check_signature", "imported_megatron_version",
           "installed", "installed_megatron_version", "is_patched", "megatron_version", "megatron_version_mismatch",
           "unsupported"]
