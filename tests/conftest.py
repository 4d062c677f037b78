import sys
from pathlib import Path

# Test helpers (contract_checker, worker modules) import as top-level modules.
sys.path.insert(0, str(Path(__file__).parent))
