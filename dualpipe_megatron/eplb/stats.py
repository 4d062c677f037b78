"""Expert load statistics: tokens routed to each logical expert, per MoE layer, over a window.

The planner wants *predicted* load; DeepSeek predicts it from a moving average of recent
history, and so do we: :class:`LoadStats` keeps the last ``window`` iterations' counts
(``[layers, experts]``, already summed over every rank that routes) and averages them.
The same object is written to JSON (``--eplb-stats-file``, checkpoints), read back by
``python -m dualpipe_megatron.eplb plan|stats`` and restored on resume, so its format is a
contract (``FORMAT``, see docs/eplb.md).
"""

from __future__ import annotations

import json
from collections import deque
from pathlib import Path
from typing import Any

import torch

FORMAT = "dualpipe_megatron.eplb.stats/1"


class LoadStats:
    """Per-iteration expert token counts of ``layers`` (global MoE layer numbers, 1-based)."""

    def __init__(self, layers: list[int], num_experts: int, window: int) -> None:
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window}")
        if num_experts < 1 or not layers:
            raise ValueError(f"need at least one layer and one expert, got {len(layers)} x {num_experts}")
        self.layers = list(layers)
        self.num_experts = num_experts
        self.window = window
        self.history: deque[torch.Tensor] = deque(maxlen=window)

    def add(self, counts: torch.Tensor) -> None:
        """One iteration's ``[layers, experts]`` token counts."""
        expected = (len(self.layers), self.num_experts)
        if tuple(counts.shape) != expected:
            raise ValueError(f"counts shape {tuple(counts.shape)} != {expected}")
        self.history.append(counts.detach().to("cpu", torch.float64))

    @property
    def empty(self) -> bool:
        return not self.history

    def average(self) -> torch.Tensor:
        """Moving average over the window: the predicted load, ``[layers, experts]``."""
        if self.empty:
            raise ValueError("no iteration recorded yet")
        return torch.stack(list(self.history)).mean(dim=0)

    def last(self) -> torch.Tensor:
        if self.empty:
            raise ValueError("no iteration recorded yet")
        return self.history[-1]

    # -- JSON -----------------------------------------------------------------------------------
    def to_json_obj(self, iteration: int, placement: torch.Tensor | None = None,
                    ep_size: int | None = None) -> dict[str, Any]:
        """The file's content; ``placement`` is ``[layers, slots]`` physical -> logical expert."""
        return {
            "format": FORMAT,
            "iteration": iteration,
            "num_experts": self.num_experts,
            "window": self.window,
            "ep_size": ep_size,
            "layers": self.layers,
            "history": [h.tolist() for h in self.history],
            "load": self.average().tolist() if self.history else None,
            "placement": None if placement is None else placement.tolist(),
        }

    def save(self, path: str | Path, iteration: int, placement: torch.Tensor | None = None,
             ep_size: int | None = None) -> None:
        """Write atomically (a reader never sees half a file)."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json_obj(iteration, placement, ep_size)))
        tmp.replace(path)

    @classmethod
    def from_json_obj(cls, obj: dict[str, Any]) -> "LoadStats":
        if not isinstance(obj, dict) or obj.get("format") != FORMAT:
            found = obj.get("format") if isinstance(obj, dict) else type(obj).__name__
            raise ValueError(f"not an EPLB stats file (format {found!r}, expected {FORMAT!r})")
        stats = cls(obj["layers"], obj["num_experts"], obj["window"])
        for counts in obj["history"]:
            stats.add(torch.tensor(counts, dtype=torch.float64))
        return stats


def read_stats_file(path: str | Path) -> tuple[LoadStats, dict[str, Any]]:
    """The statistics in ``path`` and the file's whole content (iteration, placement, ep_size)."""
    obj = json.loads(Path(path).read_text())
    return LoadStats.from_json_obj(obj), obj


__all__ = ["FORMAT", "LoadStats", "read_stats_file"]
