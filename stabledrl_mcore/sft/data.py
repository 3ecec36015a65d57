"""SFT data: conversation rows from local data files (JSONL, JSON, parquet, CSV, ``save_to_disk``) to token rows.

A row is either ``{prompt_key: str, response_key: str}`` or ``{messages_key: [{role, content},
...]}`` whose last turn is the assistant's answer. The prompt is the prompt text (through
the tokenizer's chat template as a user turn with the generation prompt when
``sft.chat_template=auto`` and the tokenizer has one) or every turn before the answer
(rendered with the chat template, which messages rows need); the answer is the response
text followed by EOS. Every row is padded with EOS to one length, and the EOS padding
counts as answer (LLaDA's SFT recipe: the model learns to fill the rest of a fixed-length
generation with EOS). Bad rows are named by file and line (JSONL) or row (parquet, folders).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, List, Tuple

import torch

from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.sft.config import SFTSection
from stabledrl_mcore.tasks.local_datasets import load_rows


@dataclass
class SFTData:
    """``ids`` ``[N, S]`` (prompt | answer | EOS padding) and ``answer`` ``[N, S]`` (True = trained on)."""

    ids: torch.Tensor
    answer: torch.Tensor
    source: str

    def __len__(self) -> int:
        return self.ids.shape[0]


def read_rows(section: SFTSection) -> List[Tuple[str, Any]]:
    """``(where, row)`` for every row of ``sft.data_path``'s ``sft.split`` (``where`` names the file and
    line/row), read by the same local loader as the RL tasks' data (:mod:`..tasks.local_datasets`)."""

    try:
        return load_rows(section.data_path, section.split, field="sft.data_path")
    except FileNotFoundError as err:
        raise DataError(str(err)) from None


def render(row: Any, where: str, section: SFTSection, tokenizer) -> Tuple[str, str]:
    """``(prompt text, answer text)`` of one row."""
    template = section.chat_template == "auto" and bool(tokenizer.chat_template)
    if not isinstance(row, dict):
        raise DataError(
            f"{where}: expected an object with {section.prompt_key!r}/{section.response_key!r} "
            f"or {section.messages_key!r}, got {type(row).__name__}"
        )
    if row.get(section.messages_key) is not None:
        messages = row[section.messages_key]
        if (
            not isinstance(messages, list)
            or len(messages) < 2
            or not all(isinstance(m, dict) and isinstance(m.get("content"), str) for m in messages)
        ):
            raise DataError(f"{where}: {section.messages_key!r} must be a list of at least two {{role, content}} turns")
        if messages[-1].get("role") != "assistant":
            raise DataError(
                f"{where}: the last turn of {section.messages_key!r} must be the assistant's "
                f"answer (role 'assistant'), got role {messages[-1].get('role')!r}"
            )
        if not template:
            raise DataError(
                f"{where}: a {section.messages_key!r} chat needs a tokenizer with a chat template "
                f"(this one has none, or sft.chat_template=never); give "
                f"{section.prompt_key!r}/{section.response_key!r} rows instead"
            )
        prompt = [{"role": m.get("role"), "content": m["content"]} for m in messages[:-1]]
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)
        return text, messages[-1]["content"]
    missing = [k for k in (section.prompt_key, section.response_key) if not isinstance(row.get(k), str)]
    if missing:
        raise DataError(
            f"{where}: no text field {' / '.join(map(repr, missing))} and no "
            f"{section.messages_key!r} chat (keys: {', '.join(map(str, row)) or 'none'}); "
            f"set sft.prompt_key / sft.response_key / sft.messages_key"
        )
    prompt = row[section.prompt_key]
    if template:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
    return prompt, row[section.response_key]


def load_sft_data(section: SFTSection, tokenizer) -> SFTData:
    """Every row of ``sft.data_path`` as token rows of one length (see the module docstring)."""
    return encode_rows(read_rows(section), section, tokenizer, source=section.data_path)


def encode_rows(records: Iterable[Tuple[str, Any]], section: SFTSection, tokenizer, *, source: str) -> SFTData:
    """``(where, row)`` records (as :func:`read_rows` yields them) as token rows of one length."""
    rows: List[Tuple[str, List[int], List[int]]] = []
    for where, row in records:
        prompt, response = render(row, where, section, tokenizer)
        prompt_ids = tokenizer.encode(prompt)
        answer_ids = tokenizer.encode(response) + [tokenizer.eos_token_id]
        if section.max_length is not None and len(prompt_ids) + len(answer_ids) > section.max_length:
            raise DataError(
                f"{where}: {len(prompt_ids) + len(answer_ids)} tokens (prompt {len(prompt_ids)}, "
                f"answer + EOS {len(answer_ids)}), more than sft.max_length={section.max_length}; "
                f"raise it or shorten the row"
            )
        rows.append((where, prompt_ids, answer_ids))
    if not rows:
        raise DataError(f"{source} holds no rows")
    width = section.max_length or max(len(p) + len(a) for _, p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.eos_token_id, dtype=torch.long)
    answer = torch.zeros((len(rows), width), dtype=torch.bool)
    for i, (_, prompt_ids, answer_ids) in enumerate(rows):
        ids[i, : len(prompt_ids) + len(answer_ids)] = torch.tensor(prompt_ids + answer_ids, dtype=torch.long)
        answer[i, len(prompt_ids) :] = True  # the answer, its EOS and the EOS padding
    return SFTData(ids, answer, source)


def tokenizer_corpus(section: SFTSection, limit: int = 2048) -> List[str]:
    """Texts to train a tiny tokenizer on when a random-init run names none (prompts and answers)."""
    texts: List[str] = []
    for where, row in read_rows(section):
        if isinstance(row, dict) and row.get(section.messages_key) is not None:
            raise DataError(
                f"{where}: a {section.messages_key!r} chat needs a tokenizer with a chat "
                f"template; set model.tokenizer (a random-init run trains a plain one)"
            )
        prompt, response = render(row, where, section, PlainText())
        texts += [prompt, response]
        if len(texts) >= limit:
            break
    return texts


class PlainText:
    """A stand-in tokenizer without a chat template (for :func:`tokenizer_corpus`)."""

    chat_template = None
