"""The model behind the server: loading, generation (scheduler.py takes turns), readiness and health."""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from specops.devserver.protocol import Item, RequestError, SamplingParams, finish_reason
from specops.devserver.scheduler import RequestScheduler, TokensCallback
from specops.devserver.speculative import DFlashSpeculator, SpecOutcome

logger = logging.getLogger("specops.devserver")

WARMUP_PROMPT = "The capital city of France is"


class Status(enum.Enum):
    STARTING = "Starting"
    UP = "Up"
    # A health check found no sign of life; the next that does sets Up again (0.5.23
    # entrypoints/http_server.py:785, :797).
    UNHEALTHY = "UnHealthy"
    SHUTTING_DOWN = "ShuttingDown"


class Engine(RequestScheduler):
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
        self.last_progress = 0.0  # monotonic time of the last decoded token, for health under load
        self.stop_ids: set[int] = set()
        # Called with the model once loaded (allocations inside the memory saver's regions).
        self.place_model: Callable[[Any], Any] | None = None
        self._init_scheduler()

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
        if self.place_model is not None:
            self.model = self.place_model(model).eval()
        else:
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

    # -- availability ------------------------------------------------------------------------
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

    def require_available(self) -> None:
        reason = self.unavailable_reason()
        if reason:
            raise RequestError(503, reason)

    # -- generation --------------------------------------------------------------------------
    def generate(
        self, items: list[Item], on_tokens: list[TokensCallback] | None = None
    ) -> list[dict[str, Any]]:
        """Serve one /generate request (one or more prompts), in order, one model step at a time."""
        # A request held by a pause has not reached the scheduler: it is not pending yet.
        self.wait_unpaused()
        self.require_available()
        prompts = [self.prompt_ids(item) for item in items]
        results = []
        for index, (item, ids) in enumerate(zip(items, prompts, strict=True)):
            with self.admit(item.rid, constrained=item.params.constrained) as ticket:
                callback = on_tokens[index] if on_tokens else None
                results.append(self.serve(item, ids, ticket, callback))
        return results

    def prompt_ids(self, item: Item) -> list[int]:
        ids = item.input_ids if item.input_ids is not None else self.tokenizer.encode(item.text)
        vocab = self.model.get_input_embeddings().num_embeddings if self.model is not None else None
        if not ids:
            raise RequestError(400, "the prompt is empty after tokenisation: send at least one token")
        if vocab is not None and max(ids) >= vocab:
            raise RequestError(
                400, f"input_ids holds token id {max(ids)} outside the vocabulary (0-{vocab - 1})"
            )
        return ids

    def decode_text(self, output_ids: list[int]) -> str:
        return self.tokenizer.decode(output_ids, skip_special_tokens=True)

    def _stop_set(self, params: SamplingParams) -> set[int]:
        return set(params.stop_token_ids) | (set() if params.ignore_eos else self.stop_ids)

    def _finished(self, output: list[int], params: SamplingParams) -> bool:
        return len(output) >= params.max_new_tokens or bool(output and output[-1] in self._stop_set(params))

    def _decode(
        self,
        ids: list[int],
        params: SamplingParams,
        interrupted: Callable[[], bool] | None = None,
        on_tokens: TokensCallback | None = None,
    ) -> tuple[list[int], SpecOutcome | None]:
        """New ids (up to where `interrupted` stopped them), and the drafter's counters when it speculated."""
        if self.speculator is None or not params.greedy:
            return self._generate_ids(ids, params, interrupted, on_tokens), None

        def progress(output: list[int]) -> None:
            self.last_progress = time.monotonic()
            if on_tokens is not None:
                on_tokens(list(output))

        outcome = self.speculator.generate(
            self.model,
            ids,
            params.max_new_tokens,
            self._stop_set(params),
            progress=progress,
            interrupted=interrupted,
        )
        self.last_progress = time.monotonic()
        return outcome.output_ids, outcome

    def _merge_spec(self, parts: list[Any]) -> dict[str, Any] | None:
        """One request's counters over the segments a pause cut it into."""
        if not parts:
            return None
        merged = SpecOutcome(output_ids=[], num_draft_tokens=parts[0].num_draft_tokens)
        for part in parts:
            merged.output_ids += part.output_ids
            merged.verify_ct += part.verify_ct
            merged.accepted_drafts += part.accepted_drafts
            merged.appended_per_step += part.appended_per_step
        return merged.meta_info()

    def _generate_ids(
        self,
        ids: list[int],
        params: SamplingParams,
        interrupted: Callable[[], bool] | None = None,
        on_tokens: TokensCallback | None = None,
    ) -> list[int]:
        """transformers' own generate: greedy at temperature 0, so the ids match model.generate exactly."""
        import torch
        from transformers import StoppingCriteria, StoppingCriteriaList

        if params.max_new_tokens == 0:
            return []
        engine = self

        class Heartbeat(StoppingCriteria):
            """Records each decoded token (health under load, streams); stops where a pause cuts in."""

            def __call__(self, input_ids, scores, **kwargs):
                engine.last_progress = time.monotonic()
                if on_tokens is not None:
                    on_tokens(input_ids[0, len(ids) :].tolist())
                stop = interrupted is not None and interrupted()
                return torch.full((input_ids.shape[0],), stop, dtype=torch.bool, device=input_ids.device)

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
    def is_ready(self) -> bool:
        """/ready (0.5.23 managers/tokenizer_manager.py:729-734): up, not marked unhealthy, not paused."""
        return self.status is Status.UP and not self.door_closed

    def health(self, timeout: float) -> bool:
        """Like SGLang (0.5.23 entrypoints/http_server.py:720-798): a 1-token request, or a sign of life.

        200 once a token is decoded or a scheduler answer arrives after the check began (the
        tokenizer's last_receive_tstamp, managers/tokenizer_manager.py:2466-2477), on the first whole
        second after the check began, as SGLang looks only then (`_health_passed`); the check's own
        request waits at the door while paused, so a paused server answers 503 after `timeout` and is
        marked unhealthy unless /continue_generation or a scheduler answer comes first. A pause, a
        continue and 0.5.23's /v1/loads send the scheduler nothing that it answers: they do not count.
        """
        if self.status not in (Status.UP, Status.UNHEALTHY):
            return False
        tic = time.monotonic()
        while time.monotonic() < tic + timeout:
            if self.last_progress > tic or self.last_scheduler_message > tic:
                return self._health_passed(tic)
            if not self.door_closed and self.released_tags:
                return False  # released without a pause: nothing could decode the check's token
            if not self.door_closed and not self._held() and self.lock.acquire(timeout=0.2):
                generated = False
                try:
                    if self.unavailable_reason():
                        return False
                    if not self._held():
                        self._generate_ids([0], SamplingParams(temperature=0.0, max_new_tokens=1))
                        generated = True
                finally:
                    self.lock.release()
                if generated:  # answered outside the lock: the wait for SGLang's next look holds no request
                    return self._health_passed(tic)
            else:
                with self.cond:
                    self.cond.wait(0.2)
        logger.error("Health check failed: no response from the scheduler in the last %.0f s", timeout)
        if self.status is Status.UP:
            self.status = Status.UNHEALTHY
        return False

    def _health_passed(self, tic: float) -> bool:
        # SGLang looks for the sign of life once a second, the first time a second after the check began
        # (0.5.23 entrypoints/http_server.py:779-781 `await asyncio.sleep(1)` before each look; 0.5.4
        # :452-454 the same): a passing check answers on the first whole second after it began, never
        # sooner.
        elapsed = time.monotonic() - tic
        time.sleep(max(1, math.ceil(elapsed)) - elapsed)
        if self.status is Status.UNHEALTHY:
            self.status = Status.UP
        return True

    # -- weights -----------------------------------------------------------------------------
    def weights_checksum(self) -> dict[str, Any]:
        """A digest of every parameter and sha256 over them all, as 0.5.23's WeightChecker computes
        (utils/weight_checker.py:83-88, :206-235, :254-255): equal only when the weights are the loaded
        ones. Each digest is taken where the parameter lies (tensor_digest.py): on a GPU nothing is
        copied to the host, so the check holds the model for about as long as SGLang's does."""
        import hashlib

        import torch

        from specops.devserver.tensor_digest import digest

        if self.model is None:
            raise RequestError(400, "the weights are released: POST /resume_memory_occupation first")
        with self.lock, torch.no_grad():
            checksums = {name: digest(param) for name, param in self.model.named_parameters()}
        overall = hashlib.sha256()
        for name in sorted(checksums):
            overall.update(name.encode())
            overall.update(checksums[name].encode())
        return {"checksums": checksums, "per_gpu_checksum": overall.hexdigest()}
