"""The names ``jaxserve.main --mode bench --workload W`` calls, kept where it
looks for them: the serving benchmark is ``serving_options`` (what to run),
``serving_run`` (the run) and ``python -m jaxserve.bench serve``."""

from jaxserve.bench.serving_options import FLAG_NAMES, BenchOptions, options_from_flags
from jaxserve.bench.serving_run import run

__all__ = ["FLAG_NAMES", "BenchOptions", "options_from_flags", "run"]
