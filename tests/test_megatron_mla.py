"""Multi-latent attention (MLA) on CPU: our core attention for Megatron's local spec, and MLA
training through ``scripts/pretrain_gpt.py`` under DualPipeV and DualPipe equal to Megatron's 1F1B.

In this process (one gloo rank):
- the core attention (``mla_attention.py``) equals torch's scaled-dot-product attention with an
  explicit scale and a causal mask, outputs and input grads, with query-key heads (24) wider than
  value heads (16) and half the heads, as on one of two tensor-parallel ranks; its dropout draws
  from Megatron's tensor-parallel RNG tracker;
- MLA's own softmax scale (YaRN's mscale included) reaches it; without the CPU-compat ``mla``
  group Megatron's local spec fails to build MLA, and standard attention keeps Megatron's;
- the script's dense and MoE specs build MLA when asked;
- an MLA layer built from Megatron's arguments has the FLOPs the layout search's FLOP model
  (``auto_layout.model_shape``) gives it, counted by torch's FLOP counter as the projection's are
  (``test_auto_layout.py`` ties the projection's layer to the same model), and a ``w:false``
  backward defers the weight grads of MLA's q/kv down- and up-projections and output projection
  to ``W``, which then gives the full backward's grads.

Training (processes, mock data): a 4-layer MLA GPT (q-LoRA, kv-LoRA, decoupled RoPE, latent
norms) from one PP=1 checkpoint (learning rate 0) at P=2: DualPipeV's lm losses equal 1F1B's
printed digits (the same reduction order), DualPipe's to relative 1e-6 (mirrored copies summed in
another order), grad norms to relative 1e-4; Megatron's 1F1B at TP=2 (two heads split over two
ranks) equals it to relative 1e-5. The same model without ``--multi-latent-attention`` starts from
another loss: MLA was really built.
"""

from __future__ import annotations

import argparse
import math
import types
from collections.abc import Iterator

import pytest
import torch
import torch.nn.functional as F

from launcher import LaunchFailed
from pretrain_runs import CPU, MODEL, TRAIN, grad_norms, losses, run

pytestmark = pytest.mark.multiprocess

MLA = ("--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 "
       "--qk-pos-emb-head-dim 8 --v-head-dim 16 --qk-layernorm").split()
# Vocabulary padding to 64 at TP=1 and TP=2 alike: the padded rows enter the loss.
SHAPE = ("--num-layers 4 --position-embedding-type rope --untie-embeddings-and-output-weights "
         "--normalization RMSNorm --make-vocab-size-divisible-by 32").split()
ITERATIONS = 4  # after the initial one
# dualpipev: 1F1B's reduction order; dualpipe: mirrored copies summed in another order; tp2: the
# row-parallel outputs summed over two ranks.
LOSS_RTOL = {"dualpipev": 0.0, "dualpipe": 1e-6, "tp2": 1e-5}
NORM_RTOL = 1e-4
SCHEDULES = ("1f1b", "dualpipev", "dualpipe")
MLA_LINEARS = ("linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj",
               "linear_proj")


# --- in this process ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def megatron_world() -> Iterator[None]:
    """One gloo rank with Megatron's model parallelism and the CPU-compat layer; all undone after."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from dualpipe_megatron import patch_guard
    from dualpipe_megatron.megatron import cpu_compat, wgrad_megatron

    compat_before = cpu_compat.installed_groups()
    cpu_compat.install_cpu_compat(force=True)
    from megatron.core.tensor_parallel import layers

    deferral_before = patch_guard.is_patched(layers.LinearWithGradAccumulationAndAsyncCommunication, "backward")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    try:
        yield
    finally:
        tensor_parallel.get_cuda_rng_tracker().reset()
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
        if not deferral_before:
            wgrad_megatron.uninstall_linear_deferral()
        if not compat_before:
            cpu_compat.uninstall_cpu_compat()


def _megatron_args(extra: list[str]) -> argparse.Namespace:
    """Megatron's validated arguments of the test model (and ``extra``), as the script sees them."""
    from megatron.training.arguments import add_megatron_arguments, validate_args

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    args = parser.parse_args([*MODEL, *CPU, *SHAPE, "--micro-batch-size", "2", "--global-batch-size", "2",
                              *extra])
    args.rank, args.world_size = 0, 1
    validate_args(args, {})
    return args


def _config(args: argparse.Namespace):
    from megatron.training.argument_utils import core_transformer_config_from_args

    return core_transformer_config_from_args(args)


def _mla_layer(config):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.spec_utils import build_module

    spec = get_gpt_layer_local_spec(multi_latent_attention=True, qk_layernorm=True)
    return build_module(spec, config=config, layer_number=1)


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's attention on Megatron's [s, b, heads, dim] layout, back to [s, b, heads * v_dim]."""
    out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), is_causal=True,
                                         scale=scale)
    return out.permute(2, 0, 1, 3).flatten(2)


def test_core_attention_equals_torch_attention(megatron_world: None) -> None:
    from megatron.core import tensor_parallel
    from megatron.core.transformer.enums import AttnMaskType

    from dualpipe_megatron.megatron.mla_attention import MLADotProductAttention

    config = _config(_megatron_args(["--num-attention-heads", "4"]))
    two_ranks = types.SimpleNamespace(tp=types.SimpleNamespace(size=lambda: 2))  # 2 of 4 heads here
    scale = 0.37  # MLA passes its own
    core = MLADotProductAttention(config, 1, AttnMaskType.causal, "self", softmax_scale=scale, k_channels=24,
                                  v_channels=16, pg_collection=two_ranks)
    gen = torch.Generator().manual_seed(0)
    s, b = 8, 2
    shapes = {"q": (s, b, 2, 24), "k": (s, b, 2, 24), "v": (s, b, 2, 16)}
    inputs = {n: torch.randn(shape, generator=gen, requires_grad=True) for n, shape in shapes.items()}
    copies = {n: t.detach().clone().requires_grad_() for n, t in inputs.items()}
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1)  # True: masked

    ours = core(*inputs.values(), None)  # the mask training passes: Megatron's default causal one
    ref = _reference(*copies.values(), scale)
    assert ours.shape == (s, b, 2 * 16)
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(core(*inputs.values(), causal.view(1, 1, s, s)), ref, rtol=1e-6, atol=1e-6)
    grad = torch.randn(ours.shape, generator=gen)
    ours.backward(grad)
    ref.backward(grad)
    for name in inputs:
        torch.testing.assert_close(inputs[name].grad, copies[name].grad, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="expects 2 heads"):
        core(*(t.repeat(1, 1, 2, 1) for t in inputs.values()), None)

    dropping = MLADotProductAttention(config, 1, AttnMaskType.causal, "self", attention_dropout=0.5,
                                      softmax_scale=scale, k_channels=24, v_channels=16, pg_collection=two_ranks)
    with torch.no_grad():
        assert torch.equal(dropping.eval()(*inputs.values(), None), core(*inputs.values(), None))
        dropping.train()
        tracker, default = tensor_parallel.get_cuda_rng_tracker(), torch.get_rng_state()
        tracker_state = tracker.get_states()
        first = dropping(*inputs.values(), None)
        tracker.set_states(tracker_state)
        again = dropping(*inputs.values(), None)
    assert torch.equal(first, again) and not torch.allclose(first, ref), "dropout from the tracker's state"
    assert torch.equal(torch.get_rng_state(), default), "dropout must not draw from the default generator"


def test_mla_gets_its_softmax_scale_and_only_mla_is_replaced(megatron_world: None) -> None:
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.spec_utils import build_module

    from dualpipe_megatron.megatron import cpu_compat
    from dualpipe_megatron.megatron.mla_attention import MLADotProductAttention

    config = _config(_megatron_args([*MLA, "--rotary-scaling-factor", "40", "--mscale-all-dim", "1.0"]))
    attention = _mla_layer(config).self_attention
    mscale = 0.1 * math.log(40) + 1  # YaRN's, squared into MLA's scale
    assert isinstance(attention.core_attention, MLADotProductAttention)
    assert attention.core_attention.softmax_scale == attention.softmax_scale
    assert attention.softmax_scale == pytest.approx(mscale**2 / math.sqrt(16 + 8), rel=1e-12)
    standard = build_module(get_gpt_layer_local_spec(), config=_config(_megatron_args([])), layer_number=1)
    assert type(standard.self_attention.core_attention) is DotProductAttention

    groups = cpu_compat.installed_groups()
    cpu_compat.uninstall_cpu_compat()
    try:
        cpu_compat.install_cpu_compat([g for g in groups if g != "mla"], force=True)
        with pytest.raises(TypeError, match="unexpected keyword argument 'k_channels'"):
            _mla_layer(config)
    finally:
        cpu_compat.install_cpu_compat(groups, force=True)


def test_script_specs_build_mla_when_asked(megatron_world: None) -> None:
    """scripts/pretrain_gpt.py builds through Megatron's GPT model builder (a config container):
    the layer spec it gets follows --multi-latent-attention, dense and MoE, as
    Megatron-LM's own script would get it."""
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention
    from megatron.training.argument_utils import gpt_config_from_args
    from megatron.training.models.gpt import default_layer_spec

    moe = ["--num-experts", "2", "--moe-layer-freq", "[0,1,1,1]"]
    for extra in ([], moe):
        for asked in (False, True):
            args = _megatron_args([*MLA, *extra] if asked else extra)
            spec = default_layer_spec(gpt_config_from_args(args), None)
            layers = getattr(spec, "layer_specs", [spec])
            assert [layer.submodules.self_attention.module is MLASelfAttention for layer in layers] == \
                [asked] * len(layers), (extra, asked)


def _flops(fn) -> int:
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def test_flop_model_and_weight_grad_split_on_the_built_layer(megatron_world: None) -> None:
    from dualpipe_megatron.megatron.auto_layout import model_shape
    from dualpipe_megatron.megatron.wgrad_megatron import install_linear_deferral
    from dualpipe_megatron.runtime.wgrad import WeightGradStore, deferring

    args = _megatron_args(MLA)
    shape = model_shape(args)
    layer = _mla_layer(_config(args))
    install_linear_deferral()
    x = torch.randn(args.seq_length, args.micro_batch_size, args.hidden_size, generator=torch.Generator().manual_seed(1))
    grad = torch.randn(x.shape, generator=torch.Generator().manual_seed(2))
    weights = {name: getattr(layer.self_attention, name).weight for name in MLA_LINEARS}

    out: list[torch.Tensor] = []
    f = _flops(lambda: out.append(layer(x, attention_mask=None)[0]))
    b = _flops(lambda: out[0].backward(grad))
    full = {name: w.grad.clone() for name, w in weights.items()}
    layer.zero_grad(set_to_none=True)
    y = layer(x, attention_mask=None)[0]
    with deferring("mla"):
        b_input = _flops(lambda: y.backward(grad))
    untouched = [name for name, w in weights.items() if w.grad is None]
    filed: list[int] = []
    w = _flops(lambda: filed.append(WeightGradStore.pop("mla")))

    assert untouched == list(MLA_LINEARS), "the w:false backward computed these weight grads"
    assert filed == [len(MLA_LINEARS) + 2], "one W closure per linear (MLA's five, the MLP's two)"
    for name, weight in weights.items():
        assert torch.equal(weight.grad, full[name]), name
    # torch counts causal attention as the full square; the FLOP model counts its causal half.
    model = shape.decoder(moe=False)
    half = shape.micro_batch * shape.heads * shape.seq**2 * (shape.qk_head_dim + shape.qk_pos_dim + shape.v_head_dim)
    assert (f, b, b - b_input, w) == (model.F + half, model.B + 2 * half, model.W, model.W)


# --- training -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def jobs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    out = tmp_path_factory.mktemp("mla_pretrain")
    init = out / "init"
    first = ["--train-iters", "1", "--lr", "0", "--min-lr", "0", "--lr-decay-style", "constant",
             "--lr-warmup-iters", "0"]
    got: dict = {}
    try:
        got["init"] = losses(run("init", out, 1, [*SHAPE, *MLA, *first, "--save", str(init), "--save-interval", "1"]))
        got["standard"] = losses(run("standard", out, 1, [*SHAPE, *MLA[1:], *first]))
        start = [*SHAPE, *MLA, "--load", str(init), "--no-load-optim", "--no-load-rng", *TRAIN,
                 "--train-iters", str(1 + ITERATIONS)]
        for schedule in SCHEDULES:
            log = run(schedule, out, 2, [*start, "--pipeline-model-parallel-size", "2", "--pipeline-schedule", schedule])
            got[schedule] = {"loss": losses(log), "grad_norm": grad_norms(log)}
        log = run("tp2", out, 2, [*start, "--tensor-model-parallel-size", "2"])
        got["tp2"] = {"loss": losses(log), "grad_norm": grad_norms(log)}
    except LaunchFailed as exc:
        pytest.fail(str(exc), pytrace=False)
    return got


def _same(ref: dict[int, float], got: dict[int, float], rtol: float) -> None:
    iterations = list(range(2, 2 + ITERATIONS))
    assert sorted(ref) == sorted(got) == iterations
    for i in iterations:
        assert got[i] == pytest.approx(ref[i], rel=rtol), f"iteration {i}: {got[i]} vs {ref[i]}"


@pytest.mark.parametrize("schedule", ["dualpipev", "dualpipe", "tp2"])
def test_mla_matches_1f1b(jobs: dict, schedule: str) -> None:
    """``tp2``: Megatron's 1F1B at TP=2 x PP=1, each rank attending with its half of the heads."""
    ref, got = jobs["1f1b"], jobs[schedule]
    _same(ref["loss"], got["loss"], LOSS_RTOL[schedule])
    _same(ref["grad_norm"], got["grad_norm"], NORM_RTOL)
    assert ref["loss"][1 + ITERATIONS] < ref["loss"][2], "the MLA model trains"


def test_mla_was_built(jobs: dict) -> None:
    """The same flags without ``--multi-latent-attention`` build another model (before the script
    passed the flag to the dense spec, both built standard attention and started equal)."""
    assert jobs["init"][1] != jobs["standard"][1]
