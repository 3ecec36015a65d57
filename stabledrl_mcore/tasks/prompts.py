"""System prompts and chat formatting.

``build_prompt(question, tokenizer)`` returns the text the model is conditioned
on. With a tokenizer that has a chat template it is
``tokenizer.apply_chat_template([system, user], tokenize=False,
add_generation_prompt=True)`` (if the template rejects a system role, the
system prompt is prepended to the user turn instead). Without one it is the
documented plain fallback::

    <system prompt>

    Question: <question>
    Answer:
"""

from __future__ import annotations

from typing import Any

MATH_SYSTEM_PROMPT = (
    "You are a careful math solver. Think step by step, showing your reasoning "
    "inside <reasoning> </reasoning> tags. Then give only the final answer inside "
    "<answer> </answer> tags, written as \\boxed{...}, for example "
    "<answer>\\boxed{42}</answer>."
)

COUNTDOWN_SYSTEM_PROMPT = (
    "You are solving an arithmetic puzzle. Think step by step inside <reasoning> "
    "</reasoning> tags. Then give only the final arithmetic expression (numbers, "
    "+, -, *, / and parentheses; each given number used exactly once) inside "
    "<answer> </answer> tags, for example <answer>(7 + 5) * 2</answer>."
)

SUDOKU_SYSTEM_PROMPT = (
    "You are solving a 4x4 Sudoku: every row, every column and every 2x2 box must "
    "contain the digits 1, 2, 3 and 4 exactly once. Think step by step inside "
    "<reasoning> </reasoning> tags. Then give only the completed grid inside "
    "<answer> </answer> tags as 16 digits read row by row, for example "
    "<answer>1234341221434321</answer>."
)

SYSTEM_PROMPT = MATH_SYSTEM_PROMPT


def _has_chat_template(tokenizer: Any) -> bool:
    return tokenizer is not None and bool(getattr(tokenizer, "chat_template", None)) and hasattr(
        tokenizer, "apply_chat_template")


def plain_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The fallback format used when no chat template is available."""
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}Question: {question}\nAnswer:"


def build_prompt(question: str, tokenizer: Any = None, *, system_prompt: str = SYSTEM_PROMPT) -> str:
    """Format ``question`` with ``tokenizer``'s chat template, or the plain fallback."""
    if not _has_chat_template(tokenizer):
        return plain_prompt(question, system_prompt)
    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # some templates refuse a system role: fold it into the user turn
        if not system_prompt:
            raise
        merged = [{"role": "user", "content": f"{system_prompt}\n\n{question}"}]
        out = tokenizer.apply_chat_template(merged, tokenize=False, add_generation_prompt=True)
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out
