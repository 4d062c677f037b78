"""Drop-in names of DeepSeek's ``dualpipe`` package, run by this project's runtime.

Code written for the reference works with ``dualpipe`` replaced by
``dualpipe_megatron.compat`` in its imports (``dualpipe.utils`` becomes
``dualpipe_megatron.compat.utils``).
"""

from ..runtime.mirror import sync_mirrored_grads
from .comm import set_p2p_tensor_dtype, set_p2p_tensor_shapes
from .dualpipe import DualPipe, DualPipeV
from .utils import WeightGradStore

__all__ = [
    "DualPipe", "DualPipeV", "WeightGradStore", "set_p2p_tensor_dtype", "set_p2p_tensor_shapes",
    "sync_mirrored_grads",
]
