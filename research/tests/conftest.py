"""The research scripts import as top-level modules, as they do when run from research/."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
