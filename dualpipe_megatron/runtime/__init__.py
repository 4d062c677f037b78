"""Pipeline runtime: executes schedule IR op lists over ``torch.distributed`` p2p."""

from .agreement import PlanMismatchError
from .executor import Executor, OpObserver, StepStats
from .handlers import ModuleHandlers, StageHandlers, StepData, StepResult
from .mirror import sync_mirrored_grads
from .p2p import DistTransport, DryTransport, P2P, PipelineCommError
from .plan import Message, MessagePlan
from .pipeline import Pipeline
from .wgrad import DeferrableLinear, WeightGradStore, deferring, make_linears_deferrable, run_backward

__all__ = [
    "DeferrableLinear", "DistTransport", "DryTransport", "Executor", "Message", "MessagePlan", "ModuleHandlers",
    "OpObserver", "P2P", "Pipeline", "PipelineCommError", "PlanMismatchError", "StageHandlers", "StepData",
    "StepResult", "StepStats", "WeightGradStore", "deferring", "make_linears_deferrable", "run_backward",
    "sync_mirrored_grads",
]
