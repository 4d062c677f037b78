# One-command setup, tests, demo and benchmarks. Everything runs from .venv (Python 3.12).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup setup-te setup-bridge test test-bridge demo bench nccl-sweep gpu-check clean

setup: $(STAMP)

# Reinstalls whenever the pinned requirements or the package metadata change.
$(STAMP): requirements.txt pyproject.toml
	@test -x $(PY) || { py=$$(scripts/find_python312.sh) && $$py -m venv $(VENV); }
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	$(PY) -m pip install -q --no-deps --no-build-isolation -e .
	@touch $(STAMP)

# The optional Transformer Engine tier's .venv-te over .venv (TE's torch binding built from its sdist
# once, about 10 minutes on 2 cores; from pip's wheel cache after that).
setup-te: setup
	bash scripts/setup_te.sh

# The optional Megatron-Bridge tier's .venv-bridge over .venv-te (requirements-bridge.txt).
setup-bridge: setup-te
	bash scripts/setup_bridge.sh

# The main suite, then the TE tier (tests/te), or one line saying why it is skipped.
test: setup
	$(PY) -m pytest -q
	bash scripts/tier.sh te

# Megatron-Bridge's pretrain() under our schedules against its own 1F1B (about 5 minutes).
test-bridge:
	bash scripts/tier.sh bridge

demo: setup
	$(PY) -m dualpipe_megatron.schedules compare --ranks 4 --microbatches 20 --W 0.8 --FB 2.5 --c 0.1
	@mkdir -p outputs
	$(PY) -m dualpipe_megatron.schedules draw --schedule dualpipev --ranks 4 --microbatches 10 -o outputs/dualpipev_p4_m10.png
	$(PY) -m dualpipe_megatron.demo

# Side by side on this machine, then the calibrated projection (measured op costs -> simulator).
bench: setup
	$(PY) bench/bench_megatron.py
	$(PY) bench/hybrid_moe_step.py
	$(PY) bench/budget_memory.py
	$(PY) bench/activation_estimate.py
	$(PY) bench/bench_runtime.py
	$(PY) bench/trace_overhead.py
	$(PY) bench/profiler_ranges_overhead.py
	$(PY) bench/eplb_balance.py
	$(PY) -m dualpipe_megatron.projection measure -o bench/results/cpu_op_costs.json
	$(PY) -m dualpipe_megatron.projection project --op-costs bench/results/cpu_op_costs.json \
		--tflops 400 --json bench/results/projection.json

# The runtime's real p2p posting logic for every schedule, P = 2..16, under the NCCL model
# (make test runs a reduced grid; see docs/nccl.md).
nccl-sweep: setup
	$(PY) -m dualpipe_megatron.runtime nccl-sweep

# Every GPU check in one run (one GPU, 10 minutes at most); `bash scripts/gpu_check.sh --cpu-dry-run` without one.
gpu-check:
	bash scripts/gpu_check.sh

clean:
	rm -rf $(VENV) .venv-te .venv-bridge outputs .pytest_cache .hypothesis
