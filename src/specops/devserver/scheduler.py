"""Requests in flight, and how /pause_generation, /continue_generation and a release move them.

SGLang 0.5.23 (read in managers/tokenizer_manager.py and managers/scheduler.py):
- The tokenizer holds every new request at its door while paused (tokenizer_manager.py:938), in
  every mode; only /continue_generation opens it (tokenizer_manager.py:2282).
- mode "abort" (the default) aborts every request the scheduler holds (tokenizer_manager.py:2276):
  a running one finishes with what it decoded and finish_reason {"type": "abort", "message":
  "Aborted", ...} (scheduler.py:5811, schedule_batch.py:339); a queued one with no output and
  "Abort in waiting queue" (tokenizer_manager.py:3596). Both answer HTTP 200: only an abort with
  a status code >= 400 becomes an error (tokenizer_manager.py:1901).
- mode "retract" pauses the scheduler and sends running requests back to the waiting queue
  (scheduler.py:5816); "in_place" pauses it and leaves them running (scheduler.py:5820).
  After /continue_generation both continue; a retracted request recomputes its prefix.
- A constrained request (regex, json_schema, ebnf) waits in the grammar queue until its grammar is
  compiled, and leaves it only when the scheduler schedules (scheduler.py:4084-4088): never while
  paused. The release's idleness requires that queue empty (scheduler.py:5369-5372).
- SGLANG_REQ_WAITING_TIMEOUT (seconds, in the server's environment) aborts a request that waited in
  the queue longer, with status 503 (scheduler.py:3605-3620, polled each iteration from :2195-2203).
- A new request is prefilled at the scheduler's next step and joins the running batch
  (scheduler.py:3894-3961, get_next_batch_to_run merges the prefill batch into the running one),
  unless the batch already holds --max-running-requests (scheduler.py:4121-4126 and :1237-1243; 0.5.4
  scheduler.py:1644-1648): then it waits in the queue until one of them ends.
The model here decodes one request at a time under `lock` (one GPU), so the batch's steps are
imitated by turns (`turns`): a request that has not started goes before those that have, and its
first turn is one token (its prefill's, at the next step, as in SGLang); a started request then takes
a turn of TURN_TOKENS tokens and TURN_SECONDS while others wait and goes to the back. Every request
advances, none waits for the others' ends. (A request stepping aside recomputes its prefix at its
next turn: transformers' generate keeps no cache across calls.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from specops.devserver.protocol import Item, RequestError

RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
WAITING_ABORT = {"type": "abort", "message": "Abort in waiting queue"}
WAITING_TIMEOUT_MESSAGE = "Request waiting timeout reached."

TokensCallback = Callable[[list[int]], None]
# A started request's turn while others wait: at least TURN_TOKENS tokens and TURN_SECONDS seconds (a
# small model on a CPU decodes 32 tokens in a fraction of that). The longer, the fewer recomputed
# prefixes; the shorter, the closer to a batch that advances every request each step.
TURN_TOKENS = 32
TURN_SECONDS = 0.25


@dataclass
class Ticket:
    """One request inside the scheduler: waiting for the model, or running on it."""

    rid: str
    state: str = "waiting"  # or "grammar" (constrained, grammar not yet scheduled) or "running"
    abort: dict[str, Any] | None = None  # the finish_reason once aborted
    queued_at: float = dataclasses.field(default_factory=time.monotonic)  # entered its current queue
    started: bool = False  # has had a turn: a newcomer goes before it


class RequestScheduler:
    """Admission, pause modes and idleness; the engine that inherits it supplies the decoding."""

    lock: threading.Lock
    released_tags: set[str]

    def _init_scheduler(self) -> None:
        self.cond = threading.Condition()
        self.tickets: list[Ticket] = []
        self.door_closed = False  # the tokenizer's is_pause
        self.scheduler_paused = False  # the scheduler's _engine_paused (retract / in_place)
        self.pause_mode: str | None = None
        self.preempting = False  # a release (0.5.4) waits for the running step to end
        self.last_scheduler_message = 0.0  # what /health_generate counts as a sign of life
        self.grammar_compile_delay = 0.0  # seconds a constrained request's grammar takes to compile
        self.max_running_requests = 0  # the running batch's size; 0: no bound
        self.turns: list[Ticket] = []  # requests waiting for the model, in the order they get it
        self.turn_seconds = TURN_SECONDS
        self.idle_needs_empty_grammar_queue = True  # versions.py says which release does
        # envs.SGLANG_REQ_WAITING_TIMEOUT (0.5.23 environ.py:685): -1, off, by default.
        self.waiting_timeout = float(os.environ.get("SGLANG_REQ_WAITING_TIMEOUT") or -1)

    # -- counts --------------------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self.tickets)

    @property
    def paused(self) -> bool:
        return self.door_closed

    def count(self, state: str) -> int:
        return sum(1 for ticket in self.tickets if ticket.state == state)

    def is_fully_idle(self, ignore_waiting: bool = False) -> bool:
        """scheduler.py:5337-5372 (0.5.23): nothing running, an empty grammar queue (whatever the pause),
        nothing waiting unless told to ignore it."""
        return (
            self.count("running") == 0
            and (self.count("grammar") == 0 or not self.idle_needs_empty_grammar_queue)
            and (ignore_waiting or self.count("waiting") == 0)
        )

    def note_scheduler_message(self) -> None:
        self.last_scheduler_message = time.monotonic()

    # -- pause / continue ------------------------------------------------------------------------
    def pause(self, mode: str = "abort") -> None:
        with self.cond:
            self.door_closed = True
            self.pause_mode = mode
            if mode == "abort":
                for ticket in self.tickets:
                    ticket.abort = RUNNING_ABORT if ticket.state == "running" else WAITING_ABORT
            else:
                self.scheduler_paused = True
            self.cond.notify_all()
        if mode != "abort":
            # The scheduler handles the pause before any later message (a release): the running
            # step has stepped aside when this returns.
            with self.lock:
                pass
        if mode == "retract":
            # Every request of the running batch goes back to the queue, also those between turns.
            with self.cond:
                for ticket in self.tickets:
                    if ticket.state == "running":
                        ticket.state, ticket.queued_at = "waiting", time.monotonic()

    def resume_generation(self) -> None:
        with self.cond:
            self.door_closed = False
            self.scheduler_paused = False
            self.pause_mode = None
            self.cond.notify_all()

    def wait_unpaused(self) -> None:
        with self.cond:
            self.cond.wait_for(lambda: not self.door_closed)

    def _held(self) -> bool:
        """Whether an admitted request must wait before its next decoding step."""
        return self.scheduler_paused or self.preempting or bool(self.released_tags)

    @contextlib.contextmanager
    def preempt(self) -> Iterator[None]:
        """Hold the model between two steps of the running request (0.5.4's release)."""
        with self.cond:
            self.preempting = True
        try:
            with self.lock:
                yield
        finally:
            with self.cond:
                self.preempting = False
                self.cond.notify_all()

    # -- admission -----------------------------------------------------------------------------
    @contextlib.contextmanager
    def admit(self, rid: str | None, constrained: bool = False) -> Iterator[Ticket]:
        ticket = Ticket(rid or uuid.uuid4().hex, state="grammar" if constrained else "waiting")
        with self.cond:
            self.tickets.append(ticket)
        try:
            yield ticket
        finally:
            with self.cond:
                self.tickets.remove(ticket)
                self.cond.notify_all()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """A request counted as in flight (waiting), for callers that decode by themselves."""
        with self.admit(None):
            yield

    def serve(self, item: Item, ids: list[int], ticket: Ticket, on_tokens: TokensCallback | None) -> dict:
        """Decode one request to its end, stepping aside for pauses and releases; its answer."""
        started = time.monotonic()
        output: list[int] = []
        spec_parts: list[Any] = []
        params = item.params
        self._leave_grammar_queue(ticket)
        while not self._finished(output, params) and ticket.abort is None:
            first_turn = not ticket.started
            if not self._take_turn(ticket):
                break
            try:
                ticket.state = "running"
                rest = dataclasses.replace(params, max_new_tokens=params.max_new_tokens - len(output))
                before = list(output)
                turn = [0]  # tokens decoded in this turn
                turn_began = time.monotonic()

                def stream(new: list[int], before: list[int] = before, turn: list[int] = turn) -> None:
                    turn[0] = len(new)
                    if on_tokens is not None:
                        on_tokens(before + new)

                def interrupted(
                    turn: list[int] = turn, first_turn: bool = first_turn, began: float = turn_began
                ) -> bool:
                    return (
                        ticket.abort is not None
                        or self.scheduler_paused
                        or self.preempting
                        or self._turn_is_over(turn[0], first_turn, began)
                    )

                new, spec = self._decode(ids + output, rest, interrupted=interrupted, on_tokens=stream)
            finally:
                self.lock.release()
                with self.cond:
                    self.cond.notify_all()  # the next in turn goes now, not at its next look
            output.extend(new)
            if spec is not None:
                spec_parts.append(spec)
            with self.cond:
                # A retracted request goes back to the waiting queue; in place it stays running.
                if self.scheduler_paused and self.pause_mode == "retract":
                    ticket.state, ticket.queued_at = "waiting", time.monotonic()
        if ticket.abort is not None and not self._finished(output, params):
            return self._aborted(item, ids, output, ticket, time.monotonic() - started)
        return self._response(item, ids, output, time.monotonic() - started, self._merge_spec(spec_parts))

    def _leave_grammar_queue(self, ticket: Ticket) -> None:
        """A constrained request moves to the waiting queue once compiled, only while scheduling."""
        if ticket.state != "grammar":
            return
        ready_at = ticket.queued_at + self.grammar_compile_delay
        with self.cond:
            while ticket.abort is None and (self._held() or time.monotonic() < ready_at):
                self.cond.wait(max(0.01, min(0.1, ready_at - time.monotonic())))
            if ticket.abort is None:
                ticket.state, ticket.queued_at = "waiting", time.monotonic()

    def _take_turn(self, ticket: Ticket) -> bool:
        """Wait for the model in the order of `turns` (the lock is then held) or for the request's abort
        (False, the lock not held); a request that waited past SGLANG_REQ_WAITING_TIMEOUT is aborted
        with 503."""
        with self.cond:
            if ticket.started:
                self.turns.append(ticket)
            else:  # after the newcomers before it, ahead of every started request
                at = next((k for k, other in enumerate(self.turns) if other.started), len(self.turns))
                self.turns.insert(at, ticket)
        try:
            while ticket.abort is None:
                waited = time.monotonic() - ticket.queued_at
                if 0 < self.waiting_timeout < waited and ticket.state == "waiting":
                    raise RequestError(503, WAITING_TIMEOUT_MESSAGE)
                if self._may_go(ticket) and self.lock.acquire(timeout=0.1):
                    # A pause or release may have come between the check and the lock.
                    if not self._held() and ticket.abort is None:
                        ticket.started = True
                        return True
                    self.lock.release()
                with self.cond:
                    self.cond.wait_for(lambda: ticket.abort is not None or self._may_go(ticket), timeout=0.1)
            return False
        finally:
            with self.cond:
                self.turns.remove(ticket)
                self.cond.notify_all()

    def _may_go(self, ticket: Ticket) -> bool:
        return self._next_in_turn() is ticket and not self._held()

    def _next_in_turn(self) -> Ticket | None:
        """The request whose turn it is: the first in `turns` not aborted, a newcomer only while the
        running batch has room."""
        room = not 0 < self.max_running_requests <= self.count("running")
        for other in list(self.turns):
            if other.abort is None and (other.started or room):
                return other
        return None

    def _turn_is_over(self, tokens: int, first_turn: bool, began: float) -> bool:
        """Whether the running request steps aside now: another waits, and it is a newcomer (whose
        prefill goes at the next step), or this is its own first turn (one token), or this turn has had
        its tokens and its time."""
        waiting = self._next_in_turn()
        if waiting is None:
            return False
        if not waiting.started or first_turn:
            return tokens >= 1 or not waiting.started
        return tokens >= TURN_TOKENS and time.monotonic() - began >= self.turn_seconds

    def _aborted(self, item: Item, ids: list[int], output: list[int], ticket: Ticket, latency: float) -> dict:
        assert ticket.abort is not None
        if ticket.abort is WAITING_ABORT:
            # tokenizer_manager.py:3597-3631: id, finish_reason, weight_version, e2e_latency only.
            return {
                "text": "",
                "output_ids": [],
                "meta_info": {
                    "id": ticket.rid,
                    "finish_reason": dict(WAITING_ABORT),
                    "weight_version": self.weight_version,
                    "e2e_latency": latency,
                    "completion_tokens": 0,
                },
            }
        answer = self._response(item, ids, output, latency, None)
        answer["meta_info"]["finish_reason"] = dict(RUNNING_ABORT)
        return answer

    # -- supplied by the engine ------------------------------------------------------------------
    weight_version: str

    def _finished(self, output: list[int], params: Any) -> bool:
        raise NotImplementedError

    def _decode(self, ids, params, interrupted, on_tokens):  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def _response(self, item, ids, output_ids, latency, spec=None) -> dict:  # type: ignore[no-untyped-def]
        raise NotImplementedError

    def _merge_spec(self, parts: list[Any]) -> dict[str, Any] | None:
        raise NotImplementedError
