"""The launch plan's activation estimate against the activation meter, rank by rank (issue 45).

Each case is one real pretraining job on this CPU (``bench/metered_pretrain.py``: our
``scripts/pretrain_gpt.py`` with every step under the activation meter, gloo, mock data): a
dense GPT (bf16, P=2) and the DeepSeek-V3 proxy (``scripts/deepseek_v3_proxy.flags`` without
EPLB: MLA, MoE with a shared expert, MTP; fp32, EP=2 x P=2), under Megatron's 1F1B and
interleaved 1F1B and our DualPipe and DualPipeV, with each recompute option that runs on a CPU.
The estimate is :mod:`dualpipe_megatron.plan`'s for the very same arguments
(``plan.memory.activation_peaks`` of the job's op order over
``plan.memory.stage_activations``). Measured: the peak saved bytes of the job's last step on
each rank; where several ranks share a pipeline rank (expert or data parallel) their mean,
since the estimate assumes balanced routing (their max is in the JSON).

Prints a markdown table and writes ``bench/results/activation_estimate.json``; exits non-zero
when a rank's estimate is more than ``--tolerance`` (default 10%) off.

Run: ``.venv/bin/python bench/activation_estimate.py [--only NAME ...]`` (~13 min here).
``--from-dir DIR --world N -- ARGS`` instead reads a metered job's files (scripts/gpu_check.sh's
``activation_memory`` section, on a GPU) and prints each rank's meter peak, CUDA peak and the
plan's estimate for ARGS.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dualpipe_megatron.demo import run_logged  # noqa: E402
from dualpipe_megatron.megatron.cpu_compat import CPU_FLAGS  # noqa: E402

RESULTS = REPO / "bench" / "results" / "activation_estimate.json"
ENTRY = REPO / "bench" / "metered_pretrain.py"
MIB = 2**20

DENSE = ("--num-layers 8 --hidden-size 64 --ffn-hidden-size 160 --num-attention-heads 4 --seq-length 64 "
         "--max-position-embeddings 64 --vocab-size 256 --normalization RMSNorm --swiglu --disable-bias-linear "
         "--position-embedding-type rope --untie-embeddings-and-output-weights --hidden-dropout 0 "
         "--attention-dropout 0 --bf16 --pipeline-model-parallel-size 2").split()
DATA = ("--mock-data --tokenizer-type NullTokenizer --micro-batch-size 2 --global-batch-size 16 --train-iters 2 "
        "--lr 1e-4 --seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0").split()
SCHEDULES = {"1f1b": ["--pipeline-schedule", "1f1b"],
             "interleaved": ["--pipeline-schedule", "interleaved", "--num-virtual-stages-per-pipeline-rank", "2"],
             "dualpipe": ["--pipeline-schedule", "dualpipe"], "dualpipev": ["--pipeline-schedule", "dualpipev"]}
SELECTIVE = ["--recompute-granularity", "selective", "--recompute-modules"]
FULL_UNIFORM = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1".split()
FULL_BLOCK = "--recompute-granularity full --recompute-method block --recompute-num-layers 1".split()
RECOMPUTE = {
    "dense": {"none": [], "core_attn": [*SELECTIVE, "core_attn"], "layernorm": [*SELECTIVE, "layernorm"],
              "mlp": [*SELECTIVE, "mlp"], "full uniform 1": FULL_UNIFORM, "full block 1": FULL_BLOCK},
    "proxy": {"none": [], "mla_up_proj layernorm": [*SELECTIVE, "mla_up_proj", "layernorm"],
              "moe": [*SELECTIVE, "moe"], "shared_experts": [*SELECTIVE, "shared_experts"],
              "full uniform 1": FULL_UNIFORM},
}


def proxy_flags() -> list[str]:
    """The proxy's flags file without its EPLB lines (placement moves no activation bytes)."""
    out: list[str] = []
    for line in (REPO / "scripts" / "deepseek_v3_proxy.flags").read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words and not words[0].startswith("--eplb"):
            out += words
    return out


@dataclass(frozen=True)
class Case:
    model: str  # "dense" | "proxy"
    schedule: str
    recompute: str

    @property
    def name(self) -> str:
        return f"{self.model}/{self.schedule}/{self.recompute.replace(' ', '-')}"

    @property
    def processes(self) -> int:
        return 2 if self.model == "dense" else 4

    def arguments(self) -> list[str]:
        model = DENSE if self.model == "dense" else proxy_flags()
        return [*model, *SCHEDULES[self.schedule], *RECOMPUTE[self.model][self.recompute], *DATA]


CASES = [Case(model, schedule, recompute) for model in RECOMPUTE for recompute in RECOMPUTE[model]
         for schedule in SCHEDULES]


def measured(case: Case, work: Path) -> tuple[list[float], list[float]]:
    """Run the job metered; per pipeline rank the mean and the max over the ranks sharing it of
    each rank's last-step peak."""
    out = work / case.name.replace("/", "_")
    torchrun = Path(sys.executable).with_name("torchrun")
    cmd = [str(torchrun), "--standalone", f"--nproc-per-node={case.processes}", str(ENTRY), *case.arguments(),
           *CPU_FLAGS]
    os.environ["DUALPIPE_METER_DIR"] = str(out)
    os.environ["DUALPIPE_MOCK_DOCUMENTS"] = "64"
    log = work / f"{case.name.replace('/', '_')}.log"
    if run_logged(cmd, log, echo=False) != 0:
        raise SystemExit(f"{case.name}: training failed; log:\n{log.read_text(errors='replace')[-4000:]}")
    by_stage: dict[int, list[int]] = {}
    for path in sorted(out.glob("rank*.json")):
        record = json.loads(path.read_text())
        by_stage.setdefault(record["pp_rank"], []).append(record["peaks"][-1])
    ranks = sorted(by_stage)
    return [mean(by_stage[r]) for r in ranks], [max(by_stage[r]) for r in ranks]


def estimated(case: Case) -> list[float]:
    """The launch plan's per-rank activation peaks for the same arguments."""
    return estimate_for([*case.arguments(), *CPU_FLAGS], case.processes)


def estimate_for(argv: list[str], world: int) -> list[float]:
    """The launch plan's per-rank activation peaks for a job's arguments."""
    from dualpipe_megatron.plan.memory import activation_peaks, overlapped_pairs, stage_activations
    from dualpipe_megatron.plan.job import check, job_schedule, parse
    from dualpipe_megatron.megatron.auto_layout import microbatches

    checked = check(parse(argv, world))
    sched, stage_layers = job_schedule(checked, microbatches(checked.args))
    return activation_peaks(sched, stage_activations(checked.args, stage_layers),
                            overlapped_pairs(checked.args, checked.args.pipeline_schedule))


def from_dir(out: Path, argv: list[str], world: int) -> None:
    """Each pipeline rank's last-step meter and CUDA peaks (mean over the ranks sharing it) against
    the estimate for ``argv``."""
    records = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if not records:
        raise SystemExit(f"no rank*.json in {out}: the metered job did not run a step")
    print("| rank | meter (MiB) | CUDA peak over the step's start (MiB) | estimate (MiB) | estimate / meter |"
          " estimate / CUDA |\n| --- | --- | --- | --- | --- | --- |")
    for rank, want in enumerate(estimate_for(argv, world)):
        mine = [r for r in records if r["pp_rank"] == rank]
        meter = mean(r["peaks"][-1] for r in mine)
        cuda = mean(r["cuda_peaks"][-1] for r in mine) if all(r.get("cuda_peaks") for r in mine) else None
        print(f"| {rank} | {meter / MIB:.2f} | {'-' if cuda is None else f'{cuda / MIB:.2f}'} | {want / MIB:.2f} | "
              f"{want / meter:.3f} | {'-' if cuda is None else f'{want / cuda:.3f}'} |")


def table(rows: list[dict]) -> str:
    lines = ["| model | schedule | recompute | rank | measured (MiB) | estimate (MiB) | estimate / measured |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['schedule']} | {r['recompute']} | {r['rank']} | "
                     f"{r['measured'] / MIB:.2f} | {r['estimate'] / MIB:.2f} | {r['ratio']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="case names (model/schedule/recompute) or prefixes")
    parser.add_argument("--tolerance", type=float, default=0.10)
    parser.add_argument("--json", type=Path, default=RESULTS)
    parser.add_argument("--from-dir", type=Path, default=None, help="a metered job's DUALPIPE_METER_DIR")
    parser.add_argument("--world", type=int, default=2, help="with --from-dir: the job's processes")
    parser.add_argument("job", nargs="*", help="with --from-dir: -- and the job's arguments")
    ns = parser.parse_args()
    if ns.from_dir is not None:
        from_dir(ns.from_dir, ns.job, ns.world)
        return
    cases = [c for c in CASES if ns.only is None or any(c.name.startswith(o) for o in ns.only)]
    rows = []
    with tempfile.TemporaryDirectory(prefix="activation_estimate_") as tmp:
        for case in cases:
            means, maxima = measured(case, Path(tmp))
            for rank, (got, most, want) in enumerate(zip(means, maxima, estimated(case))):
                rows.append({"model": case.model, "schedule": case.schedule, "recompute": case.recompute,
                             "rank": rank, "measured": got, "measured_max": most, "estimate": want,
                             "ratio": want / got})
            print(table(rows[-len(means):]).split("\n", 2)[-1], flush=True)
    print(table(rows))
    off = [r for r in rows if abs(r["ratio"] - 1) > ns.tolerance]
    ns.json.parent.mkdir(parents=True, exist_ok=True)
    ns.json.write_text(json.dumps({"date": datetime.date.today().isoformat(), "machine": platform.processor(),
                                   "tolerance": ns.tolerance, "rows": rows}, indent=1))
    print(f"{len(rows) - len(off)} of {len(rows)} ranks within {ns.tolerance:.0%}; wrote {ns.json}")
    if off:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
