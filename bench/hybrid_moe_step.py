"""What running HybridModel's MoE F&B pairs as F then B costs the step (CPU, gloo).

Megatron-Core's schedule plans split GPTModel layers only, so under our schedules a HybridModel's
MoE F&B pairs run F then B (with a notice), while a GPTModel's run layer by layer through the plans.
This runs bench_megatron.py's MoE configuration (8 layers, hidden 256, 4 heads, sequence 128, 2
sequences per micro-batch, vocabulary 1024, 4 experts of FFN 512, top-2, EP=2 x P=2, M=8) as whole
training jobs through ``scripts/pretrain_gpt.py``, as the GPTModel and as the equivalent HybridModel
(``*E`` repeated, local hybrid spec), under Megatron's 1F1B and DualPipeV (GPT also with
``--no-dualpipe-moe-overlap``), and reads Megatron's own "elapsed time per iteration" (median of
iterations 3 and on). On CPU the streams are stand-ins and the plans run in program order, so the
overlap hides nothing here: the figures say what each path costs, and ratios to the same model's
1F1B are what compare. Writes ``bench/results/hybrid_moe_step.json``.

Run: ``.venv/bin/python bench/hybrid_moe_step.py [--iterations 6]``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ports import free_port

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results" / "hybrid_moe_step.json"
sys.path.insert(0, str(REPO))

from dualpipe_megatron.megatron.cpu_compat import CPU_FLAGS  # noqa: E402

SHAPE = ("--hidden-size 256 --num-attention-heads 4 --seq-length 128 --max-position-embeddings 128 "
         "--vocab-size 1024 --hidden-dropout 0 --attention-dropout 0 --position-embedding-type rope "
         "--num-experts 4 --moe-ffn-hidden-size 512 --moe-router-topk 2 --moe-token-dispatcher-type alltoall "
         "--disable-bias-linear --micro-batch-size 2 --global-batch-size 32").split()
PARALLEL = "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2".split()
DATA = ("--mock-data --tokenizer-type NullTokenizer --seed 1234 --log-interval 1 --eval-interval 1000 "
        "--eval-iters 0 --lr 1e-4").split()
GPT = ["--num-layers", "8"]
HYBRID = ["--spec", "dualpipe_megatron.megatron.local_specs", "hybrid_stack_spec", "--hybrid-layer-pattern", "*E" * 8]
VARIANTS = {
    "gpt 1f1b": [*GPT, "--pipeline-schedule", "1f1b"],
    "gpt dualpipev (F&B overlap)": [*GPT, "--pipeline-schedule", "dualpipev"],
    "gpt dualpipev (F then B)": [*GPT, "--pipeline-schedule", "dualpipev", "--no-dualpipe-moe-overlap"],
    "hybrid 1f1b": [*HYBRID, "--pipeline-schedule", "1f1b"],
    "hybrid dualpipev (F then B)": [*HYBRID, "--pipeline-schedule", "dualpipev"],
}
ELAPSED = re.compile(r"iteration\s+(\d+)/\s*\d+ \| .*?elapsed time per iteration \(ms\): ([0-9.]+)")


def step_ms(args: list[str], iterations: int, log: Path) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=4", f"--master-port={free_port()}",
           str(REPO / "scripts" / "pretrain_gpt.py"), *SHAPE, *PARALLEL, *DATA, *CPU_FLAGS,
           "--train-iters", str(iterations), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DUALPIPE_MOCK_DOCUMENTS": "256", "PYTHONPATH": str(REPO)}
    with log.open("w") as f:
        subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, check=True, timeout=1200)
    times = [float(ms) for it, ms in ELAPSED.findall(log.read_text()) if int(it) >= 3]
    if not times:
        raise RuntimeError(f"no iteration times in {log}")
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterations", type=int, default=6)
    parser.add_argument("--output", type=Path, default=RESULTS)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        ms = {}
        for name, variant in VARIANTS.items():
            ms[name] = step_ms(variant, args.iterations, Path(logs) / f"{name.split()[0]}_{len(ms)}.log")
            print(f"{name:30s} {ms[name]:8.0f} ms per iteration", flush=True)
    ratios = {"gpt dualpipev (F&B overlap) / gpt 1f1b": ms["gpt dualpipev (F&B overlap)"] / ms["gpt 1f1b"],
              "gpt dualpipev (F then B) / gpt 1f1b": ms["gpt dualpipev (F then B)"] / ms["gpt 1f1b"],
              "hybrid dualpipev (F then B) / hybrid 1f1b": ms["hybrid dualpipev (F then B)"] / ms["hybrid 1f1b"],
              "hybrid 1f1b / gpt 1f1b": ms["hybrid 1f1b"] / ms["gpt 1f1b"]}
    for name, ratio in ratios.items():
        print(f"{name:45s} {ratio:.3f}")
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps({"iterations": args.iterations, "median_ms": ms, "ratios": ratios},
                                      indent=1) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
