"""What the Transformer Engine tier's tests share: TE modules built on a machine without CUDA.

TE refuses to construct a module ("TransformerEngine needs CUDA") unless ``torch.cuda.is_available()``
says True, and any TE forward needs a GPU. So the tier builds under :func:`cuda_reported_available`
only, and checks structure and call paths, never TE's math.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import torch
from torch import nn


@contextlib.contextmanager
def cuda_reported_available() -> Iterator[None]:
    """``torch.cuda.is_available()`` is True inside (module construction only: nothing runs on a GPU)."""
    with mock.patch.object(torch.cuda, "is_available", lambda: True):
        yield


def te_linear_classes() -> tuple[type, ...]:
    """TE's four linears with a delayed weight gradient (``delay_wgrad_compute=``, ``backward_dw``);
    Megatron's TE wrappers (``TELinear``, ``TELayerNormColumnParallelLinear``, the grouped ones) subclass them."""
    import transformer_engine.pytorch as te

    return (te.Linear, te.LayerNormLinear, te.LayerNormMLP, te.GroupedLinear)


def te_linears(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.modules() if isinstance(m, te_linear_classes())]


def te_backward_dw_owner(linear: nn.Module) -> type:
    """The TE class whose own ``backward_dw`` this linear runs (Megatron's wrappers call it through
    ``super()``): where TE pops the delayed weight GEMM from the module's ``wgrad_store``."""
    return next(cls for cls in type(linear).__mro__
                if cls.__module__.startswith("transformer_engine.") and "backward_dw" in vars(cls))
