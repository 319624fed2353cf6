"""Validation of one /generate answer: the record it becomes, or an error naming what SGLang would not
have said.
"""

from __future__ import annotations

import json
from typing import Any

from specops.completions.client import snippet
from specops.completions.prompts import Prompt
from specops.completions.request import is_int
from specops.stage import StageError


def check_generation(
    answer: Any, prompt: Prompt, prompt_ids: list[int], max_new_tokens: int, endpoint: str
) -> dict[str, Any]:
    """Turn one /generate answer into a record, refusing anything SGLang would not have said."""

    def inconsistent(problem: str) -> StageError:
        return StageError(
            f"{endpoint} for prompt {prompt.id!r}: {problem}; got {snippet(json.dumps(answer))}"
        )

    if not isinstance(answer, dict) or "output_ids" not in answer:
        return_keys = sorted(answer) if isinstance(answer, dict) else type(answer).__name__
        raise inconsistent(
            f"the answer has no 'output_ids' (keys: {return_keys}): the server is not "
            "SGLang-like or too old to return token ids"
        )
    output_ids = answer["output_ids"]
    meta = answer.get("meta_info")
    if not isinstance(output_ids, list) or not all(is_int(t) and t >= 0 for t in output_ids):
        raise inconsistent("'output_ids' is not a list of token ids")
    if not isinstance(meta, dict):
        raise inconsistent("the answer has no 'meta_info' object")
    reason = meta.get("finish_reason")
    reason_type = reason.get("type") if isinstance(reason, dict) else reason
    if reason_type == "abort":
        raise inconsistent("the server aborted the request")
    if not output_ids:
        raise inconsistent(
            f"empty output_ids where at least one token was expected (max_new_tokens={max_new_tokens})"
        )
    if len(output_ids) > max_new_tokens:
        raise inconsistent(f"{len(output_ids)} output tokens for max_new_tokens={max_new_tokens}")
    if meta.get("completion_tokens") is not None and meta["completion_tokens"] != len(output_ids):
        raise inconsistent(
            f"meta_info.completion_tokens={meta['completion_tokens']} but {len(output_ids)} output_ids"
        )
    if meta.get("prompt_tokens") is not None and meta["prompt_tokens"] != len(prompt_ids):
        raise inconsistent(
            f"meta_info.prompt_tokens={meta['prompt_tokens']} for the {len(prompt_ids)} "
            "input_ids sent: the server did not use them as given"
        )
    if not isinstance(reason_type, str):
        raise inconsistent("meta_info.finish_reason is missing")
    return {
        "id": prompt.id,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "text": answer.get("text") if isinstance(answer.get("text"), str) else "",
        "finish_reason": reason_type,
        "meta_info": meta,
    }
