"""Conversations as training tokens: rendered with the tokenizer's own chat template (transformers'
``apply_chat_template``), the assistant's replies marked as the tokens to train on.

A reply is the text the template adds between the conversation before it with the generation prompt and the
conversation through it: rendering each prefix finds the replies in the whole conversation's text for any
template, including those without ``{% generation %}`` markers. A template that renders an earlier turn
differently once later turns follow (one that drops past reasoning) has no such prefix; its conversations
are refused as rows that cannot be trained on, never trained on wrongly.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from jinja2 import TemplateSyntaxError
from transformers import PreTrainedTokenizerFast

from titan_core import ConfigError

# transformers logs a warning per tokenizer built without a model's files: nothing a user can act on.
logging.getLogger("transformers").setLevel(logging.ERROR)
ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Example:
    """One conversation's tokens, whether each is the assistant's (trained on), or why it cannot be used (and
    the kind of that problem, for the count before launch)."""

    ids: tuple[int, ...] = ()
    trained: tuple[bool, ...] = ()
    problem: str | None = None
    kind: str | None = None


class ChatRenderer:
    """Turns a conversation into an :class:`Example` of at most ``max_tokens`` tokens starting with ``bos_id``."""

    def __init__(self, tokenizer_json: Path, template: str, bos_token: str, eos_token: str, bos_id: int,
                 max_tokens: int, source: str = "the chat template"):
        """``source``: where ``template`` comes from, named when it is not valid Jinja."""
        self.tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_json), bos_token=bos_token,
                                                 eos_token=eos_token)
        self.tokenizer.chat_template = template
        self.bos_id, self.max_tokens, self.source = bos_id, max_tokens, source

    def render(self, messages, generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def example(self, messages) -> Example:
        problem = _shape_problem(messages)
        if problem:
            return Example(problem=problem, kind=problem.split(" '")[0])
        try:
            text = self.render(messages)
            replies = []
            for turn, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                before, through = self.render(messages[:turn], True), self.render(messages[:turn + 1])
                if not (through.startswith(before) and text.startswith(through)):
                    return Example(problem="the chat template renders an earlier turn differently once later "
                                           "turns follow", kind="not prefix-stable under the template")
                replies.append((len(before), len(through)))
        except TemplateSyntaxError as error:  # no row can render: the template's own fault, not the data's
            raise ConfigError("plugins.sft.chat_template", f"{self.source} is not valid Jinja: line {error.lineno}: "
                              f"{error.message}", "correct the template, or point plugins.sft.chat_template at "
                              "another") from None
        except Exception as error:  # a template raising on this row (jinja's raise_exception)
            return Example(problem=f"the chat template failed: {str(error).splitlines()[0] if str(error) else error}",
                           kind="refused by the template")
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        trained = [any(start <= offset < end for start, end in replies) for offset, _ in encoded["offset_mapping"]]
        if not ids or ids[0] != self.bos_id:  # the core finds packed documents by their first token
            ids, trained = [self.bos_id, *ids], [False, *trained]
        if self.bos_id in ids[1:]:  # e.g. a folder whose end-of-turn token stands in for a missing begin token
            return Example(problem=f"token {self.bos_id}, which starts a document, appears inside it: document "
                                   "attention would cut the conversation there", kind="a document start inside")
        if not any(trained):
            return Example(problem="the assistant's replies render to no tokens", kind="empty replies")
        if len(ids) > self.max_tokens:
            return Example(problem=f"{len(ids)} tokens, more than a row's {self.max_tokens}", kind="longer than a row")
        return Example(tuple(ids), tuple(trained))


def _shape_problem(messages) -> str | None:
    if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        return "not a list of {role, content} messages"
    unknown = sorted({m["role"] for m in messages} - ROLES)
    if unknown:
        return f"unknown role '{unknown[0]}' (known: {', '.join(sorted(ROLES))})"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant turn"
    return None
