"""Chat templates: a task's question as a one-turn conversation, and the token that ends the model's turn.

An instruct model is prompted through its tokenizer's chat template and ends its answer with the template's
end-of-turn token (`<|im_end|>` for SmolLM2 and Qwen, `<|eot_id|>` for Llama 3), which need not be the tokenizer's
EOS. Rendered prompts already hold the template's special tokens, so they are encoded without adding more.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from vcppo_jax.data.source import Record

_PROBE = "vcppo"  # an assistant message whose text the template reproduces verbatim


def check_chat_template(tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"config.task.chat_template=True, but the tokenizer from {where} has no chat template "
                         "(a tokenizer_config.json or chat_template.jinja with one)")


def messages(question: str, system_prompt: str = "") -> list[dict[str, str]]:
    """The conversation a prompt stands for; '' system prompt = the template's own default (if any)."""
    system = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return system + [{"role": "user", "content": question}]


def render_prompt(tokenizer: PreTrainedTokenizerBase, question: str, system_prompt: str = "") -> str:
    """The text `apply_chat_template(..., add_generation_prompt=True)` tokenizes: up to the assistant's first token."""
    return tokenizer.apply_chat_template(messages(question, system_prompt), tokenize=False,
                                         add_generation_prompt=True)


def end_of_turn_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The special token the template writes right after an assistant message."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "assistant", "content": _PROBE}],
                                         tokenize=False)
    after = text[text.rindex(_PROBE) + len(_PROBE):]
    ids = tokenizer(after, add_special_tokens=False)["input_ids"]
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    if not ids or ids[0] not in special:
        raise ValueError(f"the chat template ends an assistant turn with {after!r}, which does not start with a "
                         "special token; cannot tell where a response ends")
    return int(ids[0])


class ChatPrompts(Sequence[Record]):
    """A task's records with each 'prompt' rendered through the chat template (other fields unchanged)."""

    prompts_have_special_tokens = True  # encode without adding the tokenizer's BOS again

    def __init__(self, source: Sequence[Record], tokenizer: PreTrainedTokenizerBase, system_prompt: str = ""):
        self._source, self._tokenizer, self._system = source, tokenizer, system_prompt

    def _render(self, record: Record) -> Record:
        return dict(record, prompt=render_prompt(self._tokenizer, record["prompt"], self._system))

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index):  # int -> Record; slice -> list[Record]
        item = self._source[index]
        return [self._render(r) for r in item] if isinstance(index, slice) else self._render(item)

    def get_batch(self, indices) -> list[Record]:
        return [self._render(r) for r in self._source.get_batch(indices)]
