"""Op traces of pipeline runs: record (``OpTracer``), merge to Chrome/Perfetto, analyse and draw.

Heavier parts (Matplotlib) load only when used; see ``python -m dualpipe_megatron.trace --help``.
"""

from .analysis import PipelineReport, StepBubbles, analyze
from .chrome import chrome_trace, write_chrome_trace
from .records import RankTrace, TraceError, load, pipelines
from .recorder import OpTracer

__all__ = ["OpTracer", "PipelineReport", "RankTrace", "StepBubbles", "TraceError", "analyze",
           "chrome_trace", "load", "pipelines", "write_chrome_trace"]
