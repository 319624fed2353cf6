"""Offline acceptance length: the walk, the batched engine, and the sequential oracle agree exactly."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import specops.score.acceptance as acceptance  # noqa: E402
import specops.score.split_walks as split_walks  # noqa: E402
import specops.score.streamed_context as streamed_context  # noqa: E402
from specops.fixtures.train_drafter import greedy_completions  # noqa: E402
from specops.score.acceptance import (  # noqa: E402
    SequenceAcceptance,
    SequenceInput,
    offline_acceptance,
    overall_tau,
    walk,
)
from specops.score.drafter import load_drafter  # noqa: E402
from specops.score.sequential_acceptance import SequentialDrafter, sequential_acceptance  # noqa: E402
from specops.score.step_timer import StepTimer  # noqa: E402
from specops.score.target_head import load_target_head  # noqa: E402

MODES = ("frontier", "all-anchors")


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny models: extra threads only contend on a shared machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def greedy_sequences(fixture_models):
    """The tiny target's greedy completions of the shipped prompts, with features at layers [1, 3, 5]."""
    layer_ids = load_drafter(fixture_models.drafter).target_layer_ids
    torch.set_num_threads(1)
    found = greedy_completions(fixture_models.target, fixture_models.prompts, layer_ids, 128)
    return [SequenceInput(f"p{i}", ids, features, prompt) for i, (ids, features, prompt) in enumerate(found)]


@pytest.fixture(scope="session")
def trained_drafter(trained_fixture_models):
    """The reference drafter trained on those completions (300 steps), built once for every suite."""
    return trained_fixture_models.reference_drafter


@pytest.fixture(scope="session")
def head(fixture_models):
    return load_target_head(fixture_models.target)


# ---- the walk --------------------------------------------------------------------------------------


def test_walk_accepts_the_leading_matches_plus_the_bonus_token():
    lengths, starts = walk(prompt_len=2, length=12, block_size=4, match_run=lambda s: 2)
    assert lengths == [3, 3, 3] and starts == [2, 5, 8]


def test_walk_caps_the_last_step_at_the_tokens_that_remain():
    lengths, starts = walk(prompt_len=2, length=10, block_size=8, match_run=lambda s: 7)
    assert lengths == [7] and starts == [2]


def test_walk_accepts_every_output_token_after_the_first_exactly_once():
    runs = {s: (s * 7) % 5 for s in range(100)}
    lengths, starts = walk(prompt_len=9, length=80, block_size=5, match_run=runs.__getitem__)
    assert sum(lengths) == 80 - 1 - 9
    assert [s + n for s, n in zip(starts, lengths, strict=True)] == starts[1:] + [79]


def test_walk_has_no_step_when_the_prefill_token_is_the_last():
    assert walk(prompt_len=5, length=6, block_size=4, match_run=lambda s: 3) == ([], [])


# ---- results ---------------------------------------------------------------------------------------


def test_histogram_and_acceptance_by_position_describe_the_steps():
    result = SequenceAcceptance("x", block_size=4, accept_lengths=[1, 4, 2, 4], block_starts=[0, 1, 5, 7])
    assert result.tau == 11 / 4
    assert result.histogram() == [1, 1, 0, 2]
    assert result.acceptance_by_position() == [3 / 4, 2 / 4, 2 / 4]
    assert result.to_dict()["accept_lengths"] == [1, 4, 2, 4]


def test_overall_tau_weights_sequences_by_their_steps():
    a = SequenceAcceptance("a", 4, [4, 4], [0, 4])
    b = SequenceAcceptance("b", 4, [1, 1, 1, 1, 1, 1], [0, 1, 2, 3, 4, 5])
    assert overall_tau([a, b]) == 14 / 8
    assert SequenceAcceptance("empty", 4).tau is None


# ---- drafts known by construction ------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("run", [0, 3, 7])
def test_drafts_that_match_run_tokens_give_tau_run_plus_one(fixture_models, head, monkeypatch, mode, run):
    # Every draft is token 7; the completion repeats [other, 7 x run], so every block accepts run + 1.
    drafter = load_drafter(fixture_models.drafter)
    monkeypatch.setattr(type(head), "argmax", lambda self, hidden, *a: torch.full(hidden.shape[:-1], 7))
    P, L = 5, 5 + 10 * (run + 1) + 1
    ids = torch.full((L,), 7)
    ids[P :: run + 1] = 9
    sequence = SequenceInput("c", ids, torch.randn(L, 3, drafter.hidden_size), P)
    result = offline_acceptance(drafter, head, [sequence], mode=mode)[0]
    assert result.accept_lengths == [run + 1] * 10
    assert result.block_starts == list(range(P, L - 1, run + 1))


def plant(drafter, head, sequence, run):
    """Overwrite the output so the drafter's own drafts match for `run` positions per block."""
    ids = sequence.input_ids.clone()
    loop = SequentialDrafter(drafter, head, sequence.features)
    s = sequence.prompt_len
    with torch.inference_mode():
        while s < len(ids) - 1:
            drafts = loop.drafts(int(ids[s]), s)
            for j in range(1, run + 2):
                if s + j < len(ids):
                    ids[s + j] = drafts[j - 1] if j <= run else (drafts[j - 1] + 1) % head.vocab_size
            s += run + 1
    return SequenceInput(sequence.id, ids, sequence.features, sequence.prompt_len)


@pytest.mark.parametrize("mode", MODES)
def test_tokens_planted_from_the_drafters_own_drafts_give_tau_run_plus_one(
    fixture_models, head, greedy_sequences, mode
):
    drafter = load_drafter(fixture_models.drafter)
    sequence = plant(drafter, head, greedy_sequences[0], run=4)
    result = offline_acceptance(drafter, head, [sequence], mode=mode)[0]
    remaining = len(sequence.input_ids) - 1 - sequence.prompt_len
    assert result.accept_lengths[:-1] == [5] * (result.steps - 1)
    assert sum(result.accept_lengths) == remaining


# ---- engine against the oracle -----------------------------------------------------------------------


def plant_runs(drafter, head, sequence, runs):
    """Overwrite the output so that the blocks the walk visits match for runs[0], runs[1], ... positions."""
    ids = sequence.input_ids.clone()
    loop = SequentialDrafter(drafter, head, sequence.features)
    s, step = sequence.prompt_len, 0
    with torch.inference_mode():
        while s < len(ids) - 1:
            run = runs[step % len(runs)]
            drafts = loop.drafts(int(ids[s]), s)
            for j in range(1, min(run + 2, drafter.block_size)):
                if s + j < len(ids):
                    ids[s + j] = drafts[j - 1] if j <= run else (drafts[j - 1] + 1) % head.vocab_size
            s, step = s + run + 1, step + 1
    return SequenceInput(sequence.id, ids, sequence.features, sequence.prompt_len)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("per_pass", [1, 3, 7])
def test_the_last_layer_and_head_where_needed_give_the_oracles_lengths_for_runs_of_every_length(
    fixture_models, head, greedy_sequences, monkeypatch, mode, per_pass
):
    # Runs end in every head pass, and some blocks match all the way: every pass of the drafter's
    # last layer and of the head is reached, on fewer blocks each time.
    import specops.score.leading_matches as matching

    monkeypatch.setattr(matching, "DEFAULT_POSITIONS_PER_PASS", per_pass)
    drafter = load_drafter(fixture_models.drafter)
    runs = list(range(drafter.block_size))
    completions = enumerate(greedy_sequences[:3])
    sequences = [plant_runs(drafter, head, s, runs[i:] + runs[:i]) for i, s in completions]
    fast = offline_acceptance(drafter, head, sequences, mode=mode)
    oracle = [sequential_acceptance(drafter, head, s) for s in sequences]
    assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in oracle]
    assert {n for r in fast for n in r.accept_lengths[:-1]} == set(range(1, drafter.block_size + 1))


@pytest.mark.parametrize("mode", MODES)
def test_random_drafter_accepts_about_one_token_and_equals_the_oracle(
    fixture_models, head, greedy_sequences, mode
):
    drafter = load_drafter(fixture_models.drafter)
    fast = offline_acceptance(drafter, head, greedy_sequences, mode=mode)
    oracle = [sequential_acceptance(drafter, head, s) for s in greedy_sequences]
    assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in oracle]
    assert [r.block_starts for r in fast] == [r.block_starts for r in oracle]
    assert 1.0 <= overall_tau(fast) < 1.3


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
def test_trained_drafter_accepts_many_tokens_and_equals_the_oracle(
    trained_drafter, head, greedy_sequences, mode
):
    drafter = load_drafter(trained_drafter)
    fast = offline_acceptance(drafter, head, greedy_sequences, mode=mode)
    oracle = [sequential_acceptance(drafter, head, s) for s in greedy_sequences]
    assert [r.accept_lengths for r in fast] == [r.accept_lengths for r in oracle]
    assert overall_tau(fast) >= 3.0
    # Not all full blocks: the comparison exercises short acceptances too.
    assert len({n for r in fast for n in r.accept_lengths}) >= 3


def test_a_small_memory_budget_splits_groups_and_chunks_without_changing_results(
    fixture_models, head, greedy_sequences
):
    drafter = load_drafter(fixture_models.drafter)
    sequences = greedy_sequences[:4]
    roomy = offline_acceptance(drafter, head, sequences, mode="all-anchors")
    seen = []
    tight = offline_acceptance(
        drafter,
        head,
        sequences,
        mode="all-anchors",
        memory_budget_bytes=1 << 20,
        progress=lambda done, total: seen.append(done),
    )
    assert [r.accept_lengths for r in tight] == [r.accept_lengths for r in roomy]
    assert len(seen) > 1 and seen[-1] == 4


def test_results_come_back_in_input_order_with_their_ids(fixture_models, head, greedy_sequences):
    drafter = load_drafter(fixture_models.drafter)
    s = greedy_sequences[1]
    end = s.prompt_len + 10
    short = SequenceInput("short", s.input_ids[:end], s.features[:end], s.prompt_len)
    results = offline_acceptance(drafter, head, [greedy_sequences[0], short, greedy_sequences[2]])
    assert [r.id for r in results] == ["p0", "short", "p2"]
    assert sum(results[1].accept_lengths) == 9


def test_mappings_are_accepted_as_sequences(fixture_models, head, greedy_sequences):
    drafter = load_drafter(fixture_models.drafter)
    s = greedy_sequences[0]
    record = {
        "id": s.id,
        "input_ids": s.input_ids.tolist(),
        "features": s.features,
        "prompt_len": s.prompt_len,
    }
    assert (
        offline_acceptance(drafter, head, [record])[0].accept_lengths
        == offline_acceptance(drafter, head, [s])[0].accept_lengths
    )


def test_features_of_the_wrong_shape_are_named(fixture_models, head, greedy_sequences):
    drafter = load_drafter(fixture_models.drafter)
    s = greedy_sequences[0]
    bad = SequenceInput("bad", s.input_ids, s.features[:, :2], s.prompt_len)
    with pytest.raises(ValueError, match=r"sequence bad: features are .* expected \[\d+, 3, 64\]"):
        offline_acceptance(drafter, head, [bad])


def test_an_unknown_mode_is_refused(fixture_models, head):
    with pytest.raises(ValueError, match="mode 'lazy' is not one of"):
        offline_acceptance(load_drafter(fixture_models.drafter), head, [], mode="lazy")


@pytest.mark.parametrize("kv_ahead", [False, True])
@pytest.mark.parametrize("mode", MODES)
def test_the_context_computed_a_few_positions_at_a_time_gives_the_same_lengths(
    trained_drafter, head, greedy_sequences, monkeypatch, mode, kv_ahead
):
    drafter = load_drafter(trained_drafter)
    whole = offline_acceptance(drafter, head, greedy_sequences, mode=mode)
    monkeypatch.setattr(streamed_context, "CHUNK_POSITIONS", 5)
    monkeypatch.setattr(streamed_context, "KV_AHEAD_DEVICES", ("cpu",) if kv_ahead else ())
    chunked = offline_acceptance(drafter, head, greedy_sequences, mode=mode)
    assert [r.accept_lengths for r in chunked] == [r.accept_lengths for r in whole]
    assert len({n for r in whole for n in r.accept_lengths}) >= 3


@torch.inference_mode()
@pytest.mark.parametrize(("ahead", "kv_ahead"), [(None, False), (1, False), (2, False), (2, True)])
def test_the_context_is_computed_only_as_far_as_asked(
    fixture_models, greedy_sequences, monkeypatch, ahead, kv_ahead
):
    drafter = load_drafter(fixture_models.drafter)
    monkeypatch.setattr(streamed_context, "CHUNK_POSITIONS", 5)
    monkeypatch.setattr(streamed_context, "COPIES_AHEAD", ahead)
    # K/V computed ahead: as each chunk is queued (on a GPU on a side stream, here at once).
    monkeypatch.setattr(streamed_context, "KV_AHEAD_DEVICES", ("cpu",) if kv_ahead else ())
    # Lengths that end inside a chunk: positions past a sequence's end must read as zeros.
    features = [s.features[:end] for s, end in zip(greedy_sequences[:3], (None, -7, -3), strict=True)]
    assert len({f.shape[0] for f in features}) == 3
    length = max(f.shape[0] for f in features)
    context = streamed_context.StreamedContext(drafter, features, length, torch.device("cpu"))
    assert context.ready == 0
    k = context.buffers[0][0]
    assert kv_ahead or all(not k.any() and not v.any() for k, v in context.buffers)
    chunks = -(-length // 5)
    # Copies queued ahead: all chunks, or `ahead` of them, one more as each is computed.
    assert len(context.chunks) == (chunks if ahead is None else ahead)
    # Computed ahead: the queued chunks' K/V are there before any is asked for.
    assert not kv_ahead or (k[..., : 5 * ahead, :].any(dim=-1).all() and not k[..., 5 * ahead :, :].any())
    context.ensure(7)
    assert context.ready == 10
    assert len(context.chunks) == (chunks - 2 if ahead is None else ahead)
    computed = 10 + 5 * ahead if kv_ahead else 10
    assert k[..., :computed, :].any(dim=-1).all() and not k[..., computed:, :].any()
    context.ensure(length + 100)
    padded = torch.zeros(len(features), length, *features[0].shape[1:])
    for b, f in enumerate(features):
        padded[b, : f.shape[0]] = f
    expected = drafter.context_kv(padded, block_slots=True)
    for (got_k, got_v), (want_k, want_v) in zip(context.buffers, expected, strict=True):
        assert got_k.shape == want_k.shape
        assert torch.allclose(got_k, want_k, atol=1e-6) and torch.allclose(got_v, want_v, atol=1e-6)


# ---- walks started inside a range (specops.score.split_walks) --------------------------------------


def test_walks_started_inside_the_ranges_give_the_lengths_of_one_walk_each(
    trained_drafter, head, greedy_sequences, monkeypatch
):
    drafter = load_drafter(trained_drafter)
    # Varied lengths, so that walks end at different steps and the batch is refilled.
    cut = (None, 20, 40, None, 10, None)
    sequences = [
        SequenceInput(s.id, s.input_ids[:end], s.features[:end], s.prompt_len)
        for s, end in (
            (s, s.prompt_len + n if n else None) for s, n in zip(greedy_sequences, cut, strict=False)
        )
    ]
    whole = offline_acceptance(drafter, head, sequences)
    monkeypatch.setattr(acceptance, "SPLIT_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(split_walks, "MIN_SPLIT_POSITIONS", 4)
    added = []
    refill = split_walks.SplitWalks.refill

    def counted(self, keep, starts):
        index, new_starts = refill(self, keep, starts)
        added.append(index.shape[0] - keep.shape[0])
        return index, new_starts

    monkeypatch.setattr(split_walks.SplitWalks, "refill", counted)
    split = offline_acceptance(drafter, head, sequences)
    assert sum(added) > 0
    assert [r.accept_lengths for r in split] == [r.accept_lengths for r in whole]
    assert [r.block_starts for r in split] == [r.block_starts for r in whole]
    oracle = [sequential_acceptance(drafter, head, s) for s in sequences]
    assert [r.accept_lengths for r in split] == [r.accept_lengths for r in oracle]


def test_a_walk_that_lands_where_another_stood_stops_and_of_two_landing_together_one_goes_on():
    walks = split_walks.SplitWalks(torch.tensor([2, 5, 3]), torch.tensor([20, 20, 20]), width=24)
    # Rows 0 and 1 walk sequence 0, row 2 sequence 1 (as after a refill).
    walks.sequence = torch.tensor([0, 0, 1])
    walking = walks.land(torch.tensor([7, 7, 4]), torch.tensor([True, True, True]))
    assert walking.tolist().count(True) == 2 and bool(walking[2])
    # Sequence 0 stood at 2 (its first walk's start): a walk of it landing there stops; sequence 1 did
    # not stand at 9, whatever sequence 0 did.
    walking = walks.land(torch.tensor([2, 9, 9]), torch.tensor([True, True, True]))
    assert walking.tolist() == [False, True, True]
    # Rows that take no step change nothing.
    assert walks.land(torch.tensor([11, 11, 11]), torch.tensor([False, False, False])).tolist() == [False] * 3
    assert not bool(walks.stood[0 * 24 + 11])


def test_a_refill_splits_the_longest_ranges_and_marks_the_new_starts():
    starts = torch.tensor([10, 10, 10, 10])
    walks = split_walks.SplitWalks(starts, torch.tensor([200, 100, 30, 200]), width=216)
    # Row 3 ended; rows 0-2 go on: one free row, given to the longest range ahead (row 0: 10..199).
    index, new_starts = walks.refill(torch.tensor([0, 1, 2]), torch.tensor([20, 20, 20, 199]))
    assert index.tolist() == [0, 1, 2, 0]
    assert new_starts.tolist() == [20, 20, 20, 20 + (199 - 20) // 2]
    assert walks.sequence.tolist() == [0, 1, 2, 0]
    assert walks.limits.tolist() == [109, 99, 29, 199]
    assert bool(walks.stood[0 * 216 + 109])


def test_reading_back_follows_the_steps_from_the_prompt_and_names_a_gap():
    # Sequence 0: a walk from 3 (3 -> 5 -> 9) and one from 6 (6 -> 9 -> 12); the walk from 3 is read.
    records = [(0, 6, 3), (0, 3, 2), (0, 9, 3), (0, 5, 4), (0, 9, 3), (0, 12, 0)]
    assert acceptance.walks_from_steps(records, [3], [13], 16) == [([2, 4, 3], [3, 5, 9])]
    with pytest.raises(RuntimeError, match="no step recorded at position 5 of sequence 0"):
        acceptance.walks_from_steps([(0, 3, 2)], [3], [13], 16)


def test_one_walk_a_sequence_is_read_back_in_forward_order_as_the_python_walk_reads_it():
    # Three sequences walked in lockstep, rows in varying order (batches compacted), ended rows taking 0.
    generator = torch.Generator().manual_seed(3)
    prompts, lengths, forwards = [3, 5, 4], [40, 33, 47], []
    position = dict(enumerate(prompts))
    while any(position[b] < lengths[b] - 1 for b in position):
        rows = torch.randperm(3, generator=generator).tolist()
        record = []
        for b in rows:
            remaining = lengths[b] - 1 - position[b]
            a = min(int(torch.randint(1, 9, (1,), generator=generator)), remaining) if remaining > 0 else 0
            record.append((b, position[b], a))
            position[b] += a
        forwards.append(torch.tensor(record).T)
    walks = acceptance.walks_in_order(forwards, 3)
    taken = torch.cat(forwards, dim=1).T.tolist()
    assert walks == acceptance.walks_from_steps(taken, prompts, lengths, 16)
    expected = [n - 1 - p for n, p in zip(lengths, prompts, strict=True)]
    assert [sum(accepted) for accepted, _ in walks] == expected
    assert acceptance.walks_in_order([], 2) == [([], []), ([], [])]


class _RunsByPosition:
    """A group whose drafts' leading matches are a function of (completion, position) alone, as a real
    drafter's are: what the frontier's batching does, without models. Counts the batched forwards."""

    def __init__(self, runs_at, prompts: list[int], lengths: list[int], block_size: int = 16):
        self.runs_at = runs_at
        self.prompts, self.lengths = torch.tensor(prompts), torch.tensor(lengths)
        self.ids = torch.zeros(len(prompts), max(lengths), dtype=torch.long)
        self.longest_prompt = max(prompts)
        self.drafter = type("Drafter", (), {"block_size": block_size})()
        self.rows = torch.arange(len(prompts))
        self.forwards = 0

    def select(self, index):
        self.rows, self.lengths = self.rows[index], self.lengths[index]
        self.prompts, self.ids = self.prompts[index], self.ids[index]

    def match_runs(self, starts, reach=None):
        self.forwards += 1
        rows, starts = self.rows.tolist(), starts[:, 0].tolist()
        found = [self.runs_at(row, start) for row, start in zip(rows, starts, strict=True)]
        return torch.tensor(found)[:, None]


def test_split_walks_keep_the_batch_full_when_completions_differ_in_tau(monkeypatch):
    # Half the completions accept 1 token a step, half 10: one walk each takes as many forwards as the
    # slow walks' steps, while split walks share those steps out over the rows the fast walks left.
    n, prompt, length = 16, 8, 408
    lengths = [length] * n

    def runs_at(sequence, position):
        return 0 if sequence % 2 else 9 if position % 3 else 4

    results = {}
    forwards = {}
    for split in (False, True):
        monkeypatch.setattr(acceptance, "SPLIT_DEVICES", ("cpu",) if split else ())
        group = _RunsByPosition(runs_at, [prompt] * n, lengths)
        found = {i: SequenceAcceptance(str(i), 16) for i in range(n)}
        acceptance._frontier(group, list(range(n)), found)
        results[split], forwards[split] = [r.accept_lengths for r in found.values()], group.forwards
    assert results[True] == results[False]
    expected = [walk(prompt, length, 16, lambda s, b=b: runs_at(b, s))[0] for b in range(n)]
    assert results[True] == expected
    slow_steps = length - 1 - prompt
    assert forwards[False] == slow_steps
    # Every step of every walk over the whole batch, with room for the steps each split wastes.
    full_batches = sum(len(steps) for steps in expected) / n
    assert forwards[True] < 1.1 * full_batches
    assert forwards[True] < slow_steps / 1.7


@pytest.mark.parametrize("share", [1 / 16, 1 / 8, 1 / 2])
def test_ended_walks_leave_the_batch_once_they_are_its_ended_share(share, monkeypatch):
    # 16 completions of lengths 40..190, one position a step: a walk ends every 10 forwards.
    monkeypatch.setattr(acceptance, "SPLIT_DEVICES", ())
    monkeypatch.setattr(acceptance, "ENDED_SHARE", share)
    n, prompt = 16, 8
    lengths = [40 + 10 * b for b in range(n)]
    group = _RunsByPosition(lambda sequence, position: 0, [prompt] * n, lengths)
    batches = []
    select = group.select
    group.select = lambda index: batches.append((group.rows.numel(), index.numel())) or select(index)
    found = {i: SequenceAcceptance(str(i), 16) for i in range(n)}
    acceptance._frontier(group, list(range(n)), found)
    assert [r.accept_lengths for r in found.values()] == [[1] * (length - 1 - prompt) for length in lengths]
    # Each batch shrank once its ended walks reached the share of it, not before.
    assert batches and all(before - after >= share * before for before, after in batches)
    assert all(before - after < share * before + 1 for before, after in batches)


def test_a_step_timer_names_where_the_time_goes_and_changes_no_result(fixture_models, head, greedy_sequences):
    drafter = load_drafter(fixture_models.drafter)
    plain = offline_acceptance(drafter, head, greedy_sequences)
    timer = StepTimer("cpu")
    timed = offline_acceptance(drafter, head, greedy_sequences, timer=timer)
    assert [r.accept_lengths for r in timed] == [r.accept_lengths for r in plain]
    parts = timer.seconds()
    assert {"inputs", "context", "drafter", "last layer", "head", "steps"} <= set(parts)
    assert all(seconds > 0 for seconds in parts.values())
    # The parts nest in the steps (the group's set-up, "inputs", comes before them).
    inside = parts["context"] + parts["drafter"] + parts["last layer"] + parts["head"]
    assert inside <= parts["steps"]
    # One forward of the trunk a step of the walks in lockstep: the longest walk's steps (one group here).
    assert timer.counts["drafter"] == max(r.steps for r in timed)
