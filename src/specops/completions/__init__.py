"""Stage completions: the target's own greedy tokens for every prompt, fetched from SGLang's /generate.

`python -m specops.completions --plan|--run` runs the stage (stage.py). The modules: request (the
options), prompts (the prompts and the target's tokenizer), client (the pooled HTTP client and its
retries), answer (an answer checked), records (the records on disk: partial file, final file),
stage (prepare, plan, the concurrent fetch, run).
"""

from specops.completions.client import MAX_BACKOFF_S, StageRetry
from specops.completions.prompts import load_prompts
from specops.completions.records import OUTPUT_NAME, PARTIAL_NAME, damaged_records
from specops.completions.request import REQUEST, STAGE, parse_request
from specops.completions.stage import main, plan, run

__all__ = [
    "MAX_BACKOFF_S",
    "OUTPUT_NAME",
    "PARTIAL_NAME",
    "REQUEST",
    "STAGE",
    "StageRetry",
    "damaged_records",
    "load_prompts",
    "main",
    "parse_request",
    "plan",
    "run",
]
