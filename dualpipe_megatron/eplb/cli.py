"""``python -m dualpipe_megatron.eplb``: plan an expert placement from a stats file, or summarize one.

Bad input ends with one ``error:`` line and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from ..schedules.cli import CliParser, positive_int, run_command
from ..schedules.ir import ScheduleError
from .guard import gpu_loads, imbalance
from .placement import as_plan, replica_counts
from .planner import rebalance_experts
from .stats import LoadStats, read_stats_file


class EplbError(ValueError):
    """Bad stats file or plan sizes."""


@dataclass(frozen=True)
class StatsFile:
    """A stats file whose tables have been checked against its sizes."""

    path: str
    stats: LoadStats
    obj: dict[str, Any]
    load: torch.Tensor  # [layers, experts] moving average
    placement: torch.Tensor | None  # [layers, slots] physical -> logical expert
    ep_size: int | None

    def header(self) -> str:
        return (f"{self.path}: iteration {self.obj.get('iteration')}, window {self.stats.window} "
                f"({len(self.stats.history)} iterations recorded), {len(self.stats.layers)} MoE "
                f"layers x {self.stats.num_experts} experts, ep_size {self.ep_size}")


def _table(value: Any, dtype: torch.dtype, what: str) -> torch.Tensor:
    try:
        return torch.tensor(value, dtype=dtype)
    except (TypeError, ValueError, RuntimeError):
        raise EplbError(f"{what} is not a table of numbers") from None


def read(path: str) -> StatsFile:
    """Read ``path`` and check that ``load`` and ``placement`` fit its layers and experts."""
    try:
        stats, obj = read_stats_file(path)
    except OSError as exc:
        raise EplbError(f"cannot read {path}: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise EplbError(f"{path} is not JSON: {exc}") from None
    except KeyError as exc:
        raise EplbError(f"{path}: missing key {exc}") from None
    except (TypeError, ValueError) as exc:
        raise EplbError(f"{path}: {exc}") from None
    if stats.empty:
        raise EplbError(f"{path}: empty history (no iteration recorded yet)")
    layers, experts = len(stats.layers), stats.num_experts
    load = _table(obj.get("load"), torch.float64, f"{path}: load")
    if tuple(load.shape) != (layers, experts):
        raise EplbError(f"{path}: load has shape {list(load.shape)}, expected "
                        f"[layers, num_experts] = [{layers}, {experts}]")
    placement = obj.get("placement")
    if placement is not None:
        placement = _table(placement, torch.int64, f"{path}: placement")
        if placement.dim() != 2 or placement.size(0) != layers:
            raise EplbError(f"{path}: placement has shape {list(placement.shape)}, expected "
                            f"[layers = {layers}, slots]")
        if placement.numel() and not 0 <= int(placement.min()) <= int(placement.max()) < experts:
            raise EplbError(f"{path}: placement holds an expert id outside 0..{experts - 1}")
        if bool((replica_counts(placement, experts) == 0).any()):
            raise EplbError(f"{path}: placement leaves an expert without a slot")
    ep_size = obj.get("ep_size")
    if ep_size is not None:
        slots = experts if placement is None else placement.size(1)
        if not isinstance(ep_size, int) or ep_size < 1 or slots % ep_size:
            raise EplbError(f"{path}: ep_size {ep_size!r} must be a positive divisor of the "
                            f"{slots} slots per layer")
    return StatsFile(path, stats, obj, load, placement, ep_size)


def _current(f: StatsFile, slots: int) -> tuple[torch.Tensor | None, str]:
    """The placement in use with ``slots`` slots per layer, and where it comes from."""
    if f.placement is not None and f.placement.size(1) == slots:
        return f.placement, "the file's placement"
    if slots == f.stats.num_experts:
        identity = torch.arange(slots, dtype=torch.int64).expand(len(f.stats.layers), slots)
        return identity, "identity (expert e in slot e)"
    return None, f"n/a (no placement with {slots} slots)"


def _ratio(row: torch.Tensor) -> float:
    """max / mean, 1.0 when nothing was routed (as :func:`imbalance`)."""
    mean = float(row.mean())
    return float(row.max()) / mean if mean > 0 else 1.0


def _loads(row: torch.Tensor) -> str:
    return " ".join(f"{v:.1f}" for v in row.tolist()) + f" (max/mean {_ratio(row):.3f})"


def _write_json(path: str, doc: object) -> None:
    try:
        Path(path).write_text(json.dumps(doc) + "\n")
    except OSError as exc:
        raise EplbError(f"cannot write {path}: {exc.strerror or exc}") from None


def _gpu_lines(slots: list[list[int]], groups: int, nodes: int, experts: int) -> list[str]:
    """The placement GPU by GPU; under the hierarchical policy over several nodes, one line per
    node naming the expert groups it holds (each group's experts stay on one node)."""
    def gpus(first: int, rows: list[list[int]]) -> str:
        return " | ".join(f"GPU {first + g}: " + " ".join(map(str, s)) for g, s in enumerate(rows))

    if nodes == 1 or groups % nodes:
        return [gpus(0, slots)]
    per_node, group_size = len(slots) // nodes, experts // groups
    lines = []
    for n in range(nodes):
        rows = slots[n * per_node:(n + 1) * per_node]
        held = sorted({e // group_size for row in rows for e in row})
        lines.append(f"node {n} (groups {' '.join(map(str, held))}): " + gpus(n * per_node, rows))
    return lines


def cmd_plan(args: argparse.Namespace) -> None:
    f = read(args.stats)
    try:
        plan = rebalance_experts(f.load, args.replicas, args.groups, args.nodes, args.gpus)
    except ValueError as exc:
        raise EplbError(str(exc)) from None
    phy2log, log2phy, logcnt = plan
    experts = f.stats.num_experts
    current, source = _current(f, args.replicas)
    after = gpu_loads(plan, f.load, args.gpus)
    before = None if current is None else gpu_loads(as_plan(current, experts), f.load, args.gpus)
    policy = "hierarchical" if args.groups % args.nodes == 0 else "global (nodes do not divide groups)"
    print(f.header())
    print(f"plan: replicas {args.replicas}, groups {args.groups}, nodes {args.nodes}, "
          f"GPUs {args.gpus}, {policy} policy; before = {source}")
    per_gpu = args.replicas // args.gpus
    for i, layer in enumerate(f.stats.layers):
        print(f"layer {layer}:")
        slots = phy2log[i].view(args.gpus, per_gpu).tolist()
        for line in _gpu_lines(slots, args.groups, args.nodes, experts):
            print("  " + line)
        extra = [f"expert {e} x{n}" for e, n in enumerate(logcnt[i].tolist()) if n > 1]
        print("  replicas: " + (", ".join(extra) if extra else "one per expert"))
        print("  GPU load before: " + ("n/a" if before is None else _loads(before[i])))
        print("  GPU load after:  " + _loads(after[i]))
    imb_before = None if current is None else imbalance(as_plan(current, experts), f.load, args.gpus)
    imb_after = imbalance(plan, f.load, args.gpus)
    print("step max/mean GPU load (sum of layer maxima / sum of layer means): "
          f"{'n/a' if imb_before is None else f'{imb_before:.3f}'} -> {imb_after:.3f}")
    if args.json:
        _write_json(args.json, {
            "stats": f.path, "iteration": f.obj.get("iteration"), "layers": f.stats.layers,
            "num_replicas": args.replicas, "num_groups": args.groups, "num_nodes": args.nodes,
            "num_gpus": args.gpus, "phy2log": phy2log.tolist(), "log2phy": log2phy.tolist(),
            "logcnt": logcnt.tolist(), "before": source if current is not None else None,
            "gpu_load_before": None if before is None else before.tolist(),
            "gpu_load_after": after.tolist(),
            "imbalance_before": imb_before, "imbalance_after": imb_after,
        })


def cmd_stats(args: argparse.Namespace) -> None:
    f = read(args.file)
    current, source = _current(f, f.stats.num_experts if f.placement is None else f.placement.size(1))
    print(f.header())
    if f.ep_size is not None:
        print(f"EP ranks: {f.ep_size}, placement: {source}")
    assert current is not None  # the file's placement, else the identity
    plan = as_plan(current, f.stats.num_experts)
    ranks = None if f.ep_size is None else gpu_loads(plan, f.load, f.ep_size)
    for i, layer in enumerate(f.stats.layers):
        row = f.load[i]
        total = float(row.sum())
        hot = sorted(range(row.numel()), key=lambda e: -float(row[e]))[:3]
        shares = ", ".join(f"{e} ({float(row[e]) / total:.1%})" if total > 0 else f"{e} (-)"
                           for e in hot)
        line = (f"layer {layer}: {total:.1f} routed tokens/iteration; hottest experts {shares}; "
                f"max/mean over experts {_ratio(row):.3f}")
        if ranks is not None:
            line += f"; max/mean over EP ranks {_ratio(ranks[i]):.3f}"
        print(line)
    if ranks is not None:
        print(f"step max/mean over EP ranks: {imbalance(plan, f.load, f.ep_size):.3f}")


def make_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="python -m dualpipe_megatron.eplb", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)

    p = sub.add_parser("plan", help="rebalance the experts of a stats file's load; loads before/after")
    p.add_argument("--stats", required=True, metavar="FILE", help="EPLB stats JSON (its `load` is planned)")
    p.add_argument("--replicas", type=positive_int, required=True,
                   help="physical expert slots per layer (>= experts)")
    p.add_argument("--groups", type=positive_int, required=True, help="expert groups")
    p.add_argument("--nodes", type=positive_int, required=True, help="nodes")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs (EP ranks) over all nodes")
    p.add_argument("--json", metavar="OUT", help="also write the plan and loads as JSON")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("stats", help="per-layer summary of a stats file")
    p.add_argument("file", metavar="FILE", help="EPLB stats JSON")
    p.set_defaults(func=cmd_stats)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(make_parser(), argv, (EplbError, ScheduleError))


if __name__ == "__main__":
    raise SystemExit(main())
