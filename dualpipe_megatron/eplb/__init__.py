"""Expert-parallel load balancing (EPLB): where each MoE expert's replicas live.

:func:`rebalance_experts` is a planner API-compatible with DeepSeek's
``eplb.rebalance_experts`` (same arguments, same ``(phy2log, log2phy, logcnt)``
for the same inputs); :func:`adopt` guards it, keeping the current placement
unless the plan is predicted to lower the per-GPU max/mean load by a threshold.

In Megatron training (``--eplb-*``, :mod:`.training`): :mod:`.experts` counts and remaps at the
routers, :mod:`.stats` keeps the load window, :mod:`.nodes` keeps routing groups on one node
(DeepSeek's hierarchical policy), :mod:`.placement` aligns plans with the current placement,
:mod:`.moves` moves experts with :mod:`.optimizer_state`'s tensors; ``python -m
dualpipe_megatron.eplb plan|stats`` (:mod:`.cli`) works on the statistics offline. Megatron is
imported lazily: the planner needs torch only.
"""

from .guard import adopt, gpu_loads, imbalance
from .planner import rebalance_experts

__all__ = ["adopt", "gpu_loads", "imbalance", "rebalance_experts"]
