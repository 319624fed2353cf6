"""Stage score_drafter: each drafter's offline acceptance length (tau) on the extracted hidden states.

`python -m specops.score --plan|--run` runs the stage (stage.py). The modules, in the order a run
uses them: request (options), inputs (what is read before any model loads), stage (plan, run, the
diagnostics), scorer (models loaded, the engine run for each drafter), result and writing (the
reports). The engine and what it runs on: acceptance (the batched walk), sequential_acceptance (its
plain reference, one block at a time), leading_matches (drafts against the target's tokens),
margins (how close a draft came to flipping), drafter with drafter_ops and block_attention (the
DFlash drafter), kernels (Triton kernels for the head's argmax, SiLU-and-mul and the q/k norms with
RoPE, beside their torch references; off unless switched on), dflash_config (its settings, read
without torch), target_head (the target's embedding and lm_head), step_timer (where a step's time
goes).

Only the stage's entry points are importable from here; torch is imported by the engine's modules
alone, so the control node can import this package.
"""

from specops.score.request import REQUEST, STAGE, parse_request
from specops.score.stage import main, plan, run

__all__ = ["REQUEST", "STAGE", "main", "parse_request", "plan", "run"]
