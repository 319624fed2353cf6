"""Validation of /generate bodies and the shape of SGLang's answers, independent of any model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when sampling_params omits it
DEFAULT_TEMPERATURE = 1.0  # SGLang samples unless told temperature 0

# Features SGLang has and this server does not: asking for them is an error, not a silent no-op.
UNSUPPORTED_FLAGS = (
    "return_logprob",
    "return_hidden_states",
    "input_embeds",
    "image_data",
    "lora_path",
)
# Sampling knobs accepted only at their neutral value: any other value would change the tokens.
NEUTRAL_SAMPLING_VALUES = {
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
}
# Knobs that only shape stop-string handling or detokenised text, which this server does not vary.
IGNORED_SAMPLING_KEYS = ("no_stop_trim", "spaces_between_special_tokens")
# Constraints that send a request through SGLang's grammar queue (0.5.23 managers/scheduler.py:4084-4088).
# This server queues such a request as SGLang does; it does not constrain the tokens it decodes.
GRAMMAR_KEYS = ("regex", "json_schema", "ebnf")


class RequestError(Exception):
    """An answer other than 200: `status` is the HTTP code, the message says what to change."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = DEFAULT_TEMPERATURE
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop_token_ids: tuple[int, ...] = ()
    top_p: float = 1.0
    top_k: int = -1
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    sampling_seed: int | None = None
    constrained: bool = False  # regex, json_schema or ebnf given: the request waits for its grammar

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass(frozen=True)
class Item:
    """One prompt of a (possibly batched) request: exactly one of text / input_ids."""

    text: str | None
    input_ids: list[int] | None
    rid: str | None
    params: SamplingParams


@dataclass(frozen=True)
class GenerateRequest:
    items: list[Item] = field(default_factory=list)
    batched: bool = False


def _bad(message: str) -> RequestError:
    return RequestError(400, message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def parse_sampling_params(raw: Any) -> SamplingParams:
    if raw is None:
        return SamplingParams()
    if not isinstance(raw, dict):
        raise _bad(f"sampling_params must be a JSON object, got {type(raw).__name__}")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        if value is None or key in IGNORED_SAMPLING_KEYS:
            continue
        if key in NEUTRAL_SAMPLING_VALUES:
            if value != NEUTRAL_SAMPLING_VALUES[key]:
                raise _bad(
                    f"sampling_params.{key}={value!r} is not supported by the development server "
                    f"(only {NEUTRAL_SAMPLING_VALUES[key]})"
                )
            continue
        if key == "temperature":
            if not _is_number(value) or value < 0:
                raise _bad(f"sampling_params.temperature must be a number >= 0, got {value!r}")
            values[key] = float(value)
        elif key == "max_new_tokens":
            if not _is_int(value) or value < 0:
                raise _bad(f"sampling_params.max_new_tokens must be an integer >= 0, got {value!r}")
            values[key] = value
        elif key == "stop_token_ids":
            if not isinstance(value, list) or not all(_is_int(v) for v in value):
                raise _bad(f"sampling_params.stop_token_ids must be a list of integers, got {value!r}")
            values[key] = tuple(value)
        elif key == "top_p":
            if not _is_number(value) or not 0 < value <= 1:
                raise _bad(f"sampling_params.top_p must be in (0, 1], got {value!r}")
            values[key] = float(value)
        elif key == "top_k":
            if not _is_int(value) or value == 0 or value < -1:
                raise _bad(f"sampling_params.top_k must be -1 (all) or a positive integer, got {value!r}")
            values[key] = value
        elif key in ("ignore_eos", "skip_special_tokens"):
            if not isinstance(value, bool):
                raise _bad(f"sampling_params.{key} must be true or false, got {value!r}")
            values[key] = value
        elif key in GRAMMAR_KEYS:
            if not isinstance(value, str) or not value:
                raise _bad(f"sampling_params.{key} must be a non-empty string, got {value!r}")
            if values.get("constrained"):
                raise _bad(f"sampling_params: give only one of {', '.join(GRAMMAR_KEYS)}")
            values["constrained"] = True
        elif key == "sampling_seed":
            if not _is_int(value):
                raise _bad(f"sampling_params.sampling_seed must be an integer, got {value!r}")
            values[key] = value
        elif key == "stop":
            if value not in ("", []):
                raise _bad(
                    "sampling_params.stop (stop strings) is not supported by the development "
                    "server: use stop_token_ids"
                )
        elif key == "n":
            if value != 1:
                raise _bad(f"sampling_params.n={value!r} is not supported: send one request per sample")
        else:
            supported = [
                "temperature",
                "max_new_tokens",
                "stop_token_ids",
                "top_p",
                "top_k",
                "ignore_eos",
                "skip_special_tokens",
                "sampling_seed",
                *GRAMMAR_KEYS,
            ]
            raise _bad(
                f"sampling_params.{key} is not supported by the development server "
                f"(supported: {', '.join(supported)})"
            )
    return SamplingParams(**values)


def _per_item(value: Any, count: int, name: str) -> list[Any]:
    """SGLang lets rid / sampling_params be one value for the batch or one per prompt."""
    if isinstance(value, list) and (name == "rid" or all(isinstance(v, dict) for v in value)):
        if len(value) != count:
            raise _bad(
                f"{name} has {len(value)} entries for {count} prompts: give one per prompt or one for all"
            )
        return value
    return [value] * count


def parse_generate(body: Any) -> GenerateRequest:
    """Check a /generate body the way SGLang's GenerateReqInput does, for the subset served here."""
    if not isinstance(body, dict):
        raise _bad("the /generate body must be a JSON object")
    for flag in UNSUPPORTED_FLAGS:
        if body.get(flag):
            raise _bad(f"{flag} is not supported by the development server: leave it out or set it false")
    has_text, has_ids = body.get("text") is not None, body.get("input_ids") is not None
    if has_text == has_ids:
        raise _bad("give exactly one of 'text' or 'input_ids'")
    texts: list[str | None]
    ids: list[list[int] | None]
    if has_text:
        raw = body["text"]
        batched = isinstance(raw, list)
        texts = list(raw) if batched else [raw]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise _bad("'text' must be a string or a non-empty list of strings")
        ids = [None] * len(texts)
    else:
        raw = body["input_ids"]
        if not isinstance(raw, list) or not raw:
            raise _bad("'input_ids' must be a non-empty list of token ids (or a list of such lists)")
        batched = isinstance(raw[0], list)
        ids = list(raw) if batched else [raw]
        for row in ids:
            if not isinstance(row, list) or not row or not all(_is_int(t) and t >= 0 for t in row):
                raise _bad("'input_ids' must hold non-negative integers, one non-empty list per prompt")
        texts = [None] * len(ids)
    count = len(texts)
    rids = _per_item(body.get("rid"), count, "rid")
    params = [
        parse_sampling_params(p) for p in _per_item(body.get("sampling_params"), count, "sampling_params")
    ]
    for rid in rids:
        if rid is not None and not isinstance(rid, str):
            raise _bad(f"rid must be a string, got {rid!r}")
    items = [
        Item(text=t, input_ids=i, rid=r, params=p)
        for t, i, r, p in zip(texts, ids, rids, params, strict=False)
    ]
    return GenerateRequest(items=items, batched=batched)


def finish_reason(output_ids: list[int], params: SamplingParams, stop_ids: set[int]) -> dict[str, Any]:
    """SGLang checks the length limit before the stop tokens, so a stop token at the limit reads 'length'."""
    if len(output_ids) >= params.max_new_tokens:
        return {"type": "length", "length": params.max_new_tokens}
    if output_ids and output_ids[-1] in stop_ids:
        return {"type": "stop", "matched": output_ids[-1]}
    return {"type": "length", "length": params.max_new_tokens}


def error_body(status: int, message: str) -> dict[str, Any]:
    """SGLang's ErrorResponse shape, so clients that read `message` find it."""
    return {
        "object": "error",
        "message": message,
        "type": "error",
        "code": status,
        "error": {"message": message},
    }
