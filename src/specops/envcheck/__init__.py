"""Stage envcheck: what the ML environment can really run (imports, GPUs, fla's kernel against torch).

`python -m specops.envcheck --plan|--run` runs the stage (stage.py: its options, report, plan and
run). The modules: facts (the Python, libraries and GPUs), kernel (fla's gated delta rule against
transformers' torch reference), decision (the backend the facts allow). torch is imported lazily:
`decide` and the constants are usable without it.
"""

from specops.envcheck.decision import FLA_CRASH_WARNING, FLA_NOT_USABLE_NOTE, decide
from specops.envcheck.facts import torch_reference
from specops.envcheck.kernel import compare_gdr, normalize_sizes
from specops.envcheck.stage import main, parse_request, plan, run

__all__ = [
    "FLA_CRASH_WARNING",
    "FLA_NOT_USABLE_NOTE",
    "compare_gdr",
    "decide",
    "main",
    "normalize_sizes",
    "parse_request",
    "plan",
    "run",
    "torch_reference",
]
