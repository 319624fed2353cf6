"""The completions stage's prompts: the JSONL records read and checked (every problem named with its
line), the tokenizer's identity, and the prompts tokenized as SGLang receives them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specops.manifest import sha256_file
from specops.stage import StageError

MAX_ERRORS_SHOWN = 10
# Files that decide how text becomes token ids; their contents identify the tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)


@dataclass(frozen=True)
class Prompt:
    id: str
    line: int
    text: str | None = None
    messages: list[dict[str, Any]] | None = None


def _prompt_problem(record: Any) -> str | None:
    """What is wrong with one parsed JSONL record, or None when it is a valid prompt."""
    if not isinstance(record, dict):
        return f"expected a JSON object, got {type(record).__name__}"
    pid = record.get("id")
    if not isinstance(pid, str) or not pid.strip():
        return f"'id' must be a non-empty string (got {pid!r}); write numeric ids as strings, e.g. \"17\""
    has_prompt, has_messages = "prompt" in record, "messages" in record
    if has_prompt == has_messages:
        return "give exactly one of 'prompt' (text) or 'messages' (chat)"
    if has_prompt:
        if not isinstance(record["prompt"], str) or not record["prompt"]:
            return "'prompt' must be a non-empty string"
        return None
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        return '\'messages\' must be a non-empty list of {"role", "content"} objects'
    for index, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{index}] must be an object with 'role' and 'content'"
        if not isinstance(message.get("role"), str) or not message["role"]:
            return f"messages[{index}].role must be a non-empty string (system, user, assistant)"
        if not isinstance(message.get("content"), str):
            return f"messages[{index}].content must be a string"
    return None


def load_prompts(path: Path) -> list[Prompt]:
    """Every record checked; all problems reported together, each with its line number."""
    prompts: list[Prompt] = []
    errors: list[str] = []
    first_line: dict[str, int] = {}
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                # Some of json's messages end in "at" ("Unterminated string starting at"): one "at" only.
                where = f"{error.msg.removesuffix(' at')} at column {error.colno}"
                errors.append(f"{path}:{number}: not valid JSON ({where})")
                continue
            problem = _prompt_problem(record)
            if problem:
                errors.append(f"{path}:{number}: {problem}")
                continue
            pid = record["id"]
            if pid in first_line:
                errors.append(
                    f"{path}:{number}: duplicate id {pid!r} (first on line {first_line[pid]}): "
                    "ids must be unique"
                )
                continue
            first_line[pid] = number
            prompts.append(
                Prompt(id=pid, line=number, text=record.get("prompt"), messages=record.get("messages"))
            )
    if errors:
        shown = errors[:MAX_ERRORS_SHOWN]
        more = f"; and {len(errors) - len(shown)} more" if len(errors) > len(shown) else ""
        raise StageError(f"{len(errors)} invalid prompt record(s): " + "; ".join(shown) + more)
    if not prompts:
        raise StageError(f"prompts file {path} holds no prompts: add one JSON object per line")
    return prompts


# -- tokenizer -------------------------------------------------------------------------------
def tokenizer_identity(directory: Path) -> dict[str, str]:
    """Content digests of the tokenizer's files: cheap, and enough to know the ids would not change."""
    identity = {
        name: sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()
    }
    if not any(name in identity for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise StageError(
            f"{directory} holds no tokenizer (tokenizer.json / tokenizer_config.json): "
            "point 'tokenizer' at the target model's directory"
        )
    return identity


def tokenize(prompts: list[Prompt], directory: Path, prompts_path: Path) -> dict[str, list[int]]:
    """Plain prompts as text (what SGLang does with `text`); chat prompts through the chat template."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except Exception as error:  # transformers raises many types for a broken directory
        raise StageError(f"cannot load the tokenizer from {directory}: {error}") from None
    ids: dict[str, list[int]] = {}
    for prompt in prompts:
        if prompt.messages is not None:
            if not getattr(tokenizer, "chat_template", None):
                raise StageError(
                    f"{prompts_path}:{prompt.line}: chat prompt {prompt.id!r} but the tokenizer in "
                    f"{directory} has no chat template: use a plain 'prompt' or a chat model"
                )
            encoded: Any = tokenizer.apply_chat_template(
                prompt.messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            if isinstance(encoded, dict) or hasattr(encoded, "input_ids"):
                encoded = encoded["input_ids"]
        else:
            encoded = tokenizer.encode(prompt.text)
        token_ids = [int(t) for t in encoded]
        if not token_ids:
            raise StageError(f"{prompts_path}:{prompt.line}: prompt {prompt.id!r} tokenizes to nothing")
        ids[prompt.id] = token_ids
    return ids
