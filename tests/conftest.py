import os
import sys
from pathlib import Path

# Test helpers (contract_checker, worker modules) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))

from launcher import STRICT_ENV  # noqa: E402 - found through the path above

# Every multi-rank test runs in strict mode: each pipeline step's p2p calls (and the
# collectives issued during it) are checked against the model of NCCL's semantics, and a
# step that could deadlock on NCCL fails (dualpipe_megatron/runtime/strict.py). The launcher
# gives it to every rank it starts; this process has it too.
os.environ.setdefault(STRICT_ENV, "1")

# The Transformer Engine and Megatron-Bridge tiers run apart, in their venvs: scripts/tier.sh.
collect_ignore = ["te", "bridge"]
