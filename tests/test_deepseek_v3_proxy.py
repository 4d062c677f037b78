"""The DeepSeek-V3 proxy (``scripts/deepseek_v3_proxy.flags``) under DualPipeV and DualPipe equals
Megatron's 1F1B on the same model (4 CPU processes: EP=2 x P=2, gloo, mock data).

The proxy has DeepSeek-V3's structure at tiny sizes: MLA with q/kv LoRA and a decoupled rotary
part, a dense first layer then MoE layers with one shared expert and 8 routed experts top-2,
sigmoid scores with aux-loss-free expert bias (update rate 0.05, so the bias moves), group-limited
routing (4 groups, a token in at most 2), top-k scaling 2.5, a sequence-wise aux loss, fp32
routing, MTP depth 1, and EPLB re-placing experts every 2 iterations with DeepSeek's hierarchical
policy over two simulated nodes (2 groups per node; each placement keeps a group on one node,
checked against the planner in tests/test_eplb_training.py). Every run starts from one checkpoint written at PP=1 x EP=2 with learning rate 0
and trains 8 iterations (M=8 micro-batches), with the F&B overlap on. Compared per iteration:
``lm loss`` and ``mtp_1 loss`` (relative 1e-5: the MoE combine and DualPipe's mirror sums add in
another order) and the grad norm (relative 1e-4: a sum of squares over all parameters).

- ``DUALPIPE_CHECK_EXPERT_BIAS=1``: after every step, each router's ``expert_bias`` is compared
  bitwise with its DualPipe mirror copy (the run fails on a difference; the test counts the checks).
- Selective recompute of the cheap parts, output-discarding (``--recompute-modules mla_up_proj
  layernorm``), under all three schedules with aux loss 0 (pure aux-loss-free balancing) and two
  redundant experts per layer; the F&B overlap and the W split still run (the overlap's line counts
  the W ops' deferred weight-grad closures). ``moe_act`` needs grouped GEMM (Transformer Engine):
  Megatron refuses it without, so it is not run here.
- The same model without ``--multi-latent-attention`` (standard attention, same seed) logs a
  different first loss, so MLA really was built.
"""

from __future__ import annotations

import re
import subprocess
from typing import Any

import pytest

from launcher import LaunchFailed
from pretrain_runs import REPO, grad_norms, losses, run

pytestmark = pytest.mark.multiprocess

FLAGS_FILE = REPO / "scripts" / "deepseek_v3_proxy.flags"
SCRIPT = REPO / "scripts" / "pretrain_deepseek_v3_proxy.sh"
MLA_FLAGS = ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
             "--qk-pos-emb-head-dim", "--v-head-dim", "--qk-layernorm")
TRAIN = "--lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1".split()
ITERS = 8
RECOMPUTE = ["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "layernorm",
             "--moe-aux-loss-coeff", "0", "--eplb-redundant-experts", "2"]
SCHEDULES = ("1f1b", "dualpipev", "dualpipe")
LOSS_RTOL, NORM_RTOL = 1e-5, 1e-4
MTP = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?mtp_1 loss: ([0-9.E+-]+)")
BIAS_CHECKED = re.compile(r"^DualPipe expert-bias check: all (\d+) router copies equal", re.MULTILINE)
OVERLAP = re.compile(r"DualPipe MoE F&B overlap on: (\d+) of (\d+) FB ops.*?W ops ran (\d+) deferred")
MOVED = re.compile(r"^EPLB iteration (\d+): moved (\d+) expert", re.MULTILINE)
HIERARCHICAL = "EPLB placement: hierarchical policy: 4 expert groups over 2 node(s) of 1 EP rank(s)"


def proxy_flags(drop: tuple[str, ...] = ()) -> list[str]:
    """The flags file as arguments (one flag and its value per line, ``#`` comments), without the
    lines whose flag is in ``drop``."""
    args: list[str] = []
    for line in FLAGS_FILE.read_text().splitlines():
        words = line.split("#", 1)[0].split()
        if words and words[0] not in drop:
            args += words
    return args


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("deepseek_v3_proxy")
    first = ["--pipeline-model-parallel-size", "1", "--train-iters", "1", "--lr", "0", "--min-lr", "0",
             "--lr-decay-style", "constant", "--lr-warmup-iters", "0"]
    init = out / "init"
    got: dict[str, dict[str, Any]] = {}
    with pytest.MonkeyPatch.context() as env:
        env.setenv("DUALPIPE_CHECK_EXPERT_BIAS", "1")
        try:
            for name, args in (("init", [*proxy_flags(), "--save", str(init), "--save-interval", "1"]),
                               ("init_without_mla", proxy_flags(drop=MLA_FLAGS))):
                got[name] = {"loss": losses(run(name, out, 2, [*args, *first]))}
            start = [*proxy_flags(), "--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN,
                     "--train-iters", str(1 + ITERS)]
            for schedule in SCHEDULES:
                for name, extra in ((schedule, []), (f"{schedule}_recompute", RECOMPUTE)):
                    log = run(name, out, 4, [*start, "--pipeline-schedule", schedule, *extra])
                    got[name] = {"loss": losses(log), "grad_norm": grad_norms(log),
                                 "mtp": {int(i): float(v) for i, v in MTP.findall(log)},
                                 "bias_checks": [int(n) for n in BIAS_CHECKED.findall(log)],
                                 "overlap": OVERLAP.search(log), "moves": MOVED.findall(log),
                                 "hierarchical": HIERARCHICAL in log}
        except LaunchFailed as exc:
            pytest.fail(str(exc), pytrace=False)
    return got


def _same(ref: dict[int, float], got: dict[int, float], rtol: float, what: str) -> None:
    its = list(range(2, 2 + ITERS))
    assert [i for i in its if i not in ref or i not in got] == [], (what, sorted(ref), sorted(got))
    for i in its:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"{what}, iteration {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("variant", ["", "_recompute"])
@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_matches_1f1b(jobs: dict, schedule: str, variant: str) -> None:
    ref, got = jobs[f"1f1b{variant}"], jobs[f"{schedule}{variant}"]
    _same(ref["loss"], got["loss"], LOSS_RTOL, "lm loss")
    _same(ref["mtp"], got["mtp"], LOSS_RTOL, "mtp_1 loss")
    _same(ref["grad_norm"], got["grad_norm"], NORM_RTOL, "grad norm")


@pytest.mark.parametrize("variant", ["", "_recompute"])
def test_expert_bias_equal_in_both_copies_every_iteration(jobs: dict, variant: str) -> None:
    checks = jobs[f"dualpipe{variant}"]["bias_checks"]
    # 8 MoE routers (7 layers + MTP) per model copy, two copies on each of 2 pipeline x 2 EP ranks.
    assert checks == [32] * ITERS, checks


@pytest.mark.parametrize("variant", ["", "_recompute"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_experts_were_replaced_node_limited(jobs: dict, schedule: str, variant: str) -> None:
    moves = jobs[f"{schedule}{variant}"]["moves"]
    assert [it for it, _ in moves] == ["2", "4", "6", "8"] and sum(int(n) for _, n in moves) > 0, moves
    assert jobs[f"{schedule}{variant}"]["hierarchical"], f"no '{HIERARCHICAL}' line"


@pytest.mark.parametrize("variant", ["", "_recompute"])
@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_overlap_and_weight_grad_split_run(jobs: dict, schedule: str, variant: str) -> None:
    found = jobs[f"{schedule}{variant}"]["overlap"]
    assert found, "no F&B overlap line in the log"
    overlapped, fb_ops, deferred = (int(g) for g in found.groups())
    assert overlapped == fb_ops > 0 and deferred > 0, found.group(0)


def test_mla_was_built(jobs: dict) -> None:
    assert jobs["init"]["loss"][1] != jobs["init_without_mla"]["loss"][1]


def test_script_passes_every_proxy_flag() -> None:
    printed = subprocess.run(["bash", str(SCRIPT)], env={"DRY_RUN": "1", "PATH": "/usr/bin:/bin"},
                             capture_output=True, text=True, check=True).stdout
    args = printed.split()
    flags = proxy_flags()
    at = args.index(flags[0])
    assert [a.replace("\\", "") for a in args[at:at + len(flags)]] == flags
    assert args[args.index("--pipeline-schedule") + 1] == "dualpipev"
