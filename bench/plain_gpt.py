"""A plain-``nn.Module`` GPT with the benchmark's shapes, under torch's ``ScheduleDualPipeV``
and under our native ``Pipeline(..., "dualpipev")``, as benchmark variants.

torch's schedule cannot run Megatron modules, so this pair compares the two DualPipeV
runtimes on equal ground: the same stage modules and weights (copies of one seeded model),
the same micro-batches and the same placement (rank r holds stages r and 2P-1-r). The
blocks follow Megatron's local layer spec: pre-norm attention (unfused softmax) and GELU MLP,
learned positions, untied output layer.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from busy_time import ComputeClock, time_torch_compute
from megatron_gpt import GPTShape
from variant import Variant, all_params

PLAIN_SCHEDULES = ("torch_dualpipev", "plain_dualpipev")


class Block(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.qkv, self.proj = nn.Linear(hidden, 3 * hidden), nn.Linear(hidden, hidden)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2) / math.sqrt(h // self.heads)
        causal = torch.ones(s, s, dtype=torch.bool).triu(1)
        attn = scores.masked_fill(causal, float("-inf")).softmax(-1) @ v
        x = x + self.proj(attn.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Stage(nn.Module):
    """Model stage ``index`` of ``count``: the first embeds tokens, the last returns logits."""

    def __init__(self, shape: GPTShape, index: int, count: int) -> None:
        super().__init__()
        first, last = index == 0, index == count - 1
        self.embed = nn.Embedding(shape.vocab, shape.hidden) if first else None
        self.pos = nn.Embedding(shape.seq, shape.hidden) if first else None
        self.blocks = nn.ModuleList(Block(shape.hidden, shape.heads) for _ in range(shape.layers // count))
        self.head = nn.Sequential(nn.LayerNorm(shape.hidden), nn.Linear(shape.hidden, shape.vocab, bias=False)) \
            if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x) + self.pos.weight[: x.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(x) if self.head is not None else x


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten())


def build(shape: GPTShape, pp: int, m: int, trace_root: Path) -> list[Variant]:
    """torch's ScheduleDualPipeV and our Pipeline on copies of one seeded model."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import ScheduleDualPipeV

    from dualpipe_megatron.runtime import Pipeline
    from dualpipe_megatron.trace import OpTracer

    if shape.layers % (2 * pp):
        raise ValueError(f"plain DualPipeV: {shape.layers} layers do not split into {2 * pp} stages")
    rank, stages = dist.get_rank(), 2 * pp
    torch.manual_seed(0)
    model = [Stage(shape, s, stages) for s in range(stages)]
    held = (rank, stages - 1 - rank)
    gen = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, shape.vocab, (m * shape.micro_batch, shape.seq + 1), generator=gen)
    inputs, labels = tokens[:, :-1], tokens[:, 1:]

    theirs = [copy.deepcopy(model[s]) for s in held]
    pipe_stages = [PipelineStage(mod, s, stages, torch.device("cpu")) for mod, s in zip(theirs, held)]
    schedule = ScheduleDualPipeV(pipe_stages, m, loss_fn=_loss, scale_grads=False)
    clock = ComputeClock()
    time_torch_compute(clock, schedule, pipe_stages)

    def run_torch() -> None:
        if rank == 0:
            schedule.step(inputs, target=labels, losses=[])
        else:
            schedule.step()

    trace_dir = trace_root / "plain_dualpipev"
    ours = Pipeline([copy.deepcopy(model[s]) for s in held], "dualpipev",
                    p2p_shapes=[(shape.micro_batch, shape.seq, shape.hidden)], p2p_dtype=torch.float32,
                    observer=OpTracer.for_group(trace_dir))

    def run_ours() -> None:
        ours.step(*([inputs] if rank == 0 else []), num_microbatches=m, criterion=_loss,
                  labels=[labels] if rank == 0 else [])

    return [Variant("torch_dualpipev", run_torch, all_params(theirs), clock=clock),
            Variant("plain_dualpipev", run_ours, all_params(ours.module), trace_dir=trace_dir)]
