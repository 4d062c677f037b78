"""Runtime patches that let Megatron-Core 0.19 run on CPU with the gloo backend.

Megatron assumes CUDA everywhere (current device, streams, CUDA RNG, `device="cuda"`
literals, CUDA type strings). Without a GPU we replace exactly those symbols, at module
level, in this process only (patches do not survive `spawn`: call this in every rank before
building models). See `docs/megatron_cpu.md` for why each group exists.

Groups can be switched off for diagnosis with ``DUALPIPE_CPU_COMPAT_DISABLE=rng,streams``
(or ``all``) or by passing `groups`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import os
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch

from dualpipe_megatron.megatron.guard import check_version
from dualpipe_megatron.patch_guard import PatchSet, around

DISABLE_ENV = "DUALPIPE_CPU_COMPAT_DISABLE"
# The Megatron flags a CPU job passes beside this layer (docs/megatron_cpu.md): gloo, local layers
# built on the CPU, and the fusions that need CUDA kernels off.
CPU_FLAGS = ("--distributed-backend gloo --transformer-impl local --use-cpu-initialization "
             "--no-gradient-accumulation-fusion --no-masked-softmax-fusion --no-bias-gelu-fusion "
             "--no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm").split()
CPU = torch.device("cpu")

PATCHES = PatchSet("CPU compat")
_installed: list[str] = []


# --- device -------------------------------------------------------------------------------


def _install_device() -> None:
    """`torch.cuda.current_device()` is used as a tensor device throughout Megatron."""
    PATCHES.patch(torch.cuda, "current_device", lambda: CPU, [])
    PATCHES.patch(torch.cuda, "set_device", lambda device: None, ["device"])
    PATCHES.patch(torch.cuda, "synchronize", lambda device=None: None, ["device"])


# --- streams ------------------------------------------------------------------------------


class HostEvent:
    """Stand-in for `torch.cuda.Event`: CPU work is already ordered, so events are complete."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        pass

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        return 0.0


class HostStream:
    """Stand-in for `torch.cuda.Stream` (MoE dispatcher side stream, DDP grad sync)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: HostEvent | None = None) -> HostEvent:
        return event if event is not None else HostEvent()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


_HOST_STREAM = HostStream()


def _install_streams() -> None:
    PATCHES.patch(torch.cuda, "Stream", HostStream)
    PATCHES.patch(torch.cuda, "Event", HostEvent)
    PATCHES.patch(torch.cuda, "current_stream", lambda device=None: _HOST_STREAM, ["device"])
    PATCHES.patch(torch.cuda, "default_stream", lambda device=None: _HOST_STREAM, ["device"])
    PATCHES.patch(torch.cuda, "stream", lambda stream: contextlib.nullcontext(), ["stream"])
    PATCHES.patch(torch.cuda, "is_current_stream_capturing", lambda: False, [])
    PATCHES.patch(torch.Tensor, "record_stream", lambda self, stream: None)


# --- rng ----------------------------------------------------------------------------------


class _DropForkWarning(logging.Filter):
    """On CPU the "CUDA" generator is the CPU generator, so Megatron's warning that CPU RNG
    state changed inside a tracker fork would fire on every dropout; drop that message only."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "CPU RNG state changed within GPU RNG context" not in record.getMessage()


_FORK_WARNING_FILTER = _DropForkWarning()
_RANDOM_MODULE = "megatron.core.tensor_parallel.random"


def _install_rng() -> None:
    """Route the "CUDA" generator to the CPU default generator, which CPU ops actually use.

    `manual_seed_all` stays: `torch.manual_seed` calls it. Megatron's private helpers must be
    replaced too, or every RNG-tracker fork silently does nothing and queues lazy CUDA calls.
    """
    from megatron.core.tensor_parallel import random as mrandom

    PATCHES.patch(
        torch.cuda, "get_rng_state", lambda device="cuda": torch.get_rng_state(), ["device"]
    )
    PATCHES.patch(
        torch.cuda,
        "set_rng_state",
        lambda new_state, device="cuda": torch.set_rng_state(new_state),
        ["new_state", "device"],
    )
    PATCHES.patch(
        torch.cuda, "manual_seed", lambda seed: torch.default_generator.manual_seed(seed), ["seed"]
    )
    PATCHES.patch(
        mrandom,
        "_get_cuda_rng_state",
        lambda device="cuda", clone=False, graph_safe=False: torch.get_rng_state(),
        "(device='cuda', clone=False, graph_safe=False)",
    )
    PATCHES.patch(
        mrandom,
        "_set_cuda_rng_state",
        lambda new_state, device=-1, graph_safe=False: torch.set_rng_state(new_state),
        "(new_state, device=-1, graph_safe=False)",
    )
    logging.getLogger(_RANDOM_MODULE).addFilter(_FORK_WARNING_FILTER)


# --- tensor factories ---------------------------------------------------------------------

_FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "linspace", "eye",
    "rand", "randn", "randint", "randperm", "empty_strided",
    "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
)  # fmt: skip
_TENSOR_FACTORIES = ("new_empty", "new_zeros", "new_ones", "new_full", "new_tensor")


def _host(device: Any) -> Any:
    """Map any CUDA device spec (``"cuda"``, ``"cuda:1"``, ``torch.device("cuda")``, an
    ordinal) to the CPU; leave everything else alone."""
    if isinstance(device, bool):
        return device
    if isinstance(device, int):
        return CPU
    if isinstance(device, str) and device.startswith("cuda"):
        return CPU
    if isinstance(device, torch.device) and device.type == "cuda":
        return CPU
    return device


def _with_host_device(fn: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        if kwargs.get("pin_memory"):  # pinning needs a CUDA driver
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    return wrapper


def _install_factories() -> None:
    """Megatron writes `device="cuda"` literally (schedules, masks, clip_grads, optimizers)."""
    for name in _FACTORIES:
        PATCHES.patch(torch, name, _with_host_device(getattr(torch, name)))
    for name in _TENSOR_FACTORIES:
        PATCHES.patch(torch.Tensor, name, _with_host_device(getattr(torch.Tensor, name)))

    tensor_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if args and not isinstance(args[0], (torch.dtype, torch.Tensor)):
            args = (_host(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = _host(kwargs["device"])
        return tensor_to(self, *args, **kwargs)

    PATCHES.patch(torch.Tensor, "to", to)
    PATCHES.patch(torch.Tensor, "cuda", lambda self, *args, **kwargs: self)
    PATCHES.patch(torch.Tensor, "pin_memory", lambda self, *args, **kwargs: self)


# --- type strings -------------------------------------------------------------------------


def _install_type_strings() -> None:
    """`clip_grads` asserts, and the fp16/distributed optimizers group params by, CUDA type
    names (`'torch.cuda.FloatTensor'`): report CPU tensors under those names."""
    tensor_type = torch.Tensor.type

    def type_(self: torch.Tensor, dtype: Any = None, *args: Any, **kwargs: Any) -> Any:
        if dtype is None and not args and not kwargs and self.device.type == "cpu":
            return tensor_type(self).replace("torch.", "torch.cuda.", 1)
        return tensor_type(self, dtype, *args, **kwargs)

    PATCHES.patch(torch.Tensor, "type", type_)


# --- all_to_all ---------------------------------------------------------------------------


def _as_list(sizes: Any) -> Any:
    return sizes.tolist() if hasattr(sizes, "tolist") else sizes


def _install_all_to_all() -> None:
    """The MoE alltoall dispatcher keeps split sizes as (CPU) tensors; gloo needs lists."""
    a2a = torch.distributed.all_to_all_single

    def all_to_all_single(
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: Any = None,
        input_split_sizes: Any = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        return a2a(output, input, _as_list(output_split_sizes), _as_list(input_split_sizes),
                   *args, **kwargs)  # fmt: skip

    PATCHES.patch(
        torch.distributed,
        "all_to_all_single",
        all_to_all_single,
        ["output", "input", "output_split_sizes", "input_split_sizes", "group", "async_op"],
    )


# --- compile ------------------------------------------------------------------------------


def _install_compile() -> None:
    """`jit_fuser` is `torch.compile`: on CPU that costs a C compiler and ~15 s of cold start."""
    import torch._dynamo

    PATCHES.patch(torch._dynamo.config, "disable", True)


# --- norms --------------------------------------------------------------------------------

_WRAPPED_NORM = ("(cls, config, hidden_size, eps=1e-05, persist_layer_norm=False, "
                 "zero_centered_gamma=False, normalization='LayerNorm')")


class _NoSequenceParallel:
    """``config`` as the torch norm wrapper's checks see it: sequence parallelism off."""

    sequence_parallel = False

    def __init__(self, config: Any) -> None:
        self._config = config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config, name)


def _install_norms() -> None:
    """Sequence parallelism with torch's LayerNorm/RMSNorm, the only local norms without Apex.

    Under SP each TP rank normalizes its own sequence shard, so a norm's weight grads are partial
    sums: Megatron's Apex and Transformer Engine norms mark their parameters ``sequence_parallel``
    and ``finalize_model_grads`` sums them over the TP group. Its torch-norm wrapper refuses SP
    instead of marking them; here it builds the same norm and marks them as those norms do.
    """
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def sequence_parallel_norm(cls: type, config: Any, hidden_size: int, eps: float = 1e-5,
                               persist_layer_norm: bool = False, zero_centered_gamma: bool = False,
                               normalization: str = "LayerNorm") -> torch.nn.Module:
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, persist_layer_norm, zero_centered_gamma,
                         normalization)
        norm = build(cls, _NoSequenceParallel(config), hidden_size, eps, persist_layer_norm,
                     zero_centered_gamma, normalization)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    PATCHES.patch(WrappedTorchNorm, "__new__", sequence_parallel_norm, _WRAPPED_NORM)


# --- mla ----------------------------------------------------------------------------------

_MLA_INIT = ("(self, config, submodules, layer_number, attn_mask_type, attention_type, cp_comm_type=None, "
             "pg_collection=None, pp_layer_offset=None, name=None)")


def _install_mla() -> None:
    """Multi-latent attention in Megatron's local spec (the only spec without TE): MLA builds its
    core attention with separate query-key and value head sizes, which Megatron's local
    ``DotProductAttention`` does not take (a TypeError at model build). MLA gets our attention
    of the same math instead, and only where its submodules name that local attention."""
    from megatron.core.transformer.multi_latent_attention import MultiLatentAttention

    from dualpipe_megatron.megatron.mla_attention import with_mla_core_attention

    def init(original: Callable[..., None], self: Any, config: Any, submodules: Any, *args: Any,
             **kwargs: Any) -> None:
        original(self, config, with_mla_core_attention(submodules), *args, **kwargs)

    PATCHES.patch(MultiLatentAttention, "__init__", around(MultiLatentAttention.__init__, init), _MLA_INIT)


# --- recompute ----------------------------------------------------------------------------


def _install_recompute() -> None:
    """Megatron's output-discarding checkpoint (selective recompute of ``layernorm``, ``moe_act``,
    ``mla_up_proj``) sets ``self.fp8 = fp8 is not None``, so its default ``fp8=False`` takes the
    FP8 branch, which calls Transformer Engine's FP8 state (a NameError without TE). Without TE the
    flag becomes what was asked for: FP8 only for a real FP8 recipe; the checkpoint is otherwise
    Megatron's own."""
    from megatron.core.tensor_parallel import random as mrandom

    if mrandom.HAVE_TE:
        return

    def init(original: Callable[..., None], self: Any, fp8: Any = False) -> None:
        original(self, fp8)
        self.fp8 = fp8 is not None and fp8 is not False

    cls = mrandom.CheckpointWithoutOutput
    PATCHES.patch(cls, "__init__", around(cls.__init__, init), "(self, fp8=False)")


# --- te_fallbacks -------------------------------------------------------------------------


# MoE kernels moe_utils takes from TE when it imports (None without TE: the router's GEMM in torch).
_TE_MOE_KERNELS = ("fused_compute_score_for_moe_aux_loss", "fused_moe_aux_loss", "fused_permute",
                   "fused_permute_and_pad_with_probs", "fused_permute_with_probs", "fused_sort_chunks_by_index",
                   "fused_sort_chunks_by_index_with_probs", "fused_topk_with_score_function", "fused_unpermute",
                   "te_general_gemm")


def _install_te_fallbacks() -> None:
    """Where Transformer Engine is installed (the TE tier, Megatron-Bridge), Megatron picks its
    CUDA kernels wherever no layer spec decides: the optimizers' multi-tensor grad norm and
    scaling, the fused Adam and SGD, a ``TransformerBlock``'s final norm and the MoE router's GEMM. Without a GPU these become
    the local implementations Megatron itself falls back to when TE is absent."""
    from megatron.core import optimizer as optimizer_package
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer import transformer_block
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.utils import (
        local_multi_tensor_applier, local_multi_tensor_l2_norm, local_multi_tensor_scale,
    )

    if not transformer_block.HAVE_TE:
        return
    for owner, name, local in (
        (clip_grads, "multi_tensor_applier", local_multi_tensor_applier),
        (clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm),
        (clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale),
        (clip_grads, "multi_tensor_scale_tensor_impl", None),
        (optimizer, "multi_tensor_applier", local_multi_tensor_applier),
        (optimizer, "multi_tensor_scale_impl", local_multi_tensor_scale),
        (optimizer_package, "USING_PYTORCH_OPTIMIZER", True),
        (optimizer_package, "Adam", torch.optim.AdamW),
        (optimizer_package, "SGD", torch.optim.SGD),
        (transformer_block, "LayerNormImpl", WrappedTorchNorm),
        *((moe_utils, name, None) for name in _TE_MOE_KERNELS),
    ):
        PATCHES.patch(owner, name, local)


# --- pretrain -----------------------------------------------------------------------------


class _Unavailable(Exception):
    """A group's target package cannot be imported; the group is skipped, not failed."""


_initializing = 0
_INITIALIZE_MEGATRON = (
    "(allow_no_cuda=False, skip_mpu_initialization=False, get_embedding_ranks=None, "
    "get_position_embedding_ranks=None, store=None, skip_model_parallel_init=False, "
    "seed_pp_group=None, seed_dp_group=None, seed_tp_group=None, seed_ep_group=None, "
    "seed_etp_group=None, skip_random_seed=False)"
)


# Blackwell: Megatron's first GPU generation without the CUDA_DEVICE_MAX_CONNECTIONS=1 demand.
_NO_STREAM_ORDER_ARCH = 10


def initializing_without_cuda(init: Callable[..., Any]) -> Callable[..., Any]:
    """``init`` (an ``initialize_megatron``: Megatron's, or Megatron-Bridge's) called with
    ``allow_no_cuda=True`` while ``torch.cuda.device_count`` claims a device (the ``pretrain``
    group patches it), since with none initialization silently skips model-parallel init and
    RNG seeding."""
    @functools.wraps(init)
    def initialize_megatron(*args: Any, **kwargs: Any) -> Any:
        global _initializing
        kwargs["allow_no_cuda"] = True
        _initializing += 1
        try:
            return init(*args, **kwargs)
        finally:
            _initializing -= 1

    return initialize_megatron


def _install_pretrain() -> None:
    """`megatron.training.pretrain()`: CUDA assert, GPU-count gated init, and argument
    validation's GPU-architecture query (asked whenever TP or CP > 1)."""
    try:
        from megatron.training import arguments, training
    except ImportError as exc:
        raise _Unavailable(f"megatron.training is not importable ({exc})") from exc

    device_count = torch.cuda.device_count

    def count_devices() -> int:
        # Claim one only while initialization runs so nothing else believes a GPU exists.
        return max(1, device_count()) if _initializing else device_count()

    PATCHES.patch(training, "initialize_megatron", initializing_without_cuda(training.initialize_megatron),
                  _INITIALIZE_MEGATRON)
    PATCHES.patch(torch.cuda, "device_count", count_devices, [])
    # CPU work runs in program order, so TP/CP need no single-connection CUDA stream ordering:
    # answer as the architecture for which Megatron asks for none (only its arguments check asks).
    PATCHES.patch(arguments, "get_device_arch_version", lambda: _NO_STREAM_ORDER_ARCH, "()")


def _install_dataset_helpers() -> None:
    """The megatron-core wheel ships its dataset index helpers built (``helpers_cpp``) but not the
    Makefile that Megatron's ``compile_helpers`` runs on rank 0, which exits when make fails: use
    the built module where it imports, else Megatron's own build (a source checkout). Not
    CPU-specific: a GPU job on the wheel needs it too (``scripts/pretrain_gpt.py`` forces it)."""
    from megatron.core.datasets import utils as dataset_utils

    build = dataset_utils.compile_helpers

    def compile_helpers() -> None:
        try:
            importlib.import_module("megatron.core.datasets.helpers_cpp")
        except ImportError:
            build()

    PATCHES.patch(dataset_utils, "compile_helpers", compile_helpers, "()")


GROUPS: dict[str, Callable[[], None]] = {
    "device": _install_device,
    "streams": _install_streams,
    "rng": _install_rng,
    "factories": _install_factories,
    "type_strings": _install_type_strings,
    "all_to_all": _install_all_to_all,
    "compile": _install_compile,
    "norms": _install_norms,
    "mla": _install_mla,
    "recompute": _install_recompute,
    "te_fallbacks": _install_te_fallbacks,
    "pretrain": _install_pretrain,
    "dataset_helpers": _install_dataset_helpers,
}


def _disabled_by_env() -> set[str]:
    names = {n.strip() for n in os.environ.get(DISABLE_ENV, "").split(",") if n.strip()}
    if "all" in names:
        return set(GROUPS)
    _check_names(names, DISABLE_ENV)
    return names


def _check_names(names: Iterable[str], where: str) -> None:
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise ValueError(f"unknown CPU-compat group(s) {unknown} in {where}; known: {list(GROUPS)}")


def install_cpu_compat(groups: Iterable[str] | None = None, force: bool = False) -> list[str]:
    """Install the CPU patch groups (all by default) when CUDA is absent, or always if `force`.

    Idempotent: groups already installed are skipped. Returns the installed groups.
    """
    wanted = list(GROUPS) if groups is None else list(groups)
    _check_names(wanted, "groups")
    if torch.cuda.is_available() and not force:
        return list(_installed)
    check_version()
    # Dynamo maps torch.cuda functions to tracing rules once, on import; let it see the
    # originals (it rejects one replacement object appearing under two names).
    importlib.import_module("torch._dynamo")
    disabled = _disabled_by_env()
    for name in GROUPS:
        if name not in wanted or name in disabled or name in _installed:
            continue
        try:
            GROUPS[name]()
        except _Unavailable as exc:
            warnings.warn(f"CPU-compat group {name!r} skipped: {exc}", stacklevel=2)
            continue
        _installed.append(name)
    return list(_installed)


def uninstall_cpu_compat() -> None:
    """Restore the symbols this layer patched, and only those (tests and diagnosis)."""
    PATCHES.restore()
    if "rng" in _installed:
        logging.getLogger(_RANDOM_MODULE).removeFilter(_FORK_WARNING_FILTER)
    _installed.clear()


def installed_groups() -> list[str]:
    return list(_installed)


__all__ = [
    "CPU_FLAGS",
    "DISABLE_ENV",
    "GROUPS",
    "HostEvent",
    "HostStream",
    "PATCHES",
    "install_cpu_compat",
    "initializing_without_cuda",
    "installed_groups",
    "uninstall_cpu_compat",
]
