"""Switching Megatron's ``parallel_state`` between layouts initialised once each.

The benchmark alternates schedules step by step inside one process group, and
each schedule wants its own model-parallel state (virtual pipeline size,
embedding group). ``initialize_model_parallel`` creates new process groups on
every call and ``destroy_model_parallel`` only forgets them, so re-initialising
per step would pile up gloo groups. Instead each layout is initialised once and
its module globals are saved; activating a layout puts them back.
"""

from __future__ import annotations

from typing import Any


def _state_names(module: Any) -> list[str]:
    """The module's private upper-case globals: its groups, ranks, sizes and buffers."""
    return [n for n in vars(module) if n.startswith("_") and n[1:2].isupper() and n.upper() == n]


class ParallelState:
    """One initialised layout of ``megatron.core.parallel_state``."""

    def __init__(self, **initialize_kwargs: Any) -> None:
        from megatron.core import parallel_state as ps
        from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

        ps.destroy_model_parallel()
        ps.initialize_model_parallel(**initialize_kwargs)
        model_parallel_cuda_manual_seed(1234)
        self._saved = {n: getattr(ps, n) for n in _state_names(ps)}

    def activate(self) -> None:
        from megatron.core import parallel_state as ps

        vars(ps).update(self._saved)
