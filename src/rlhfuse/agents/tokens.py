"""An episode as the trainer will see it: the conversation rendered with the chat template, its token ids, and a
mask that is 1 exactly on the tokens the model generated (each trainable message's content and its end token)
and 0 on the prompt, the environment's and the tools' messages and the template's own framing (role headers,
the generation prompt, the newline after an end token).

The mask comes from rendering prefixes: the tokens of trainable message k lie between the render of
messages[:k] with the generation prompt and the render of messages[:k + 1]. That needs each such render to be a
prefix of the whole conversation's; a template that re-renders earlier turns (one that drops the reasoning of
past assistant turns, say) breaks it, and ChatTemplateError says so rather than a wrong mask being trained on.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from rlhfuse.agents.episode import Episode
from rlhfuse.agents.tools import Tool, tool_schema
from rlhfuse.data.tokenizer import ChatTemplateError, Tokenizer


class ChatEncoder(Protocol):
    """A tokenizer's chat template, as the mask needs it: messages (+ tool schemas) -> token ids, and the ids
    that end a generated message."""

    stop_ids: frozenset[int]

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]],
        add_generation_prompt: bool,
    ) -> list[int]: ...


class RlhfuseChat:
    """rlhfuse's own `Tokenizer` (`encode_chat`, the tool schemas passed to its chat template)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(tokenizer.stop_ids)

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]],
        add_generation_prompt: bool,
    ) -> list[int]:
        return self.tokenizer.encode_chat(messages, add_generation_prompt=add_generation_prompt, tools=tools)


class TransformersChat:
    """A transformers tokenizer: `apply_chat_template(messages, tools=...)` rendered to text, then encoded
    without added special tokens (as apply_chat_template's own tokenize=True does)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.stop_ids = frozenset(i for i in [tokenizer.eos_token_id] if i is not None)

    def encode(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]],
        add_generation_prompt: bool,
    ) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [dict(m) for m in messages],
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            tokenize=False,
        )
        return list(self.tokenizer.encode(text, add_special_tokens=False))


def chat_encoder(tokenizer: Tokenizer | Any) -> ChatEncoder:
    """The chat encoder of rlhfuse's `Tokenizer`, else of a transformers tokenizer."""
    return RlhfuseChat(tokenizer) if isinstance(tokenizer, Tokenizer) else TransformersChat(tokenizer)


def episode_tokens(
    tokenizer: Tokenizer | Any, episode: Episode, tools: Sequence[Tool | Mapping[str, Any]] = ()
) -> tuple[list[int], list[int]]:
    """(ids, trainable_mask) of the whole conversation: ids as the chat template renders it (with the tools'
    schemas, made from the functions, or given as schemas), the mask 1 on the tokens of each trainable
    message's content up to and including its last stop token (the end the model generated), 0 elsewhere."""
    chat = chat_encoder(tokenizer)
    schemas = [dict(t) if isinstance(t, Mapping) else tool_schema(t) for t in tools]
    messages = episode.messages
    ids = chat.encode(messages, tools=schemas, add_generation_prompt=False)
    mask = [0] * len(ids)
    for k, trained in enumerate(episode.trainable):
        if not trained:
            continue
        before = chat.encode(messages[:k], tools=schemas, add_generation_prompt=True)
        through = (
            ids
            if k + 1 == len(messages)
            else chat.encode(messages[: k + 1], tools=schemas, add_generation_prompt=False)
        )
        _check_prefix(before, ids, f"messages[:{k}] with the generation prompt")
        _check_prefix(through, ids, f"messages[:{k + 1}]")
        start, end = len(before), len(through)
        if start > end:
            raise ChatTemplateError(
                f"the chat template renders messages[:{k}] with the generation prompt longer than "
                f"messages[:{k + 1}] (message {k} being the model's): rlhfuse cannot tell which tokens it wrote"
            )
        stops = [i for i in range(start, end) if ids[i] in chat.stop_ids]
        end = stops[-1] + 1 if stops else end  # what follows the end token is the template's, not the model's
        mask[start:end] = [1] * (end - start)
    return ids, mask


def answer_tokens(
    chat: ChatEncoder, messages: Sequence[Mapping[str, Any]], answered: int, schemas: list[dict[str, Any]]
) -> list[int]:
    """The tokens the chat template writes for the last `answered` messages and the next generation prompt, after
    the model's message before them: the conversation rendered with them minus the conversation rendered up to
    that message's last stop token (its end, which the model generated; what the template writes after it, a
    newline, is part of the answer). What a multi-turn generator appends to a context after each turn."""
    before = chat.encode(messages[:-answered], tools=schemas, add_generation_prompt=False)
    end = max((k + 1 for k, t in enumerate(before) if t in chat.stop_ids), default=len(before))
    after = chat.encode(messages, tools=schemas, add_generation_prompt=True)
    _check_prefix(before[:end], after, f"the conversation before its last {answered} message(s)")
    return after[end:]


def _check_prefix(prefix: list[int], ids: list[int], what: str) -> None:
    if ids[: len(prefix)] == prefix:
        return
    at = next((i for i, (a, b) in enumerate(zip(prefix, ids)) if a != b), min(len(prefix), len(ids)))
    raise ChatTemplateError(
        f"the chat template renders {what} as something else than the start of the whole conversation (first "
        f"difference at token {at} of {len(prefix)}): the trainable mask is made from prefix renders, so the "
        "template must render earlier turns unchanged; use one that does (e.g. one that keeps past assistant "
        "turns' reasoning), or build the token ids from the generated ones"
    )
