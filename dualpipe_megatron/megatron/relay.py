"""Loss reports relayed to the last pipeline rank, where Megatron's ``train_step`` reads them.

Megatron's reports are dicts of tensors (``{'lm loss': tensor([loss, tokens])}``) whose
keys, shapes and dtypes stay the same from step to step. The sending rank therefore
broadcasts that layout once, with ``broadcast_object_list``, and afterwards only the
tensors, one flat tensor per dtype. Every step starts with a one-element header saying
which follows: the cached layout's tensors, a new layout and its tensors, or (reports
that are not dicts of tensors) the pickled reports as before. The caller holds the cache
of layouts sent, one per key (e.g. per direction and program); the sending and the
receiving ranks update theirs alike, from the header.
"""

from __future__ import annotations

from math import prod
from typing import Any

import torch
import torch.distributed as dist

# A report layout: per report, its (key, dtype, shape) entries in order.
Layout = tuple[tuple[tuple[Any, torch.dtype, tuple[int, ...]], ...], ...]
_CACHED, _NEW, _PICKLED = 0, 1, 2  # header values


def layout_of(reports: list) -> Layout | None:
    """The layout of ``reports``, or None unless every report is a dict of tensors."""
    layout = []
    for report in reports:
        if not isinstance(report, dict) or not all(isinstance(v, torch.Tensor) for v in report.values()):
            return None
        layout.append(tuple((k, v.dtype, tuple(v.shape)) for k, v in report.items()))
    return tuple(layout)


def _dtypes(layout: Layout) -> list[torch.dtype]:
    """The dtypes of ``layout`` in first-use order: one flat tensor each."""
    return list(dict.fromkeys(dtype for report in layout for _, dtype, _ in report))


def _flat(reports: list, layout: Layout) -> list[torch.Tensor]:
    return [torch.cat([v.reshape(-1) for r in reports for v in r.values() if v.dtype == dtype])
            for dtype in _dtypes(layout)]


def _unflat(flats: list[torch.Tensor], layout: Layout) -> list[dict]:
    offsets = {dtype: 0 for dtype in _dtypes(layout)}
    by_dtype = dict(zip(offsets, flats))
    reports = []
    for entries in layout:
        report = {}
        for key, dtype, shape in entries:
            n, start = prod(shape), offsets[dtype]
            report[key] = by_dtype[dtype][start:start + n].view(shape).clone()
            offsets[dtype] = start + n
        reports.append(report)
    return reports


def relay(reports: list | None, src: int, group: dist.ProcessGroup, cache: dict[Any, Layout], key: Any,
          device: torch.device) -> list | None:
    """Collective over ``group``: ``reports`` of group rank ``src`` on every rank (``None`` is
    passed elsewhere); ``cache[key]`` is the layout sent last under ``key``."""
    source = dist.get_global_rank(group, src)
    sending = group.rank() == src
    header = torch.zeros(1, dtype=torch.int64, device=device)
    layout = None
    if sending:
        layout = layout_of(reports)
        header[0] = _PICKLED if layout is None else _CACHED if cache.get(key) == layout else _NEW
    dist.broadcast(header, src=source, group=group)
    kind = int(header[0])
    if kind == _PICKLED:
        box = [reports]
        dist.broadcast_object_list(box, src=source, group=group)
        return box[0]
    if kind == _NEW:
        box = [layout]
        dist.broadcast_object_list(box, src=source, group=group)
        cache[key] = box[0]
    layout = cache[key]
    if sending:
        flats = _flat(reports, layout)
    else:
        sizes = {dtype: 0 for dtype in _dtypes(layout)}
        for entries in layout:
            for _, dtype, shape in entries:
                sizes[dtype] += prod(shape)
        flats = [torch.empty(n, dtype=dtype, device=device) for dtype, n in sizes.items()]
    for flat in flats:
        dist.broadcast(flat, src=source, group=group)
    return reports if sending else _unflat(flats, layout)


__all__ = ["Layout", "layout_of", "relay"]
