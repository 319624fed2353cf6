"""The development server's turns imitate SGLang's running batch (0.5.23 managers/scheduler.py:3894-3961):
every request advances while others keep arriving, a newcomer is not held behind a long request's end,
and a full batch (--max-running-requests) keeps a newcomer in the queue until a request ends.

The scheduler is driven by a stand-in decoder that sleeps a millisecond a token and reports each token
as the engine's decoders do (on_tokens after every token, interrupted checked after it)."""

from __future__ import annotations

import dataclasses
import threading
import time

from specops.devserver.scheduler import RequestScheduler

SECONDS_PER_TOKEN = 0.001
# Tokens the clients decode in all: a bound on the test's time, far above what a fair turn waits.
CLIENTS_TOKENS = 2000


@dataclasses.dataclass
class Params:
    max_new_tokens: int


@dataclasses.dataclass
class Item:
    params: Params
    rid: str | None = None


class SleepingEngine(RequestScheduler):
    """The scheduler with a decoder that takes SECONDS_PER_TOKEN a token and counts every token decoded."""

    def __init__(self, max_running_requests: int = 0):
        self.lock = threading.Lock()
        self.released_tags: set[str] = set()
        self.weight_version = "test"
        self._init_scheduler()
        self.max_running_requests = max_running_requests
        self.turn_seconds = 0.0  # turns counted in tokens alone: the bound below is in tokens
        self.decoded = 0  # every token of every request

    def _finished(self, output, params):
        return len(output) >= params.max_new_tokens

    def _decode(self, ids, params, interrupted, on_tokens):
        output: list[int] = []
        while len(output) < params.max_new_tokens:
            time.sleep(SECONDS_PER_TOKEN)
            output.append(1)
            self.decoded += 1
            on_tokens(list(output))
            if interrupted():
                break
        return output, None

    def _response(self, item, ids, output_ids, latency, spec=None):
        return {"tokens": len(output_ids), "done_at": time.monotonic()}

    def _merge_spec(self, parts):
        return None

    def request(self, tokens: int) -> dict:
        with self.admit(None) as ticket:
            return self.serve(Item(Params(tokens)), [0], ticket, None)


def test_every_request_advances_while_others_keep_arriving():
    engine = SleepingEngine()
    waits: list[int] = []  # per request: the tokens the others decoded between its arrival and its end

    def client(tokens: int) -> None:  # a closed loop: the next request as soon as the last one is answered
        while engine.decoded < CLIENTS_TOKENS:
            before = engine.decoded
            assert engine.request(tokens)["tokens"] == tokens
            waits.append(engine.decoded - before - tokens)

    # Short requests keep a newcomer waiting nearly all the time; long ones hold turns of their own.
    clients = [threading.Thread(target=client, args=(tokens,)) for tokens in (8, 8, 64, 64)]
    for thread in clients:
        thread.start()
    for thread in clients:
        thread.join()
    # Fair turns: between a 64-token request's three turns (1 + 32 + 31 tokens) the others take at most a
    # turn each and their newcomers' first tokens; a starved request waits until the clients stop.
    worst = max(waits)
    assert len(waits) > 20 and worst < 600, f"a request waited while the others decoded {worst} tokens"


def test_a_full_batch_keeps_a_newcomer_in_the_queue_until_a_request_ends():
    engine = SleepingEngine(max_running_requests=1)
    answers: dict[str, dict] = {}
    long = threading.Thread(target=lambda: answers.update(long=engine.request(300)))
    long.start()
    while engine.decoded == 0:
        time.sleep(0.001)
    answers["short"] = engine.request(1)
    long.join()
    assert answers["short"]["done_at"] > answers["long"]["done_at"], "the newcomer joined a full batch"
