"""scripts/pretrain_gpt.py with a skewed router: a fixed bias on every MoE router's logits (bench use).

Without a skew, a small model's router spreads tokens almost evenly and EPLB has nothing to
balance. Here every ``TopKRouter`` adds, before routing, a bias that depends only on its
layer number: a seeded permutation of the experts gets a linear ramp from ``--router-skew A``
(the hottest expert) down to 0 (the coldest), in logit units. The same on every rank and in
every run, and not a parameter, so training cannot learn it away. Run through torchrun exactly
like pretrain_gpt.py, with ``--router-skew A`` (default 0.2) among the arguments.
"""

from __future__ import annotations

import argparse
import functools
import runpy
import sys
from pathlib import Path

import torch

PRETRAIN = Path(__file__).resolve().parent.parent / "scripts" / "pretrain_gpt.py"
SEED = 1234


def router_bias(layer_number: int, num_experts: int, amplitude: float) -> torch.Tensor:
    """Layer ``layer_number``'s bias per logical expert: a ramp over a permutation seeded by the layer."""
    order = torch.randperm(num_experts, generator=torch.Generator().manual_seed(SEED + layer_number))
    bias = torch.empty(num_experts, dtype=torch.float64)
    bias[order] = torch.linspace(amplitude, 0.0, num_experts, dtype=torch.float64)
    return bias


def install_skew(amplitude: float) -> None:
    """Add :func:`router_bias` to the output of every ``TopKRouter.gating`` in this process."""
    from megatron.core.transformer.moe.router import TopKRouter

    original = TopKRouter.gating

    @functools.wraps(original)
    def gating(self: TopKRouter, input: torch.Tensor) -> torch.Tensor:  # noqa: A002 - Megatron's name
        logits = original(self, input)
        bias = router_bias(self.layer_number, logits.size(-1), amplitude)
        return logits + bias.to(logits.device, logits.dtype)

    TopKRouter.gating = gating


def main() -> None:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    parser.add_argument("--router-skew", type=float, default=0.2)
    ours, rest = parser.parse_known_args(sys.argv[1:])
    install_skew(ours.router_skew)
    sys.argv = [str(PRETRAIN), *rest]
    runpy.run_path(str(PRETRAIN), run_name="__main__")


if __name__ == "__main__":
    main()
