"""DualPipe and DualPipeV for Megatron-Bridge's ``pretrain()`` (:func:`enable`)."""

from .route import enable

__all__ = ["enable"]
