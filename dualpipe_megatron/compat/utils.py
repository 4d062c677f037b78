"""The helpers user code imports from the reference's ``dualpipe.utils``."""

from ..runtime.wgrad import WeightGradStore, run_backward

__all__ = ["WeightGradStore", "run_backward"]
