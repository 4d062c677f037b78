"""A model parameter's optimizer-side tensors, whole, whatever Megatron optimizer holds them.

Moving an expert moves its weights *and* what the optimizer keeps for them: the fp32 main
copy (under fp16/bf16) and Adam's moments. Megatron keeps those per parameter (plain
optimizers) or as this data-parallel rank's slice of a flat buffer (distributed optimizer).
:class:`OptimizerTensors` gives both as whole flat fp32 tensors (slices are summed over the
data-parallel group, each element owned by one rank) and writes them back the same way.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


# Private DistributedOptimizer methods called here, checked before use (guard.check_private_symbols).
PRIVATE_CALLS = (
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._get_model_param_range_map",
     "(self, param)"),
    ("megatron.core.optimizer.distrib_optimizer", "DistributedOptimizer._get_main_param_and_optimizer_states",
     "(self, model_param)"),
)


def _leaf_optimizers(optimizer: Any) -> list[Any]:
    chained = getattr(optimizer, "chained_optimizers", None)
    return [leaf for sub in chained for leaf in _leaf_optimizers(sub)] if chained is not None else [optimizer]


def _state_tensors(inner: Any, main: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per-element optimizer state of ``main`` (Adam's exp_avg/exp_avg_sq; not ``step``)."""
    return {k: v for k, v in inner.state.get(main, {}).items()
            if isinstance(v, torch.Tensor) and v.numel() == main.numel() and k != "step"}


class OptimizerTensors:
    """Read and write the main copy and optimizer state of model parameters, whole."""

    def __init__(self, optimizer: Any) -> None:
        self._plain: dict[torch.nn.Parameter, tuple[Any, torch.Tensor]] = {}
        self._distributed: dict[torch.nn.Parameter, Any] = {}
        for leaf in _leaf_optimizers(optimizer):
            kind = type(leaf).__name__
            if hasattr(leaf, "model_param_gbuf_map"):
                if leaf.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
                    raise NotImplementedError("EPLB: the precision-aware distributed optimizer is not supported")
                # Every parameter of its buffers: one may have no element in this rank's shard.
                for buffer in leaf.buffers:
                    self._distributed.update(dict.fromkeys(buffer.param_index_map, leaf))
            elif hasattr(leaf, "float16_groups"):
                for f16, f32 in zip(leaf.float16_groups, leaf.fp32_from_float16_groups):
                    self._plain.update({p: (leaf.optimizer, m) for p, m in zip(f16, f32)})
                for group in leaf.fp32_from_fp32_groups:
                    self._plain.update({p: (leaf.optimizer, p) for p in group})
            elif kind == "FP32Optimizer":
                for group in leaf.optimizer.param_groups:
                    self._plain.update({p: (leaf.optimizer, p) for p in group["params"]})
            else:
                raise NotImplementedError(f"EPLB cannot move optimizer state of {kind}")

    def read_keys(self, param: torch.nn.Parameter) -> list[str]:
        """The names :meth:`read` returns for ``param``, sorted (no communication)."""
        if param in self._plain:
            inner, main = self._plain[param]
            return sorted({"main", *_state_tensors(inner, main)})
        return self._keys(self._require(param))

    def read(self, param: torch.nn.Parameter) -> dict[str, torch.Tensor]:
        """``{"main": ..., state...}`` as whole flat fp32 tensors (collective under the
        distributed optimizer: every rank of its data-parallel group must call it)."""
        if param in self._plain:
            inner, main = self._plain[param]
            tensors = {"main": main, **_state_tensors(inner, main)}
            return {k: v.detach().float().flatten().clone() for k, v in tensors.items()}
        leaf = self._require(param)
        shard, owned = self._shard(leaf, param)
        out = {}
        for key in self.read_keys(param):
            whole = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
            if key in shard:
                whole[owned.start:owned.end] = shard[key].detach().float().flatten()
            dist.all_reduce(whole, group=leaf.data_parallel_group)
            out[key] = whole
        return out

    def write(self, param: torch.nn.Parameter, tensors: dict[str, torch.Tensor]) -> None:
        """Store what :meth:`read` returned (for another parameter of the same shape)."""
        if param in self._plain:
            inner, main = self._plain[param]
            targets = {"main": main, **_state_tensors(inner, main)}
            for key, target in targets.items():
                target.data.copy_(tensors[key].view_as(target))
            return
        leaf = self._require(param)
        shard, owned = self._shard(leaf, param)
        for key, target in shard.items():
            target.data.copy_(tensors[key][owned.start:owned.end].view_as(target))

    def _require(self, param: torch.nn.Parameter) -> Any:
        leaf = self._distributed.get(param)
        if leaf is None:
            raise KeyError("EPLB: an expert parameter is not held by the optimizer")
        return leaf

    @staticmethod
    def _shard(leaf: Any, param: torch.nn.Parameter) -> tuple[dict[str, torch.Tensor], Any]:
        """This rank's slice of ``param``'s main copy and state, and the range it covers."""
        try:
            owned = leaf._get_model_param_range_map(param)["param"]
        except KeyError:  # no element of it in this rank's part of the buffer
            return {}, None
        if param not in leaf.model_param_group_index_map or owned.size == 0:
            return {}, owned
        tensors = leaf._get_main_param_and_optimizer_states(param)
        tensors["main"] = tensors.pop("param")
        return {k: v for k, v in tensors.items() if k != "step" and v.numel() == owned.size}, owned

    @staticmethod
    def _keys(leaf: Any) -> list[str]:
        """The state names every rank of the group agrees on (Adam's after its first step)."""
        names = {"main"}
        for group in leaf.optimizer.param_groups:
            for main in group["params"]:
                names |= set(_state_tensors(leaf.optimizer, main))
        return sorted(names)


__all__ = ["PRIVATE_CALLS", "OptimizerTensors"]
