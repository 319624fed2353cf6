"""The model behind the server: loading, generation one request at a time, readiness and health."""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

from specops.devserver.protocol import Item, RequestError, SamplingParams, finish_reason
from specops.devserver.speculative import DFlashSpeculator

logger = logging.getLogger("specops.devserver")

WARMUP_PROMPT = "The capital city of France is"


class Status(enum.Enum):
    STARTING = "Starting"
    UP = "Up"
    SHUTTING_DOWN = "ShuttingDown"


class Engine:
    """Holds the model; a single lock serialises every forward pass, as one GPU would."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        weight_version: str = "default",
        num_threads: int | None = None,
        draft_model_path: str | None = None,
        num_draft_tokens: int | None = None,
    ):
        self.model_path = model_path
        # A DFlash drafter to speculate with (greedy requests only), loaded after the target.
        self.draft_model_path = draft_model_path
        self.num_draft_tokens = num_draft_tokens
        self.speculator: DFlashSpeculator | None = None
        self.device = device
        self.weight_version = weight_version
        self.num_threads = num_threads
        self.model: Any = None
        self.tokenizer: Any = None
        self.status = Status.STARTING
        self.released_tags: set[str] = set()
        self.lock = threading.Lock()
        self._counter_lock = threading.Lock()
        self.pending = 0  # /generate requests waiting for or holding the model
        self.last_progress = 0.0  # monotonic time of the last decoded token, for health under load
        self.stop_ids: set[int] = set()
        # /pause_generation holds new requests at the door until /continue_generation.
        self.paused = False
        self._pause_cond = threading.Condition()

    # -- lifecycle ---------------------------------------------------------------------------
    def load(self) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.num_threads:
            torch.set_num_threads(self.num_threads)
        started = time.monotonic()
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        model = AutoModelForCausalLM.from_pretrained(self.model_path)
        # transformers types .to() through a decorator whose stub takes the model as first argument.
        self.model = model.to(self.device).eval()  # type: ignore[arg-type]
        self.stop_ids = self._eos_ids()
        if self.draft_model_path:
            self.speculator = DFlashSpeculator.load(
                self.draft_model_path, self.model_path, self.model.config, self.num_draft_tokens, self.device
            )
        logger.info(
            "loaded %s on %s in %.1f s (eos ids %s)",
            self.model_path,
            self.device,
            time.monotonic() - started,
            sorted(self.stop_ids),
        )

    def _eos_ids(self) -> set[int]:
        """SGLang stops at the tokenizer's eos and at the model's generation_config eos ids."""
        ids: set[int] = set()
        for source in (
            self.tokenizer.eos_token_id,
            getattr(self.model.generation_config, "eos_token_id", None),
        ):
            if isinstance(source, int):
                ids.add(source)
            elif isinstance(source, (list, tuple)):
                ids.update(int(i) for i in source)
        return ids

    def warmup(self) -> None:
        ids = self.tokenizer.encode(WARMUP_PROMPT)
        with self.lock:
            # Through the drafter too, when there is one: a drafter that cannot run fails startup.
            self._decode(ids, SamplingParams(temperature=0.0, max_new_tokens=8))

    def mark_up(self) -> None:
        self.status = Status.UP
        logger.info("The server is fired up and ready to roll!")

    def begin_shutdown(self) -> None:
        self.status = Status.SHUTTING_DOWN

    def wait_idle(self, poll: float = 0.05) -> None:
        while self.pending:
            time.sleep(poll)

    # -- pause / continue ----------------------------------------------------------------------
    def pause(self) -> None:
        with self._pause_cond:
            self.paused = True
        logger.info("generation paused: new requests wait for /continue_generation")

    def resume_generation(self) -> None:
        with self._pause_cond:
            self.paused = False
            self._pause_cond.notify_all()
        logger.info("generation continued")

    def wait_unpaused(self) -> None:
        with self._pause_cond:
            self._pause_cond.wait_for(lambda: not self.paused)

    # -- request accounting ------------------------------------------------------------------
    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        with self._counter_lock:
            self.pending += 1
        try:
            yield
        finally:
            with self._counter_lock:
                self.pending -= 1

    def unavailable_reason(self) -> str | None:
        """Why the model cannot serve now (the answer is then 503), or None when it can."""
        if self.status is Status.STARTING:
            return "the server is starting: poll /health_generate until it answers 200"
        if self.status is Status.SHUTTING_DOWN:
            return "the server is shutting down"
        if self.released_tags:
            return (
                f"memory is released ({', '.join(sorted(self.released_tags))}): "
                "POST /resume_memory_occupation first"
            )
        return None

    def _require_available(self) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise RequestError(503, reason)

    # -- generation --------------------------------------------------------------------------
    def generate(self, items: list[Item]) -> list[dict[str, Any]]:
        """Serve one /generate request (one or more prompts), in order, under the model lock."""
        # A request held by a pause has not reached the scheduler: it is not pending yet.
        self.wait_unpaused()
        with self.track():
            self._require_available()
            prompts = [self._prompt_ids(item) for item in items]
            results = []
            with self.lock:
                for item, ids in zip(items, prompts, strict=False):
                    # Re-check under the lock: memory may have been released while this request queued.
                    self._require_available()
                    started = time.monotonic()
                    output_ids, spec = self._decode(ids, item.params)
                    results.append(self._response(item, ids, output_ids, time.monotonic() - started, spec))
            return results

    def _prompt_ids(self, item: Item) -> list[int]:
        ids = item.input_ids if item.input_ids is not None else self.tokenizer.encode(item.text)
        vocab = self.model.get_input_embeddings().num_embeddings if self.model is not None else None
        if not ids:
            raise RequestError(400, "the prompt is empty after tokenisation: send at least one token")
        if vocab is not None and max(ids) >= vocab:
            raise RequestError(
                400, f"input_ids holds token id {max(ids)} outside the vocabulary (0-{vocab - 1})"
            )
        return ids

    def _stop_set(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_ids)

    def _decode(self, ids: list[int], params: SamplingParams) -> tuple[list[int], dict[str, Any] | None]:
        """Output ids, and SGLang's spec meta_info when the drafter speculated (greedy requests only)."""
        if self.speculator is None or not params.greedy:
            return self._generate_ids(ids, params), None
        outcome = self.speculator.generate(
            self.model, ids, params.max_new_tokens, self._stop_set(params), progress=self._progress
        )
        self._progress()
        return outcome.output_ids, outcome.meta_info()

    def _progress(self) -> None:
        self.last_progress = time.monotonic()

    def _generate_ids(self, ids: list[int], params: SamplingParams) -> list[int]:
        """transformers' own generate: greedy at temperature 0, so the ids match model.generate exactly."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        if params.max_new_tokens == 0:
            return []
        engine = self

        class Heartbeat(StoppingCriteria):
            """Never stops; records that a token was decoded so health checks under load succeed."""

            def __call__(self, input_ids, scores, **kwargs):
                engine.last_progress = time.monotonic()
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        stop = self._stop_set(params)
        config = self.model.generation_config.__class__.from_dict(self.model.generation_config.to_dict())
        config.eos_token_id = sorted(stop) or None
        config.max_new_tokens = params.max_new_tokens
        config.do_sample = not params.greedy
        if config.do_sample:
            config.temperature = params.temperature
            config.top_p = params.top_p
            config.top_k = params.top_k if params.top_k > 0 else 0
            if params.sampling_seed is not None:
                torch.manual_seed(params.sampling_seed)
        input_ids = torch.tensor([ids], dtype=torch.long, device=self.device)
        out = self.model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            generation_config=config,
            stopping_criteria=StoppingCriteriaList([Heartbeat()]),
        )
        self.last_progress = time.monotonic()
        return out[0, len(ids) :].tolist()

    def _response(
        self,
        item: Item,
        ids: list[int],
        output_ids: list[int],
        latency: float,
        spec: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        stop = self._stop_set(item.params)
        text = self.tokenizer.decode(output_ids, skip_special_tokens=item.params.skip_special_tokens)
        return {
            "text": text,
            "output_ids": output_ids,
            "meta_info": {
                "id": item.rid or uuid.uuid4().hex,
                "finish_reason": finish_reason(output_ids, item.params, stop),
                "prompt_tokens": len(ids),
                "completion_tokens": len(output_ids),
                **(spec or {}),
                "cached_tokens": 0,
                "weight_version": self.weight_version,
                "e2e_latency": latency,
            },
        }

    # -- health ------------------------------------------------------------------------------
    def health(self, timeout: float) -> bool:
        """Like SGLang: decode one token, or see the busy model make progress, within `timeout`."""
        if self.unavailable_reason() or self.paused:
            return False
        tic = time.monotonic()
        while time.monotonic() < tic + timeout:
            if self.lock.acquire(timeout=0.2):
                try:
                    if self.unavailable_reason():
                        return False
                    self._generate_ids([0], SamplingParams(temperature=0.0, max_new_tokens=1))
                    return True
                finally:
                    self.lock.release()
            if self.last_progress > tic:
                return True
        logger.error("health check failed: no token decoded in the last %.0f s", timeout)
        return False
