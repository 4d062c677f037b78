"""Megatron's indexed datasets and fp16/bf16 under ``--pipeline-schedule`` (2 CPU processes, gloo).

The corpora are written in the test with Megatron's own ``IndexedDatasetBuilder`` (random token
ids, documents of varied length). All runs start from one PP=1 checkpoint and train iterations
2..6 at P=2, evaluating every 2 iterations and on the validation and test splits at the end:

- fp16 with dynamic loss scaling on one ``--data-path`` with ``--split``: the initial loss scale
  is too large for fp16 gradients, so the first iterations overflow, are skipped and halve the
  scale; with a window of 2 it then doubles again. DualPipeV and DualPipe must skip the same
  iterations and log the same loss-scale sequence as Megatron's 1F1B.
- bf16 on a blend of two prefixes (weights 0.3 / 0.7) with ``--split``.

Training and validation ``lm loss`` equal 1F1B's to 1e-5 relative (the 7 printed digits): every
micro-batch is computed alike, only the fp32 gradient sums may run in another order (measured:
every printed digit equal, except fp16 DualPipe, which sums mirrored copies' gradients: within
3e-6). Loss scales and skipped-iteration counts must be equal exactly.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy
import pytest
import torch

from launcher import LaunchFailed
from pretrain_runs import TRAIN, eval_losses, init_checkpoint, logged, losses, run

pytestmark = pytest.mark.multiprocess

SCHEDULES = ("1f1b", "dualpipev", "dualpipe")
VOCAB = 64  # pretrain_runs.MODEL's --vocab-size
RTOL = 1e-5
INITIAL_SCALE = 2.0**20
COMMON = ["--pipeline-model-parallel-size", "2", "--train-iters", "6", "--split", "90,5,5",
          "--eval-iters", "1", "--eval-interval", "2"]
# No warmup: a skipped iteration does not advance the LR schedule, so the first trained
# iteration would otherwise run at learning rate 0.
FP16 = ["--fp16", "--initial-loss-scale", str(INITIAL_SCALE), "--hysteresis", "1",
        "--loss-scale-window", "2", "--lr-warmup-iters", "0"]
SKIPPED = "number of skipped iterations"
EVALUATED = ["2", "4", "6", "6 on test set", "6 on validation set"]
BLEND_BUILT = re.compile(r"(?:Build and save|Load) the BlendedDataset indices")


def write_corpus(prefix: Path, seed: int, documents: int = 400) -> None:
    """Random token ids in documents of 3..40 tokens, through Megatron's builder."""
    from megatron.core.datasets.indexed_dataset import DType, IndexedDatasetBuilder

    rng = numpy.random.default_rng(seed)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=DType.optimal_dtype(VOCAB))
    for _ in range(documents):
        builder.add_item(torch.from_numpy(rng.integers(0, VOCAB, int(rng.integers(3, 41)))))
        builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("data_precision")
    corpus_a, corpus_b = out / "corpus_a", out / "corpus_b"
    write_corpus(corpus_a, seed=1)
    write_corpus(corpus_b, seed=2)
    runs = {"fp16": [*FP16, "--data-path", str(corpus_a)],
            "bf16_blend": ["--bf16", "--data-path", "0.3", str(corpus_a), "0.7", str(corpus_b)]}
    got: dict[str, dict] = {}
    try:
        start = ["--load", str(init_checkpoint(out)), "--no-load-optim", "--no-load-rng", *TRAIN,
                 *COMMON, "--data-cache-path", str(out / "cache")]
        for kind, args in runs.items():
            for schedule in SCHEDULES:
                name = f"{kind}_{schedule}"
                log = run(name, out, 2, [*start, *args, "--pipeline-schedule", schedule],
                          mock_data=False)
                got[name] = {"loss": losses(log), "eval": eval_losses(log),
                             "scale": logged(log, "loss scale"), "skipped": logged(log, SKIPPED),
                             "blend": bool(BLEND_BUILT.search(log)),
                             "read": sorted(set(re.findall(r"_IndexReader from (\S+)\.idx", log)))}
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    got["prefixes"] = {"a": str(corpus_a), "b": str(corpus_b)}
    return got


def _same(ref: dict, got: dict) -> None:
    assert sorted(got) == sorted(ref), (sorted(ref), sorted(got))
    for key in ref:
        assert got[key] == pytest.approx(ref[key], rel=RTOL), f"{key}: {got[key]} vs {ref[key]}"


def test_fp16_reference_skips_overflowing_iterations(jobs: dict) -> None:
    """The scale starts too large: iteration 2 overflows, is skipped (no loss logged) and halves
    the scale; later iterations train (a loss is logged) and the scale grows back after 2 good
    ones."""
    ref = jobs["fp16_1f1b"]
    assert ref["skipped"][2] == 1 and ref["scale"][2] == INITIAL_SCALE / 2, ref
    assert 2 not in ref["loss"], ref["loss"]
    trained = [i for i, skipped in ref["skipped"].items() if skipped == 0]
    assert len(trained) >= 2 and all(ref["loss"][i] > 0 for i in trained), ref
    scales = [ref["scale"][i] for i in sorted(ref["scale"])]
    assert any(b == 2 * a for a, b in zip(scales, scales[1:])), scales
    assert sorted(ref["eval"]) == EVALUATED, ref["eval"]
    assert ref["read"] == [jobs["prefixes"]["a"]] and not ref["blend"]


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_fp16_matches_1f1b(jobs: dict, schedule: str) -> None:
    """Same skipped iterations and loss-scale sequence (exact), same losses (1e-5)."""
    ref, got = jobs["fp16_1f1b"], jobs[f"fp16_{schedule}"]
    assert got["skipped"] == ref["skipped"]
    assert got["scale"] == ref["scale"]
    _same(ref["loss"], got["loss"])
    _same(ref["eval"], got["eval"])


def test_bf16_blend_reference_reads_both_prefixes(jobs: dict) -> None:
    ref = jobs["bf16_blend_1f1b"]
    assert ref["blend"], "no BlendedDataset was built"
    assert ref["read"] == sorted(jobs["prefixes"].values())
    assert sorted(ref["loss"]) == [2, 3, 4, 5, 6] and ref["loss"][6] < ref["loss"][2], ref["loss"]
    assert sorted(ref["eval"]) == EVALUATED, ref["eval"]


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe"])
def test_bf16_blend_matches_1f1b(jobs: dict, schedule: str) -> None:
    ref, got = jobs["bf16_blend_1f1b"], jobs[f"bf16_blend_{schedule}"]
    assert got["blend"] and got["read"] == ref["read"]
    _same(ref["loss"], got["loss"])
    _same(ref["eval"], got["eval"])
