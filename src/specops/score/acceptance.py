"""Offline acceptance length (tau) of a DFlash drafter under greedy decoding.

Under temperature 0 the target's continuation is fixed, so speculative decoding can be replayed
offline from the target's tokens and hidden states. For one sequence:

- input_ids [L]: prompt (positions 0..P-1) then the target's output (positions P..L-1). The token at
  P is the target's first output, produced by the prefill, before any drafting.
- features [L, n, hidden]: the target's hidden states at the drafter's target_layer_ids (layer k is
  HF `hidden_states[k + 1]`), the caller selecting the columns.

The walk (what z-lab's generate loop does, with the target's tokens in place of its verify pass):

    s = P                                # the last verified token
    while s < L - 1:                     # a target token remains after s
        r = L - 1 - s                    # target tokens remaining after s
        drafts d_1..d_{bs-1} for s+1..s+bs-1, from the block [ids[s], MASK x (bs-1)] at positions
            s..s+bs-1 with context = features at positions 0..s-1
        k = number of leading j (1 <= j <= min(bs-1, r)) with d_j == ids[s+j]
        a = min(k + 1, r)                # accepted drafts + the bonus token, never past the end
        record (s, a); s += a

The sum of a over the steps is L - 1 - P (every output token after the prefill's). At the last step
the bonus token would lie past the completion (it ended at EOS or at its length limit), so the
length is capped at what remains, as z-lab's loop does. The blocks always have full size (SGLang's
behaviour; z-lab's loop shortens the very last block of a length-limited completion instead).

tau of a sequence = mean of its acceptance lengths = (L - 1 - P) / steps. tau over many sequences
(`overall_tau`) = total accepted tokens / total steps, i.e. weighted by steps, which is what
SGLang's aggregate counters give; the mean of per-sequence taus weights every sequence equally
and is a different number.

Two ways to get the drafts, same walk:
- `mode="frontier"` (default): one block per sequence per batched forward, for all sequences of a
  group at once, drafting only the blocks the walk visits (about (L - P) / tau per sequence).
- `mode="all-anchors"`: the drafts at every position, many anchors per sequence per forward, then
  the walk on the CPU. tau times more drafting, in far fewer, larger forwards.
Both batch across sequences in groups sized by a memory budget. The plain reference beside this
engine is `specops.score.sequential_acceptance`: one sequence, one block at a time, the context K/V
cached and grown as tokens are accepted; the tests hold the engine to it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import torch

from specops.score import block_attention
from specops.score.drafter import DFlashDrafter
from specops.score.leading_matches import leading_matches
from specops.score.split_walks import SplitWalks
from specops.score.step_timer import NoTimer, StepTimer
from specops.score.streamed_context import StreamedContext, walk_stream
from specops.score.target_head import TargetHead
from specops.score.trunk_graph import TrunkGraph

MODES = ("frontier", "all-anchors")
DEFAULT_MODE = "frontier"
# On the CPU a group may take this share of the host's available memory (at least CPU_MEMORY_BUDGET):
# the larger the group, the fewer times each step reads the head and the drafter's weights.
CPU_MEMORY_SHARE = 0.5
CPU_MEMORY_BUDGET = 2 << 30
MAX_ANCHORS_PER_FORWARD = 128
# Where the attention writes no scores, a group's resident memory may take this share of the budget (the
# rest: one forward's activations, the head's logits, the allocator's slack). At the real shape a group of
# 256 completions peaked at 33 GiB on the H200 with the models
# (benchmarks/score_real_h200_2026-12-06_38c49d0.json), while halving the budget split it in two on an
# 80 GB H100 (367 forwards against 185).
FUSED_SHARE = 0.8
# Devices where the frontier fills its batch with walks started inside the longest ranges as walks end
# (`specops.score.split_walks`). Built for GPUs, where a forward over a few blocks costs nearly what a
# full one does. Measured on the H200 at the real shape (benchmarks/score_real_h200.json,
# score_real_h200_2026-12-06_38c49d0.json and score_real_h200_2026-12-06.json, "engine, walks_split"):
# 176 forwards against 185 and no time saved (51.7 against 53.1 completions/s; 45.9 against 47.4; 40.6
# against 40.9), since one group of 256 completions leaves little tail there; so none. A CPU's cost
# follows its rows, so the steps a split adds would only cost there.
SPLIT_DEVICES: tuple[str, ...] = ()
# The frontier's ended walks leave its batch once they are this share of it: a gather of the context K/V
# costs a fraction of one step, while every ended row in the batch costs a full block; and the trunk's
# graph is dropped at the first change of shape (`trunk_graph`). benchmarks/score_real_h200.py measures a
# sixteenth and a quarter beside it ("leave_at_sixteenth", "leave_at_quarter").
ENDED_SHARE = 1 / 8


# ----------------------------------------------------------------------------------------------
# Inputs and results
# ----------------------------------------------------------------------------------------------


@dataclass
class SequenceInput:
    """One completion: ids [L] (prompt + output), features [L, n, hidden], prompt length P."""

    id: str
    input_ids: torch.Tensor
    features: torch.Tensor
    prompt_len: int

    def validate(self, drafter: DFlashDrafter) -> None:
        L = self.input_ids.shape[0]
        n, hidden = len(drafter.target_layer_ids), drafter.hidden_size
        if self.input_ids.dim() != 1:
            raise ValueError(
                f"sequence {self.id}: input_ids must be 1-D [L], got {tuple(self.input_ids.shape)}"
            )
        if tuple(self.features.shape) != (L, n, hidden):
            raise ValueError(
                f"sequence {self.id}: features are {tuple(self.features.shape)}, expected "
                f"[{L}, {n}, {hidden}] (tokens, the drafter's {n} target layers, hidden size)"
            )
        if not 1 <= self.prompt_len <= L:
            raise ValueError(
                f"sequence {self.id}: prompt_len {self.prompt_len} outside 1..{L} (the sequence length)"
            )


def as_input(item: Any) -> SequenceInput:
    """A SequenceInput from itself, a mapping or any object with id/input_ids/features/prompt_len."""
    if isinstance(item, SequenceInput):
        return item
    get = item.__getitem__ if isinstance(item, Mapping) else lambda key: getattr(item, key)
    ids = torch.as_tensor(get("input_ids"), dtype=torch.long)
    return SequenceInput(str(get("id")), ids, torch.as_tensor(get("features")), int(get("prompt_len")))


@dataclass
class SequenceAcceptance:
    """The walk of one sequence: the acceptance length and the block start of every step."""

    id: str
    block_size: int
    accept_lengths: list[int] = field(default_factory=list)
    block_starts: list[int] = field(default_factory=list)

    @property
    def steps(self) -> int:
        return len(self.accept_lengths)

    @property
    def accepted_tokens(self) -> int:
        return sum(self.accept_lengths)

    @property
    def tau(self) -> float | None:
        """Mean acceptance length over the steps; None for a sequence with no step."""
        return self.accepted_tokens / self.steps if self.steps else None

    def histogram(self) -> list[int]:
        """counts[i] = number of steps of acceptance length i + 1, for lengths 1..block_size."""
        counts = [0] * self.block_size
        for n in self.accept_lengths:
            counts[n - 1] += 1
        return counts

    def acceptance_by_position(self) -> list[float]:
        """[j - 1] = fraction of steps whose length exceeded j, i.e. draft j was accepted (j = 1..bs-1)."""
        if not self.steps:
            return [0.0] * (self.block_size - 1)
        return [sum(n > j for n in self.accept_lengths) / self.steps for j in range(1, self.block_size)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "block_size": self.block_size,
            "accept_lengths": list(self.accept_lengths),
            "block_starts": list(self.block_starts),
            "tau": self.tau,
        }


def overall_tau(results: Iterable[SequenceAcceptance]) -> float | None:
    """Total accepted tokens / total steps over all sequences (step-weighted); None without steps."""
    results = list(results)
    steps = sum(r.steps for r in results)
    return sum(r.accepted_tokens for r in results) / steps if steps else None


def walk(
    prompt_len: int, length: int, block_size: int, match_run: Callable[[int], int]
) -> tuple[list[int], list[int]]:
    """The speculative walk (see the module docstring); match_run(s) = leading matches of block s.

    Returns (accept_lengths, block_starts).
    """
    lengths, starts = [], []
    s = prompt_len
    while s < length - 1:
        remaining = length - 1 - s
        k = min(match_run(s), block_size - 1, remaining)
        a = min(k + 1, remaining)
        lengths.append(a)
        starts.append(s)
        s += a
    return lengths, starts


def walks_from_steps(
    records: Iterable[tuple[int, int, int]], prompts: list[int], lengths: list[int], block_size: int
) -> list[tuple[list[int], list[int]]]:
    """Each sequence's walk (`walk`) from the steps its walks took: (sequence, start, accept length)
    records in any order, a position's step recorded once or more (always the same), 0 for a row that
    took none. Returns (accept_lengths, block_starts) per sequence."""
    steps: dict[int, dict[int, int]] = {b: {} for b in range(len(prompts))}
    for sequence, start, accepted in records:
        if accepted > 0:
            steps[sequence].setdefault(start, accepted)

    def match_run(b: int, s: int) -> int:
        if s not in steps[b]:
            raise RuntimeError(f"no step recorded at position {s} of sequence {b}: the walks left a gap")
        return steps[b][s] - 1  # the step's accepted drafts (walk adds the bonus token back)

    return [walk(prompts[b], lengths[b], block_size, partial(match_run, b)) for b in range(len(prompts))]


def walks_in_order(records: list[torch.Tensor], sequences: int) -> list[tuple[list[int], list[int]]]:
    """Each sequence's walk from the steps of one walk a sequence: records [3, B] per forward (sequence,
    start, accept length; 0 for a row that took no step) in forward order, so a sequence's steps in
    order are its walk. Sorted on the device, read back once: a Python walk over every step took tens
    of milliseconds at the real shape, the device idle meanwhile."""
    if not records:
        return [([], []) for _ in range(sequences)]
    taken = torch.cat(records, dim=1)
    taken = taken[:, taken[2] > 0]
    order = torch.sort(taken[0], stable=True).indices
    _, starts, accepted = taken[:, order].tolist()
    counts = torch.bincount(taken[0], minlength=sequences).tolist()
    walks, first = [], 0
    for count in counts:
        walks.append((accepted[first : first + count], starts[first : first + count]))
        first += count
    return walks


# ----------------------------------------------------------------------------------------------
# The batched engine
# ----------------------------------------------------------------------------------------------


def _run_at(row: list[int], prompt_len: int, start: int) -> int:
    """The match run of the block at start, from a row that begins at the prompt's end."""
    return row[start - prompt_len]


def _elem(dtype: torch.dtype) -> int:
    return torch.finfo(dtype).bits // 8


def _sequence_bytes(drafter: DFlashDrafter, length: int) -> int:
    """Resident memory of one sequence in a group: features, context and its K/V in every layer."""
    cfg, attn = drafter.config, drafter.decoder_layers[0].self_attn
    kv = 2 * attn.num_kv_heads * attn.head_dim * len(drafter.decoder_layers)
    per_token = kv + (len(drafter.target_layer_ids) + 1) * cfg.hidden_size
    return length * per_token * _elem(drafter.fc.weight.dtype)


def _block_bytes(drafter: DFlashDrafter, context_len: int, scores: bool = True) -> int:
    """Working memory of drafting one block: activations, and fp32 attention scores and their copies
    where the attention writes them out (scores)."""
    cfg = drafter.config
    bs = drafter.block_size
    activations = bs * (3 * cfg.intermediate_size + 8 * cfg.hidden_size) * _elem(drafter.fc.weight.dtype)
    if not scores:
        return activations
    return activations + cfg.num_attention_heads * bs * (context_len + bs) * (
        12 + _elem(drafter.fc.weight.dtype)
    )


def writes_scores(device: torch.device, mode: str) -> bool:
    """Whether the attention of this mode on this device writes its scores out: the reference kernel does
    (several blocks a sequence, the all-anchors mode; or chosen), and the CPU's fused kernel may; a GPU's
    fused kernels (the frontier's one block a sequence) never do."""
    return mode != "frontier" or device.type != "cuda" or block_attention.KERNEL == "reference"


def available_host_memory(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (the kernel's estimate of what can be taken without swapping), or None."""
    try:
        with open(meminfo) as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_memory_budget(device: torch.device) -> int:
    """70% of the GPU's free memory; on the CPU, CPU_MEMORY_SHARE of the host's available memory
    (at least CPU_MEMORY_BUDGET, which is also the budget where the host does not say)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * 0.7)
    available = available_host_memory()
    return max(CPU_MEMORY_BUDGET, int(CPU_MEMORY_SHARE * available)) if available else CPU_MEMORY_BUDGET


class SequenceGroup:
    """Sequences drafted together: padded ids, lengths and the context K/V of every layer."""

    def __init__(
        self,
        drafter: DFlashDrafter,
        head: TargetHead,
        items: list[SequenceInput],
        timer: StepTimer | NoTimer | None = None,
    ):
        self.drafter, self.head = drafter, head
        self.timer = timer or NoTimer()
        device = head.device
        bs = drafter.block_size
        self.lengths = torch.tensor([it.input_ids.shape[0] for it in items], device=device)
        self.prompts = torch.tensor([it.prompt_len for it in items], device=device)
        self.longest_prompt = max(it.prompt_len for it in items)
        longest = int(self.lengths.max())
        with self.timer.span("inputs"):
            # -1 past the end never equals a draft, so a block reaching past the completion stops matching.
            # Padded on the host and copied once: one small copy a completion would cost a launch each.
            ids = torch.full((len(items), longest + bs), -1, dtype=torch.long)
            for b, it in enumerate(items):
                ids[b, : it.input_ids.shape[0]] = it.input_ids
            self.ids = ids.to(device)
            # Spare slots after the context, where a kernel writes a step's block keys (block_attention).
            self.context = StreamedContext(drafter, [it.features for it in items], longest, device)
            self.context_len = longest
        self.offsets = torch.arange(1, bs, device=device)
        self.trunk = TrunkGraph(self._trunk)

    def _trunk(self, anchors: torch.Tensor, starts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`DFlashDrafter.trunk` for the blocks at starts [B, m] of anchor tokens anchors [B, m]."""
        embeds = self.drafter.block_embeddings(self.head.embed, anchors.clamp_min(0))
        return self.drafter.trunk(
            embeds, starts, self.context.buffers, self.context_len, mask_rows_alike=True
        )

    def select(self, index: torch.Tensor) -> None:
        self.lengths, self.prompts, self.ids = self.lengths[index], self.prompts[index], self.ids[index]
        self.context.select(index)

    def match_runs(self, starts: torch.Tensor, reach: int | None = None) -> torch.Tensor:
        """Leading matches (0..bs-1) of the drafts of the blocks at starts [B, m] against the target.

        reach: no block starts after it (known on the host, so no sync); None: anywhere."""
        drafter, head, timer = self.drafter, self.head, self.timer
        B, m = starts.shape
        anchors = self.ids.gather(1, starts)
        with timer.span("context"):
            self.context.ensure(self.context_len if reach is None else reach)
        with timer.span("drafter"):
            residual, mixed = self.trunk(anchors, starts, self.context.buffers)
        # Draft positions 1..bs-1, one row per block; the rest of the last layer runs per head pass,
        # on the blocks and positions the pass needs.
        # Views: each pass gathers just the rows it needs.
        residual = residual.flatten(0, 1)[:, 1:]
        mixed = mixed.flatten(0, 1)[:, 1:]

        def draft_states(rows: torch.Tensor, first: int, last: int) -> torch.Tensor:
            with timer.span("last layer"):
                return drafter.finish(
                    residual[:, first:last].index_select(0, rows),
                    mixed[:, first:last].index_select(0, rows),
                    owned=True,
                )

        targets = self.ids.gather(1, (starts[..., None] + self.offsets).view(B, -1))
        runs = leading_matches(
            head,
            draft_states,
            targets.view(B * m, -1),
            drafter.output_multiplier,
            drafter.logit_softcap,
            timer=timer,
        )
        return runs.view(B, m)


def group_indices(
    drafter: DFlashDrafter, items: list[SequenceInput], budget: int, scores: bool = True
) -> list[list[int]]:
    """Indices of sequences per group, longest first, each group's resident memory and working set within
    budget / 2 where the attention writes scores out (their transient copies take the rest), within
    FUSED_SHARE of it where it does not (`writes_scores`)."""
    limit = budget // 2 if scores else int(budget * FUSED_SHARE)
    order = sorted(range(len(items)), key=lambda i: -items[i].input_ids.shape[0])
    groups: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = items[current[0]].input_ids.shape[0] if current else items[i].input_ids.shape[0]
        per_sequence = _sequence_bytes(drafter, longest) + _block_bytes(drafter, longest, scores)
        need = (len(current) + 1) * per_sequence
        if current and need > limit:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups


def _frontier(group: SequenceGroup, ids_of: list[int], results: dict[int, SequenceAcceptance]) -> None:
    """Walk all sequences of the group in lockstep: one block per walk per forward; on devices in
    SPLIT_DEVICES, walks started inside the longest ranges fill the batch as walks end
    (`specops.score.split_walks`)."""
    device = group.lengths.device
    prompts, lengths = group.prompts.tolist(), group.lengths.tolist()
    starts = group.prompts.clone()
    sequence = torch.arange(len(ids_of), device=device)
    last = group.lengths - 1  # a walk goes on while its start is before its last position
    walking = starts < last
    splits = SplitWalks(starts, group.lengths, group.ids.shape[1]) if device.type in SPLIT_DEVICES else None
    records: list[torch.Tensor] = []
    while True:
        n_walking = int(walking.sum())
        if n_walking == 0:
            break
        # Ended walks leave the batch once they are ENDED_SHARE of it.
        if n_walking <= starts.shape[0] * (1 - ENDED_SHARE):
            keep = walking.nonzero().squeeze(1)
            if splits is None:
                index, starts, sequence = keep, starts[keep], sequence[keep]
            else:
                index, starts = splits.refill(keep, starts)
                sequence = splits.sequence
            group.select(index)
            last = group.lengths - 1
            walking = torch.ones_like(starts, dtype=torch.bool)
        remaining = last - starts
        # A step moves a block forward by a block at most: no start is past this bound (a walk started
        # inside a range exists only after a `select`, which computes the whole context).
        reach = group.longest_prompt + len(records) * group.drafter.block_size
        runs = group.match_runs(starts[:, None], reach)[:, 0]
        # The accepted drafts and the bonus token, never past the end; none where the walk has ended. In
        # place where it can: the device idles while the host launches these, so the fewer the better.
        a = torch.minimum(runs + 1, remaining).mul_(walking)
        records.append(torch.stack([sequence, starts, a]))
        starts = starts + a
        walking = walking & (starts < last)
        if splits is not None:
            walking = splits.land(starts, walking)
    if splits is None:
        walks = walks_in_order(records, len(prompts))
    else:
        taken = torch.cat(records, dim=1).T.tolist() if records else []
        walks = walks_from_steps(taken, prompts, lengths, group.drafter.block_size)
    for b, (accept, block_starts) in enumerate(walks):
        results[ids_of[b]].accept_lengths, results[ids_of[b]].block_starts = accept, block_starts


def _all_anchors(
    group: SequenceGroup, ids_of: list[int], results: dict[int, SequenceAcceptance], budget: int
) -> None:
    """Drafts at every anchor P..L-2 of every sequence, m anchors per sequence per forward, then walk."""
    drafter = group.drafter
    device = group.lengths.device
    B = len(ids_of)
    span = int((group.lengths - 1 - group.prompts).clamp_min(0).max())
    longest = group.ids.shape[1]
    resident = B * _sequence_bytes(drafter, longest)
    per_slot = B * _block_bytes(drafter, longest)
    # Half the budget for the working set (attention scores have transient copies); beyond ~128
    # anchors per sequence the matmuls are saturated and larger chunks only cost memory.
    m = int(max(1, min(span, MAX_ANCHORS_PER_FORWARD, (budget // 2 - resident) // max(1, per_slot))))
    runs = torch.zeros(B, max(span, 1), dtype=torch.long)
    last = (group.lengths - 2).clamp_min(0)
    for first in range(0, span, m):
        slots = torch.arange(first, min(first + m, span), device=device)
        # Slots past a sequence's last anchor draft a harmless block at its last anchor instead.
        starts = torch.minimum(group.prompts[:, None] + slots, last[:, None])
        runs[:, first : first + slots.shape[0]] = group.match_runs(starts).cpu()
    lengths, prompts = group.lengths.tolist(), group.prompts.tolist()
    for b, owner in enumerate(ids_of):
        match_run = partial(_run_at, runs[b].tolist(), prompts[b])
        accept, starts_ = walk(prompts[b], lengths[b], drafter.block_size, match_run)
        results[owner].accept_lengths, results[owner].block_starts = accept, starts_


@torch.inference_mode()
def offline_acceptance(
    drafter: DFlashDrafter,
    head: TargetHead,
    sequences: Iterable[Any],
    mode: str = DEFAULT_MODE,
    memory_budget_bytes: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    timer: StepTimer | None = None,
) -> list[SequenceAcceptance]:
    """Acceptance lengths of the drafter along every sequence (the walk in the module docstring).

    sequences: SequenceInput, or mappings / objects with id, input_ids [L], features [L, n, hidden],
    prompt_len. Runs on head.device (the drafter must be there too). memory_budget_bytes bounds what
    a group of sequences and its working set take (default: `default_memory_budget`).
    progress(done, total) is called after each group; timer (a StepTimer) records where the time
    goes. Results come back in input order.
    """
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {list(MODES)}")
    items = [as_input(s) for s in sequences]
    for it in items:
        it.validate(drafter)
    budget = memory_budget_bytes or default_memory_budget(head.device)
    results = {i: SequenceAcceptance(it.id, drafter.block_size) for i, it in enumerate(items)}
    done = 0
    # Where the context's K/V are computed ahead on a side stream, the walk takes a stream that goes first.
    stream = walk_stream(head.device)
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(head.device))
    with torch.cuda.stream(stream):
        for indices in group_indices(drafter, items, budget, writes_scores(head.device, mode)):
            group = SequenceGroup(drafter, head, [items[i] for i in indices], timer)
            with group.timer.span("steps"):
                if mode == "frontier":
                    _frontier(group, indices, results)
                else:
                    _all_anchors(group, indices, results, budget)
            group.context.release()
            del group
            done += len(indices)
            if progress is not None:
                progress(done, len(items))
    if stream is not None:
        torch.cuda.current_stream(head.device).wait_stream(stream)
    return [results[i] for i in range(len(items))]
