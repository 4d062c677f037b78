#!/usr/bin/env bash
# Every GPU check of this project in one run (one NVIDIA GPU; about 5 minutes when all pass on an
# H200; no internet needed).
#
#   bash scripts/gpu_check.sh                  # on the GPU machine (make gpu-check)
#   bash scripts/gpu_check.sh --cpu-dry-run    # here, no GPU: the same steps on CPU/gloo
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh
#   GPU_CHECK_ONLY=megatron_budget bash scripts/gpu_check.sh   # env, setup and these sections only
#
# Sections, each ending in one PASS, FAIL or SKIP line with its reason:
#   env            nvidia-smi, Python, torch, CUDA, NCCL and megatron-core versions
#   setup          `make setup` only when torch or megatron-core is missing and an index answers;
#                  megatron-core from carried wheels in .whl/ (see the device README) otherwise
#   op_costs       scripts/device_op_costs.py (H200 op costs and the projection; --dry-run on CPU)
#   nccl_two_rank  scripts/nccl_two_rank.py under torchrun: 2 ranks on cuda:0 over NCCL, dualpipev
#                  and dualpipe, 3 training steps + 1 forward-only, against one process; then the
#                  op-order search shared by the two ranks (gathers over NCCL), against one process
#   megatron_pp2   scripts/pretrain_gpt.py --pipeline-schedule dualpipev, PP=2, tiny GPT, 2 ranks
#                  on cuda:0, 3 iterations, mock data, local transformer implementation
#   activation_memory
#                  megatron_pp2's job in bf16 under bench/metered_pretrain.py: each rank's activation
#                  meter peak and torch.cuda.max_memory_allocated over the step against the launch
#                  plan's estimate for the same arguments (activation_memory.md)
#   megatron_lm_pp2
#                  Megatron-LM 0.19's own pretrain_gpt.py (from $MEGATRON_LM_DIR, default .megatron_lm/:
#                  the fetched core_r0.19.0 files, carried, never committed) through
#                  python -m dualpipe_megatron.launch, as megatron_pp2; SKIP without the files
#   megatron_eplb  the same script, an MoE GPT at EP=2 with --eplb-interval 1 and 2 redundant
#                  experts: slots re-placed, replicas checked bitwise against owners every step
#   megatron_budget
#                  from one PP=1 checkpoint, dualpipev under --dualpipe-max-activations 4
#                  (DeepSeek's order peaks at 5 there) and Megatron's own 1F1B: the lm loss of
#                  iterations 2-4 must agree to 1e-5 relative (issue 26's training check, on a GPU)
#   profile_pp2, profile_eplb
#                  both Megatron sections run Megatron's PyTorch profiler over iteration 2
#                  (--profile --use-pytorch-profiler); `python -m dualpipe_megatron.trace profile`
#                  reads each rank's trace: compute, communication hidden and exposed, GPU time per
#                  op; traces, reports and figures go into one archive, profile.tar.gz
#   calibrate      `python -m dualpipe_megatron.projection calibrate` on the dualpipev run's trace:
#                  per-layer op costs and communication measured on the GPU (in profile.tar.gz)
#   te_setup       Transformer Engine from carried wheels in .whl/ when the image lacks it (docs/nccl.md,
#                  "Carrying Transformer Engine"); the TE sections SKIP in a CPU dry run
#   te_pp2         TE layers (--transformer-impl transformer_engine, bf16), dualpipev at PP=2 against
#                  Megatron's 1F1B from one PP=1 checkpoint: lm loss of iterations 2-4 to 1e-4
#   te_fp8         the same with --fp8-format hybrid --fp8-recipe tensorwise (H100/H200), to 1e-3
#   te_wgrad       --delay-wgrad-compute (TE's queued weight GEMMs run at our W ops) with the MoE
#                  F&B overlap: an MoE at EP=2 x PP=2, 4 ranks, so 2 GPUs; SKIP on one
# The four two-rank sections need NCCL >= 2.30 (older NCCL refuses two ranks on one GPU; the
# device tool's H200 image has 2.28.9: docs/nccl.md says how 2.32.6 was put in its place); with
# --cpu-dry-run they run on CPU with gloo instead. Every launched command has a hard timeout, so
# a hang is a FAIL. Logs and results go to ${OUT:-outputs/gpu_check}; the exit status is 0 only
# if no section FAILed.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 2
DRY_RUN=${GPU_CHECK_DRY_RUN:-0}
for arg in "$@"; do
    case "$arg" in
        --cpu-dry-run) DRY_RUN=1 ;;
        -h|--help) sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "unknown argument: $arg (see --help)" >&2; exit 2 ;;
    esac
done
OUT_DIR=${OUT:-outputs/gpu_check}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)
# Seconds; with the index probe (25) and env (~30), about 17 minutes if every launch hangs (lower
# them, or run fewer sections with GPU_CHECK_ONLY, to fit a shorter lease).
# At most 8 files land in the output folder (the device tool brings back 8): the profile sections'
# outputs (and the calibration after them) are bundled into profile.tar.gz.
ENV_TIMEOUT=${ENV_TIMEOUT:-90}
OP_COSTS_TIMEOUT=${OP_COSTS_TIMEOUT:-160}
NCCL_TIMEOUT=${NCCL_TIMEOUT:-110}
MEGATRON_TIMEOUT=${MEGATRON_TIMEOUT:-150}
PROFILE_TIMEOUT=${PROFILE_TIMEOUT:-90}
if [[ "$DRY_RUN" == 1 ]]; then MEGATRON_TIMEOUT=${MEGATRON_DRY_TIMEOUT:-240}; fi

exec > >(tee "$OUT_DIR/gpu_check.log") 2>&1
TEE_PID=$!
SCRATCH=$(mktemp -d)
trap 'rm -rf "$SCRATCH"' EXIT
PROFILE_DIR="$SCRATCH/profile"  # bundled into $OUT_DIR/profile.tar.gz at the end
mkdir -p "$PROFILE_DIR"

export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export TORCH_NCCL_ASYNC_ERROR_HANDLING=1
export NCCL_MULTI_RANK_GPU_ENABLE=1          # NCCL >= 2.30: up to two ranks per GPU (experimental)
export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export CUDA_DEVICE_MAX_CONNECTIONS=1         # Megatron's setting (launch_torchrun.sh)
# The CPU dry run checks every pipeline step's calls against the NCCL model (runtime/strict.py),
# as the tests do; on the GPU real NCCL is the judge.
if [[ "$DRY_RUN" == 1 ]]; then export DUALPIPE_NCCL_STRICT=${DUALPIPE_NCCL_STRICT:-1}; fi

SECTIONS=() STATUSES=() REASONS=()
ONLY=${GPU_CHECK_ONLY:-}  # comma-separated sections to run (env and setup always run); empty: all
selected() { [[ -z "$ONLY" || ",$ONLY," == *",$1,"* ]]; }
record() {  # record SECTION STATUS REASON
    SECTIONS+=("$1") STATUSES+=("$2") REASONS+=("$3")
    echo "== $1: $2 - $3"
}
header() { echo; echo "==================== $1 ===================="; }
# run_limited SECONDS LOG CMD...: CMD under a hard timeout, output to LOG; returns its status.
run_limited() {
    local limit=$1 log=$2; shift 2
    echo "\$ timeout $limit$(printf ' %q' "$@")"
    timeout -k 15 "$limit" "$@" >"$log" 2>&1
}
# why_failed STATUS SECONDS: one phrase for a launch's exit status.
why_failed() {
    case "$1" in
        124|137) echo "timed out after $2 s (hang?)" ;;
        *) echo "exit status $1" ;;
    esac
}
show_tail() { echo "--- last lines of $1 ---"; tail -n "${2:-40}" "$1"; echo "---"; }

# -- env ---------------------------------------------------------------------------------------
header "env"
echo "mode: $([[ "$DRY_RUN" == 1 ]] && echo "CPU dry run (gloo, DUALPIPE_NCCL_STRICT=$DUALPIPE_NCCL_STRICT)" || echo GPU)"
echo "repo: $REPO ($(git -C "$REPO" rev-parse --short HEAD 2>/dev/null || echo 'no git'))"
echo "output: $OUT_DIR"
if command -v nvidia-smi >/dev/null; then
    timeout 30 nvidia-smi || echo "nvidia-smi failed"
else
    echo "nvidia-smi: not found"
fi

# has_modules PYTHON MODULE...: does PYTHON import every MODULE?
has_modules() {
    local py=$1; shift
    [[ -n "$py" ]] && command -v "$py" >/dev/null && timeout "$ENV_TIMEOUT" "$py" -c "
import importlib, sys
for m in sys.argv[1:]: importlib.import_module(m)" "$@" >/dev/null 2>&1
}
pick_python() {  # first interpreter with torch and megatron-core, else the first with torch
    local py candidates=("${PYTHON:-}" "$REPO/.venv/bin/python" python3 python)
    for py in "${candidates[@]}"; do has_modules "$py" torch megatron.core && { echo "$py"; return; }; done
    for py in "${candidates[@]}"; do has_modules "$py" torch && { echo "$py"; return; }; done
    for py in "${candidates[@]}"; do [[ -n "$py" ]] && command -v "$py" >/dev/null && { echo "$py"; return; }; done
}
# facts: KEY=value lines from the chosen interpreter
facts() {
    timeout "$ENV_TIMEOUT" "$PY" - <<'EOF' 2>/dev/null
import sys
print(f"PYTHON_VERSION={sys.version.split()[0]}")
try:
    import torch
except Exception as exc:
    print(f"TORCH=missing ({type(exc).__name__}: {exc})".replace("\n", " "))
    raise SystemExit
print(f"TORCH={torch.__version__}")
cuda = torch.cuda.is_available()
print(f"CUDA_AVAILABLE={int(cuda)}")
print(f"CUDA_VERSION={torch.version.cuda}")
if cuda:
    print(f"GPU={torch.cuda.get_device_name(0)} x{torch.cuda.device_count()}")
try:
    from dualpipe_megatron.runtime.nccl_version import loaded_nccl_version
    v = loaded_nccl_version()  # not torch's build-time one: a newer libnccl.so.2 may be in place
    print("NCCL=" + ".".join(map(str, v)))
    print(f"NCCL_MULTI_RANK={int(tuple(v[:2]) >= (2, 30))}")
except Exception as exc:
    print(f"NCCL=unavailable ({type(exc).__name__})")
    print("NCCL_MULTI_RANK=0")
try:
    import megatron.core
    print(f"MEGATRON={megatron.core.__version__}")
except Exception as exc:
    print(f"MEGATRON=missing ({type(exc).__name__}: {exc})".replace("\n", " "))
EOF
}
load_facts() {
    local unknown="missing (the probe failed or took over ${ENV_TIMEOUT} s)"
    PYTHON_VERSION="" TORCH=$unknown CUDA_AVAILABLE=0 CUDA_VERSION="" GPU="" NCCL="unavailable"
    NCCL_MULTI_RANK=0 MEGATRON=$unknown
    [[ -z "$PY" ]] && return
    local key value
    while IFS='=' read -r key value; do
        case "$key" in
            PYTHON_VERSION|TORCH|CUDA_AVAILABLE|CUDA_VERSION|GPU|NCCL|NCCL_MULTI_RANK|MEGATRON)
                printf -v "$key" '%s' "$value" ;;
        esac
    done < <(facts)
}
have_torch() { [[ "$TORCH" != missing* ]]; }
have_megatron() { [[ "$MEGATRON" != missing* ]]; }
print_facts() {
    echo "python: ${PY:-none} ${PYTHON_VERSION}"
    echo "torch: $TORCH (CUDA ${CUDA_VERSION:-none}); torch.cuda.is_available(): $([[ $CUDA_AVAILABLE == 1 ]] && echo True || echo False)${GPU:+; $GPU}"
    echo "NCCL: $NCCL"
    echo "megatron-core: $MEGATRON"
}

PY=$(pick_python)
load_facts
print_facts
if [[ -z "$PY" ]]; then
    record env FAIL "no python interpreter found"
elif ! have_torch; then
    record env FAIL "$PY has no torch"
elif [[ "$DRY_RUN" != 1 && "$CUDA_AVAILABLE" != 1 ]]; then
    record env FAIL "torch.cuda.is_available() is False (no GPU? run with --cpu-dry-run)"
else
    record env PASS "$PY: torch $TORCH, NCCL $NCCL, megatron-core ${MEGATRON%% *}"
fi

# -- setup ---------------------------------------------------------------------------------------
header "setup"
index_answers() {  # can pip reach a package index with megatron-core?
    timeout 25 "${PY:-python3}" -m pip index versions megatron-core --retries 0 --timeout 8 >/dev/null 2>&1
}
if have_torch && have_megatron; then
    record setup SKIP "not needed: $PY has torch and megatron-core"
elif have_torch && compgen -G ".whl/megatron_core-*.whl" >/dev/null; then
    # The device README's way to bring packages to a machine without an index.
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/gpu_check_site .whl/*.whl; then
        export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_site"
        load_facts
        print_facts
        if have_megatron; then record setup PASS "megatron-core $MEGATRON from .whl/"
        else record setup FAIL "installed .whl/ but megatron.core does not import: $MEGATRON"; fi
    else
        record setup FAIL "pip could not install .whl/*.whl"
    fi
elif index_answers; then
    echo "torch: $TORCH; megatron-core: $MEGATRON; a package index answers: make setup"
    if timeout 1200 make setup; then
        PY="$REPO/.venv/bin/python"
        load_facts
        print_facts
        record setup PASS "make setup: torch $TORCH, megatron-core $MEGATRON"
    else
        record setup FAIL "make setup failed"
    fi
else
    missing=$(have_torch || echo -n "torch "; have_megatron || echo -n "megatron-core")
    record setup SKIP "missing: ${missing}; no package index reachable and no .whl/megatron_core-*.whl, so nothing installed"
fi

# -- op costs --------------------------------------------------------------------------------------
header "op_costs"
if ! selected op_costs; then
    record op_costs SKIP "not selected (GPU_CHECK_ONLY=$ONLY)"
elif ! have_torch; then
    record op_costs SKIP "no torch"
elif [[ "$DRY_RUN" == 1 ]]; then
    log="$SCRATCH/op_costs.log"
    if OUT="$OUT_DIR/op_costs" run_limited "$OP_COSTS_TIMEOUT" "$log" "$PY" scripts/device_op_costs.py --dry-run; then
        tail -n 3 "$log"
        record op_costs PASS "CPU --dry-run (tiny shape; the CUDA measurement itself is skipped): $OUT_DIR/op_costs/"
    else
        rc=$?; show_tail "$log"
        record op_costs FAIL "device_op_costs.py --dry-run: $(why_failed $rc "$OP_COSTS_TIMEOUT")"
    fi
elif [[ "$CUDA_AVAILABLE" != 1 ]]; then
    record op_costs SKIP "no CUDA device"
else
    log="$SCRATCH/op_costs.log"
    if OUT="$OUT_DIR/op_costs" run_limited "$OP_COSTS_TIMEOUT" "$log" "$PY" scripts/device_op_costs.py; then
        cat "$log"
        record op_costs PASS "measured on $GPU: $OUT_DIR/op_costs/{op_costs.json,projection.md,projection.json}"
    else
        rc=$?; show_tail "$log"
        record op_costs FAIL "device_op_costs.py: $(why_failed $rc "$OP_COSTS_TIMEOUT")"
    fi
fi

# Why a two-rank run cannot go on this GPU, or nothing (dry runs use gloo on CPU).
two_rank_blocker() {
    if [[ "$DRY_RUN" == 1 ]]; then return; fi
    if [[ "$CUDA_AVAILABLE" != 1 ]]; then echo "no CUDA device"; return; fi
    if [[ "$NCCL_MULTI_RANK" != 1 ]]; then echo "NCCL $NCCL < 2.30 refuses two ranks per GPU"; fi
}
TORCHRUN=(-m torch.distributed.run --standalone --nproc-per-node 2)

# -- two ranks of the native runtime ---------------------------------------------------------------
header "nccl_two_rank"
blocker=$(two_rank_blocker)
if ! selected nccl_two_rank; then
    record nccl_two_rank SKIP "not selected (GPU_CHECK_ONLY=$ONLY)"
elif ! have_torch; then
    record nccl_two_rank SKIP "no torch"
elif [[ -n "$blocker" ]]; then
    echo "SKIP: $blocker"
    record nccl_two_rank SKIP "$blocker"
else
    if [[ "$DRY_RUN" == 1 ]]; then args=(--device cpu); what="gloo on CPU"
    else args=(--device cuda --timeout 30); what="NCCL $NCCL, 2 ranks on cuda:0"; fi
    log="$OUT_DIR/nccl_two_rank.log"
    run_limited "$NCCL_TIMEOUT" "$log" "$PY" "${TORCHRUN[@]}" scripts/nccl_two_rank.py "${args[@]}"
    rc=$?
    grep -E "^(world|hidden|PASS|FAIL|RESULT)" "$log"
    if [[ $rc == 0 ]] && grep -q "^RESULT: PASS" "$log"; then
        record nccl_two_rank PASS "$what: $(grep -c '^PASS' "$log") steps match one process"
    else
        show_tail "$log"
        record nccl_two_rank FAIL "$what: $(why_failed $rc "$NCCL_TIMEOUT")$(grep -q '^FAIL' "$log" && echo ', a step differs from one process')"
    fi
fi

# -- Megatron pretraining, dualpipev at PP=2 ------------------------------------------------------
header "megatron_pp2"
# With one MTP layer at the loss stage (rank 0 under dualpipev), DeepSeek-V3 style: RoPE, untied head.
MODEL=(--num-layers 4 --hidden-size 256 --num-attention-heads 4 --seq-length 256
       --max-position-embeddings 256 --vocab-size 1024 --position-embedding-type rope
       --untie-embeddings-and-output-weights --mtp-num-layers 1
       --hidden-dropout 0 --attention-dropout 0)
PARALLEL=(--pipeline-model-parallel-size 2 --pipeline-schedule dualpipev --dualpipe-p2p-timeout 60)
# No apex, Transformer Engine or torch.compile on the device image: these fusions stay off there too.
NO_FUSIONS=(--transformer-impl local --no-gradient-accumulation-fusion --no-masked-softmax-fusion
            --no-bias-gelu-fusion --no-bias-dropout-fusion --no-rope-fusion --no-persist-layer-norm)
CPU_ONLY=(--distributed-backend gloo --use-cpu-initialization)
# Micro-batch 1, global batch 4, DP 1: 4 micro-batches per step (dualpipev needs >= 2 x PP).
DATA=(--mock-data --tokenizer-type NullTokenizer --micro-batch-size 1 --global-batch-size 4
      --seed 1234 --log-interval 1 --eval-interval 1000 --eval-iters 0)
TRAIN=(--train-iters 3 --lr 1e-3 --min-lr 1e-4 --lr-decay-style cosine --lr-warmup-iters 1)
# Megatron pins each rank to cuda:LOCAL_RANK; on one GPU both ranks must say 0.
PIN_GPU0=(--no-python bash -c 'LOCAL_RANK=0 exec "$0" "$@"' "$PY")
SKIPPED=200
# profiled SECTION: Megatron's PyTorch profiler over iteration 2 of 3 (iteration 1 is its warm-up);
# each rank writes $PROFILE_DIR/SECTION/torch_profile/rank-N.json.gz (Megatron puts it next to the
# --tensorboard-dir; the tensorboard package itself is optional).
profiled() {
    echo --profile --use-pytorch-profiler --profile-step-start 2 --profile-step-end 3 \
        --tensorboard-dir "$PROFILE_DIR/$1/tb"
}
# pretrain_skip SECTION: why SECTION's pretraining runs cannot go here, or nothing.
pretrain_skip() {
    if ! selected "$1"; then echo "not selected (GPU_CHECK_ONLY=$ONLY)"
    elif ! have_torch || ! have_megatron; then echo "megatron-core not importable ($MEGATRON)"
    else two_rank_blocker; fi
}
# pretrain_on_gpu0 NPROC LOG ARGS...: scripts/pretrain_gpt.py on NPROC ranks of cuda:0 (gloo on CPU in
# a dry run) into LOG. ARGS come after the shared data and training settings, so they override them.
pretrain_on_gpu0() {
    local nproc=$1 log=$2 extra=()
    shift 2
    if [[ "$DRY_RUN" == 1 ]]; then extra=("${CPU_ONLY[@]}"); fi
    OMP_NUM_THREADS=1 run_limited "$MEGATRON_TIMEOUT" "$log" "$PY" -m torch.distributed.run --standalone \
        --nproc-per-node "$nproc" "${PIN_GPU0[@]}" "${PRETRAIN_SCRIPT[@]}" "${NO_FUSIONS[@]}" "${extra[@]}" \
        "${DATA[@]}" "${TRAIN[@]}" "$@"
}
PRETRAIN_SCRIPT=(scripts/pretrain_gpt.py)  # what pretrain_on_gpu0 runs; megatron_lm_pp2 sets another
# pretrain_two_ranks SECTION LOG ARGS...: pretrain_on_gpu0 with two ranks, setting WHAT; records SKIP
# and returns $SKIPPED when it cannot run.
pretrain_two_ranks() {
    local section=$1 log=$2 skip
    shift 2
    skip=$(pretrain_skip "$section")
    if [[ -n "$skip" ]]; then
        echo "SKIP: $skip"; record "$section" SKIP "$skip"; return $SKIPPED
    fi
    if [[ "$DRY_RUN" == 1 ]]; then WHAT="gloo on CPU"; else WHAT="NCCL $NCCL, 2 ranks on cuda:0"; fi
    pretrain_on_gpu0 2 "$log" "$@"
}

log="$OUT_DIR/megatron_pp2.log"
pretrain_two_ranks megatron_pp2 "$log" "${MODEL[@]}" "${PARALLEL[@]}" $(profiled megatron_pp2)
rc=$?
if [[ $rc != "$SKIPPED" ]]; then
    loss_lines=$(grep -cE "iteration +[0-9]+/ +3 \|.*lm loss: .*mtp_1 loss: " "$log")
    grep -E "iteration +[0-9]+/ +3 \|" "$log" | sed -E 's/.*(iteration +[0-9]+\/ +3).*(elapsed time per iteration \(ms\): [0-9.]+).*(lm loss: [0-9.E+-]+).*/\1 | \2 | \3/'
    errors=$(grep -c "Traceback" "$log")
    if [[ $rc == 0 && $loss_lines == 3 && $errors == 0 ]]; then
        record megatron_pp2 PASS "$WHAT: 3 iterations logged lm loss and mtp_1 loss"
    else
        show_tail "$log" 60
        if grep -q "compiling dataset index builder" "$log" && ! grep -q "done with dataset index builder" "$log"; then
            echo "hint: Megatron's compile_helpers() ran make in megatron/core/datasets (the wheel ships no" \
                 "Makefile); scripts/pretrain_gpt.py replaces it only when CUDA is absent (cpu_compat)"
        fi
        record megatron_pp2 FAIL "$WHAT: $(why_failed $rc "$MEGATRON_TIMEOUT"), $loss_lines of 3 lines with lm and mtp_1 loss, $errors tracebacks"
    fi
fi

# -- Activation memory: the launch plan's estimate against the GPU's allocator ----------------------
header "activation_memory"
# megatron_pp2's job (local layers, bf16, DualPipeV at PP=2) under bench/metered_pretrain.py: every
# step under the activation meter and torch.cuda.max_memory_allocated; then each rank's peaks
# against the plan's estimate for the same arguments (bench/activation_estimate.py --from-dir).
# The CUDA peak also holds a step's gradients and temporaries, so it sits above the estimate.
log="$OUT_DIR/activation_memory.log"
MEM_ARGS=("${MODEL[@]}" "${PARALLEL[@]}" --bf16)
PRETRAIN_SCRIPT=(bench/metered_pretrain.py)
DUALPIPE_METER_DIR="$SCRATCH/meter" pretrain_two_ranks activation_memory "$log" "${MEM_ARGS[@]}"
rc=$?
PRETRAIN_SCRIPT=(scripts/pretrain_gpt.py)
if [[ $rc != "$SKIPPED" ]]; then
    extra=()
    if [[ "$DRY_RUN" == 1 ]]; then extra=("${CPU_ONLY[@]}"); fi
    if [[ $rc == 0 ]] && "$PY" bench/activation_estimate.py --from-dir "$SCRATCH/meter" --world 2 -- \
            "${NO_FUSIONS[@]}" "${extra[@]}" "${DATA[@]}" "${TRAIN[@]}" "${MEM_ARGS[@]}" \
            > "$OUT_DIR/activation_memory.md" 2>>"$log"; then
        cat "$OUT_DIR/activation_memory.md"
        record activation_memory PASS "$WHAT: peaks per rank against the plan's estimate in activation_memory.md"
    else
        show_tail "$log" 40
        record activation_memory FAIL "$WHAT: $(why_failed $rc "$MEGATRON_TIMEOUT")"
    fi
fi

# -- Megatron-LM's own pretrain_gpt.py through the launcher ------------------------------------------
header "megatron_lm_pp2"
# Megatron-LM 0.19's script (a config container, no model_provider) with its builder modules, from
# $MEGATRON_LM_DIR (default .megatron_lm/, ignored by git: carry it to the device), copied into the
# scratch folder so that the wheel's megatron, not a checkout's, is imported; the same model and
# parallelism as megatron_pp2, through python -m dualpipe_megatron.launch.
MEGATRON_LM_DIR=${MEGATRON_LM_DIR:-$REPO/.megatron_lm}
missing_mlm=""
for f in pretrain_gpt.py gpt_builders.py model_provider.py; do
    [[ -f "$MEGATRON_LM_DIR/$f" ]] || missing_mlm+=" $f"
done
if [[ -n "$missing_mlm" ]] && selected megatron_lm_pp2; then
    record megatron_lm_pp2 SKIP "no Megatron-LM scripts in $MEGATRON_LM_DIR (missing:$missing_mlm; fetch branch core_r0.19.0)"
else
    mkdir -p "$SCRATCH/megatron_lm"
    [[ -z "$missing_mlm" ]] && cp "$MEGATRON_LM_DIR"/{pretrain_gpt.py,gpt_builders.py,model_provider.py} "$SCRATCH/megatron_lm/"
    log="$OUT_DIR/megatron_lm_pp2.log"
    PRETRAIN_SCRIPT=(-m dualpipe_megatron.launch "$SCRATCH/megatron_lm/pretrain_gpt.py")
    pretrain_two_ranks megatron_lm_pp2 "$log" "${MODEL[@]}" "${PARALLEL[@]}"
    rc=$?
    PRETRAIN_SCRIPT=(scripts/pretrain_gpt.py)
    if [[ $rc != "$SKIPPED" ]]; then
        loss_lines=$(grep -cE "iteration +[0-9]+/ +3 \|.*lm loss: .*mtp_1 loss: " "$log")
        errors=$(grep -c "Traceback" "$log")
        if [[ $rc == 0 && $loss_lines == 3 && $errors == 0 ]]; then
            record megatron_lm_pp2 PASS "$WHAT: Megatron-LM's pretrain_gpt.py, 3 iterations logged lm loss and mtp_1 loss"
        else
            show_tail "$log" 60
            record megatron_lm_pp2 FAIL "$WHAT: $(why_failed $rc "$MEGATRON_TIMEOUT"), $loss_lines of 3 lines with lm and mtp_1 loss, $errors tracebacks"
        fi
    fi
fi

# -- EPLB: experts re-placed over EP=2 ---------------------------------------------------------------
header "megatron_eplb"
# The moves' all-to-all and the counts' all-reduce on the device: MoE GPT, 8 experts, top-2, EP=2
# (2 ranks on cuda:0, no pipeline), 2 redundant experts (replica weights and gradients cross the
# device's all-to-all every step), re-placed after iterations 1 and 2 of 3; every replica is
# compared bitwise with its owner before each iteration. Its log stays in the scratch folder (the
# output folder is full); the lines that matter are printed here.
MOE=(--num-experts 8 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-aux-loss-coeff 1e-2
     --disable-bias-linear --expert-model-parallel-size 2 --eplb-interval 1 --eplb-threshold 0
     --eplb-redundant-experts 2)
log="$SCRATCH/megatron_eplb.log"
export DUALPIPE_EPLB_CHECK_REPLICAS=1
pretrain_two_ranks megatron_eplb "$log" "${MODEL[@]}" "${MOE[@]}" $(profiled megatron_eplb)
rc=$?
unset DUALPIPE_EPLB_CHECK_REPLICAS
if [[ $rc != "$SKIPPED" ]]; then
    grep -E "^EPLB (iteration|redundant|replica sync)" "$log"
    metric_lines=$(grep -cE "iteration +[0-9]+/ +3 \|.*lm loss: .*eplb_max_mean_load: " "$log")
    moved=$(grep -cE "^EPLB iteration [0-9]+: moved [1-9][0-9]* expert(s| slots).*measured" "$log")
    checked=$(grep -cE "^EPLB replica check: all [1-9][0-9]* replicas equal their owners bitwise" "$log")
    errors=$(grep -c "Traceback" "$log")
    if [[ $rc == 0 && $metric_lines == 3 && $moved -ge 1 && $checked == 3 && $errors == 0 ]]; then
        record megatron_eplb PASS "$WHAT: 3 iterations with the load metric, $moved re-placements moved experts, replicas equal owners before all $checked iterations"
    else
        show_tail "$log" 60
        record megatron_eplb FAIL "$WHAT: $(why_failed $rc "$MEGATRON_TIMEOUT"), $metric_lines of 3 lines with eplb_max_mean_load, $moved re-placements that moved experts, $checked of 3 replica checks, $errors tracebacks"
    fi
fi

# -- activation budget against Megatron's 1F1B ------------------------------------------------------
header "megatron_budget"
# DualPipeV at PP=2 with 4 micro-batches peaks at 5 live (d,s,m) per rank in DeepSeek's order;
# --dualpipe-max-activations 4 runs the optimizer's order within 4. Megatron's own 1F1B is the
# reference, as in tests/test_megatron_training.py: both start from one PP=1 checkpoint (Megatron
# seeds each pipeline rank's initialisation apart, so two layouts would start from other weights)
# and train iterations 2..4; the lm loss of each agrees to 1e-5 relative (the schedules change the
# order of work, not the math; gradients accumulate in another order).
lm_losses() { grep -oE "iteration +[0-9]+/ +4 \|.*lm loss: [0-9.E+-]+" "$1" | grep -oE "[0-9.]+E[+-][0-9]+$"; }
init="$SCRATCH/budget_init"
if [[ -z "$(pretrain_skip megatron_budget)" ]]; then
    # iteration 1 at PP=1 with learning rate 0: the shared starting weights
    pretrain_on_gpu0 1 "$SCRATCH/budget_init.log" "${MODEL[@]}" --train-iters 1 --lr 0 --min-lr 0 \
        --lr-decay-style constant --lr-warmup-iters 0 --save "$init" --save-interval 1
fi
FROM_INIT=(--train-iters 4 --load "$init" --no-load-optim --no-load-rng)
budget_log="$SCRATCH/megatron_budget.log" reference_log="$SCRATCH/megatron_1f1b.log"
pretrain_two_ranks megatron_budget "$budget_log" "${MODEL[@]}" "${PARALLEL[@]}" --dualpipe-max-activations 4 \
    "${FROM_INIT[@]}"
rc=$?
if [[ $rc != "$SKIPPED" ]]; then
    pretrain_two_ranks megatron_budget "$reference_log" "${MODEL[@]}" --pipeline-model-parallel-size 2 \
        --pipeline-schedule 1f1b "${FROM_INIT[@]}"
    ref_rc=$?
    budget=$(lm_losses "$budget_log" | paste -sd' ') reference=$(lm_losses "$reference_log" | paste -sd' ')
    grep -E "DualPipe op order optimized" "$budget_log" | head -n 1
    echo "lm loss, dualpipev within 4: $budget"
    echo "lm loss, Megatron's 1F1B:    $reference"
    agree=$("$PY" - "$budget" "$reference" <<'EOF'
import sys
got, want = (list(map(float, a.split())) for a in sys.argv[1:3])
print(int(len(got) == len(want) == 3 and all(abs(g - w) <= 1e-5 * abs(w) for g, w in zip(got, want))))
EOF
)
    if [[ $rc == 0 && $ref_rc == 0 && "$agree" == 1 ]]; then
        record megatron_budget PASS "$WHAT: dualpipev within 4 live per rank, lm loss of iterations 2-4 equal to 1F1B's to 1e-5"
    else
        show_tail "$SCRATCH/budget_init.log" 20
        show_tail "$budget_log" 30
        [[ $ref_rc == 0 ]] || show_tail "$reference_log" 30
        record megatron_budget FAIL "$WHAT: exit status $rc (1F1B $ref_rc); lm loss $budget against 1F1B's $reference"
    fi
fi

# -- Transformer Engine: TE layers under dualpipev against Megatron's 1F1B ---------------------------
header "te_setup"
# TE's torch binding is built from its sdist (make setup-te builds it here, tied to torch 2.13.0+cu130
# and cp312); a GPU machine without an index gets it and its pure-Python requirements as carried
# wheels in .whl/ (docs/nccl.md, "Carrying Transformer Engine"). Installed beside megatron-core.
have_te() { timeout "$ENV_TIMEOUT" "$PY" -c "import transformer_engine.pytorch" >/dev/null 2>&1; }
TE_SKIP=""
if [[ "$DRY_RUN" == 1 ]]; then
    TE_SKIP="Transformer Engine cannot run without a GPU (tests/te checks its construction on CPU: make setup-te)"
    record te_setup SKIP "$TE_SKIP"
elif ! selected te_pp2 && ! selected te_fp8 && ! selected te_wgrad; then
    TE_SKIP="not selected (GPU_CHECK_ONLY=$ONLY)"
    record te_setup SKIP "$TE_SKIP"
elif have_te; then
    record te_setup SKIP "not needed: $PY imports transformer_engine.pytorch"
elif ! compgen -G ".whl/transformer_engine_torch-*.whl" >/dev/null; then
    TE_SKIP="no Transformer Engine in $PY and no .whl/transformer_engine_torch-*.whl carried"
    record te_setup SKIP "$TE_SKIP"
elif [[ "$TORCH" != 2.13.0* ]]; then
    TE_SKIP="the carried TE binding is built for torch 2.13.0; this machine has torch $TORCH (build TE here)"
    record te_setup SKIP "$TE_SKIP"
elif "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/gpu_check_te .whl/transformer_engine*.whl .whl/te_deps/*.whl; then
    export PYTHONPATH="$PYTHONPATH:/tmp/gpu_check_te"
    if have_te; then record te_setup PASS "Transformer Engine from .whl/"
    else TE_SKIP="installed .whl/ but transformer_engine.pytorch does not import"; record te_setup FAIL "$TE_SKIP"; fi
else
    TE_SKIP="pip could not install .whl/transformer_engine*.whl"
    record te_setup FAIL "$TE_SKIP"
fi

# te_against_1f1b SECTION NPROC TOLERANCE ARGS...: from one PP=1 checkpoint (as megatron_budget) with
# the TE layer spec in bf16, dualpipev (ARGS and TE_OURS) and Megatron's own 1F1B (ARGS) train
# iterations 2-4; PASS when each lm loss agrees to TOLERANCE relative (bf16 GEMMs accumulate in
# another order under the two schedules).
TE_MODEL=(--transformer-impl transformer_engine --bf16 --num-layers 4 --hidden-size 256
          --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256 --vocab-size 1024
          --position-embedding-type rope --untie-embeddings-and-output-weights
          --hidden-dropout 0 --attention-dropout 0)
te_against_1f1b() {
    local section=$1 nproc=$2 tolerance=$3 init="$SCRATCH/$1_init" ours="$SCRATCH/$1.log"
    local reference="$SCRATCH/$1_1f1b.log" skip rc ref_rc
    shift 3
    skip=${TE_SKIP:-$(pretrain_skip "$section")}
    if [[ -n "$skip" ]]; then record "$section" SKIP "$skip"; return; fi
    pretrain_on_gpu0 "$(( nproc / 2 ))" "$SCRATCH/$section.init.log" "${TE_MODEL[@]}" "$@" \
        --pipeline-model-parallel-size 1 --train-iters 1 --lr 0 --min-lr 0 --lr-decay-style constant \
        --lr-warmup-iters 0 --save "$init" --save-interval 1
    local from_init=(--train-iters 4 --load "$init" --no-load-optim --no-load-rng)
    pretrain_on_gpu0 "$nproc" "$ours" "${TE_MODEL[@]}" "$@" "${PARALLEL[@]}" "${TE_OURS[@]}" "${from_init[@]}"
    rc=$?
    pretrain_on_gpu0 "$nproc" "$reference" "${TE_MODEL[@]}" "$@" \
        --pipeline-model-parallel-size 2 --pipeline-schedule 1f1b "${from_init[@]}"
    ref_rc=$?
    local got want agree
    got=$(lm_losses "$ours" | paste -sd' ') want=$(lm_losses "$reference" | paste -sd' ')
    echo "lm loss, dualpipev: $got"
    echo "lm loss, 1F1B:      $want"
    agree=$("$PY" - "$got" "$want" "$tolerance" <<'EOF'
import sys
got, want = (list(map(float, a.split())) for a in sys.argv[1:3])
rel = float(sys.argv[3])
print(int(len(got) == len(want) == 3 and all(abs(g - w) <= rel * abs(w) for g, w in zip(got, want))))
EOF
)
    if [[ $rc == 0 && $ref_rc == 0 && "$agree" == 1 ]]; then
        record "$section" PASS "NCCL $NCCL, $nproc ranks: lm loss of iterations 2-4 equal to 1F1B's to $tolerance"
    else
        show_tail "$SCRATCH/$section.init.log" 20
        show_tail "$ours" 30
        [[ $ref_rc == 0 ]] || show_tail "$reference" 30
        record "$section" FAIL "exit status $rc (1F1B $ref_rc); lm loss $got against 1F1B's $want"
    fi
}

header "te_pp2"
TE_OURS=()
te_against_1f1b te_pp2 2 1e-4

header "te_fp8"
# FP8 GEMMs (E4M3 forward, E5M2 gradients) with per-tensor current scaling: no amax history, so the
# schedules' other order of micro-batches cannot change a scale; Hopper or newer.
fp8_ok=$("$PY" -c "import torch; print(int(torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)))" 2>/dev/null)
if [[ -z "$TE_SKIP" && "$fp8_ok" != 1 ]]; then
    record te_fp8 SKIP "FP8 needs compute capability 8.9 or newer"
else
    te_against_1f1b te_fp8 2 1e-3 --fp8-format hybrid --fp8-recipe tensorwise
fi

header "te_wgrad"
# --delay-wgrad-compute: TE's linears queue each weight GEMM for our W ops, which needs the MoE F&B
# overlap, so an MoE at EP=2 x PP=2: 4 ranks, and NCCL puts at most two on one GPU.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c "^GPU")
if [[ -z "$TE_SKIP" && "${gpus:-0}" -lt 2 ]]; then
    record te_wgrad SKIP "needs 4 ranks (an MoE at EP=2 x PP=2; NCCL allows two ranks per GPU): 2 GPUs, found ${gpus:-0}"
else
    MOE_WGRAD=(--num-experts 4 --moe-router-topk 2 --moe-token-dispatcher-type alltoall --moe-grouped-gemm
               --expert-model-parallel-size 2 --disable-bias-linear --global-batch-size 8)
    TE_OURS=(--overlap-moe-expert-parallel-comm --delay-wgrad-compute)
    PIN_GPU0=(--no-python bash -c 'LOCAL_RANK=$(( LOCAL_RANK % 2 )) exec "$0" "$@"' "$PY")
    te_against_1f1b te_wgrad 4 1e-4 "${MOE_WGRAD[@]}"
    PIN_GPU0=(--no-python bash -c 'LOCAL_RANK=0 exec "$0" "$@"' "$PY")
fi

# -- profile: the Megatron sections' profiler traces read back ------------------------------------
header "profile"
status_of() {  # status_of SECTION: its recorded PASS/FAIL/SKIP, or nothing
    local i
    for i in "${!SECTIONS[@]}"; do [[ "${SECTIONS[$i]}" == "$1" ]] && echo "${STATUSES[$i]}"; done
}
# check_profile JSON SECTION: one line per rank, then "ok" or the problems; fails unless every rank
# has what this mode gives (GPU: kernels, NCCL communication, and in the dualpipev run GPU time
# inside our op ranges; CPU dry run: host-side times of our op ranges).
check_profile() {
    "$PY" - "$1" "$2" "$DRY_RUN" <<'EOF'
import json, sys
path, section, dry = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
problems = []
for r in json.load(open(path))["ranks"]:
    ours = [p for n, p in r["phases"].items() if n.startswith("dualpipe ")]
    if dry:
        print(f"rank {r['rank']}: CPU trace, host window {r['window_ms']:.1f} ms, {len(ours)} dualpipe op ranges")
        if r["gpu"]:
            problems.append(f"rank {r['rank']}: GPU events in a CPU run")
    else:
        print(f"rank {r['rank']}: window {r['window_ms']:.2f} ms, compute {r['compute_ms']:.2f} ms, "
              f"communication {r['communication_ms']:.2f} ms (exposed {r['exposed_communication_ms']:.2f} ms), "
              f"{r['gpu_events']} GPU events ({r['unlinked_events']} unlinked), streams "
              + ", ".join(f"{s['id']} {s['kind']} {s['busy_ms']:.2f} ms" for s in r["streams"]))
        if not r["gpu"]:
            problems.append(f"rank {r['rank']}: no GPU events in the trace")
        elif r["communication_ms"] <= 0:
            problems.append(f"rank {r['rank']}: no kernel recognised as communication (NCCL)")
        if section == "megatron_pp2" and sum(p["compute_ms"] for p in ours) <= 0:
            problems.append(f"rank {r['rank']}: no GPU compute inside the dualpipe op ranges")
    if section == "megatron_pp2" and not ours:
        problems.append(f"rank {r['rank']}: no dualpipe op ranges")
print("; ".join(problems) or "ok")
sys.exit(1 if problems else 0)
EOF
}
for section in megatron_pp2 megatron_eplb; do
    name="profile_${section#megatron_}"
    traces="$PROFILE_DIR/$section/torch_profile"
    ran=$(status_of "$section")
    if ! compgen -G "$traces/rank-*.json.gz" >/dev/null; then
        if [[ -z "$ran" || "$ran" == SKIP ]]; then record "$name" SKIP "$section did not run"
        else record "$name" FAIL "$section ran ($ran) but wrote no profiler trace in $traces"; fi
        continue
    fi
    log="$PROFILE_DIR/$section.txt"
    figure=(--figure "$PROFILE_DIR/$section.png")
    if [[ "$DRY_RUN" == 1 ]]; then figure=(); fi  # a CPU trace has no GPU streams to draw
    if run_limited "$PROFILE_TIMEOUT" "$log" "$PY" -m dualpipe_megatron.trace profile "$traces" \
            --json "$PROFILE_DIR/$section.json" "${figure[@]}"; then
        summary=$(check_profile "$PROFILE_DIR/$section.json" "$section")
        rc=$?
        echo "$summary"
        if [[ $rc == 0 ]]; then
            record "$name" PASS "$(ls "$traces" | wc -l) rank traces of $section read: $(echo "$summary" | head -n 1)"
        else
            show_tail "$log"
            record "$name" FAIL "trace profile of $section: $(echo "$summary" | tail -n 1)"
        fi
    else
        rc=$?; show_tail "$log"
        record "$name" FAIL "trace profile of $section: $(why_failed $rc "$PROFILE_TIMEOUT")"
    fi
done

# -- calibrate: op costs from the dualpipev run's GPU profile (projection calibrate) -------------
# Our op ranges hold one chunk each: 4 layers over dualpipev's 4 stages at PP=2 is 1 layer a chunk.
# The traced layer is a dense GPT (its op ranges' communication is pipeline p2p), not the MLA + MoE
# shape the file records (preset tiny at hidden 256, sequence 256): the ms are the GPU's, rescaling
# them to another shape is approximate. Output: $PROFILE_DIR/op_costs_calibrated.json (bundled).
# The CPU dry run's trace has host times only, which calibrate must refuse by name.
header "calibrate"
log="$PROFILE_DIR/calibrate.txt"
if [[ "$(status_of profile_pp2)" != PASS ]]; then
    record calibrate SKIP "profile_pp2 did not pass"
elif run_limited "$PROFILE_TIMEOUT" "$log" "$PY" -m dualpipe_megatron.projection calibrate \
        "$PROFILE_DIR/megatron_pp2/torch_profile" --layers-per-chunk 1 --preset tiny --hidden 256 \
        --seq 256 -o "$PROFILE_DIR/op_costs_calibrated.json"; then
    cat "$log"
    if [[ "$DRY_RUN" == 1 ]]; then record calibrate FAIL "a CPU trace was calibrated (it has no GPU kernels)"
    else record calibrate PASS "$(head -n 1 "$log")"; fi
else
    rc=$?; show_tail "$log"
    if [[ "$DRY_RUN" == 1 ]] && grep -q "no GPU kernels" "$log"; then
        record calibrate SKIP "CPU dry run: calibrate refused the host-only trace as it should"
    else record calibrate FAIL "projection calibrate of megatron_pp2: $(why_failed $rc "$PROFILE_TIMEOUT")"; fi
fi

# -- bundle: everything under $PROFILE_DIR but tensorboard folders, in one archive ---------------
if [[ -n "$(ls -A "$PROFILE_DIR")" ]]; then
    bundle="$OUT_DIR/profile.tar.gz"
    tar -czf "$bundle" -C "$PROFILE_DIR" --exclude=tb .
    if (( $(stat -c %s "$bundle") > 15 * 1024 * 1024 )); then  # the device tool brings back 16 MiB a file
        tar -czf "$bundle" -C "$PROFILE_DIR" --exclude=tb --exclude='*.json.gz' .
        echo "profile.tar.gz: the raw traces left out (over 15 MiB with them)"
    fi
    echo "profile.tar.gz: $(tar -tzf "$bundle" | grep -cv '/$') files, $(( $(stat -c %s "$bundle") / 1024 )) KiB"
fi

# -- summary ----------------------------------------------------------------------------------------
header "summary"
failed=0
{
    printf '%-15s %-5s %s\n' section result reason
    for i in "${!SECTIONS[@]}"; do
        printf '%-15s %-5s %s\n' "${SECTIONS[$i]}" "${STATUSES[$i]}" "${REASONS[$i]}"
    done
} | tee "$OUT_DIR/summary.txt"
for s in "${STATUSES[@]}"; do [[ "$s" == FAIL ]] && failed=1; done
echo "overall: $([[ $failed == 0 ]] && echo 'no FAIL' || echo FAIL) (logs in $OUT_DIR)"
exec >&- 2>&-
wait "$TEE_PID" 2>/dev/null  # let tee finish the log before returning
exit "$failed"
