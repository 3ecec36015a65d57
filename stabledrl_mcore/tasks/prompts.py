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

:class:`PromptFormat` is what a run configures (``rollout.system_prompt``,
``rollout.prompt_template``, ``rollout.chat_template``; the same flags on
``eval`` / ``generate``): the system prompt (None = the task's own), the user
turn as a template of ``{question}``, and a Jinja chat template file that
replaces the tokenizer's. ``Task.prompt`` renders through it, so training,
evaluation and generation format prompts with one function. See docs/evaluation.md.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Optional, Sequence, Union

import jinja2
import jinja2.ext
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment

from stabledrl_mcore.common.errors import UserError

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
    return (
        tokenizer is not None
        and bool(getattr(tokenizer, "chat_template", None))
        and hasattr(tokenizer, "apply_chat_template")
    )


def plain_prompt(question: str, system_prompt: str = SYSTEM_PROMPT) -> str:
    """The fallback format used when no chat template is available."""
    head = f"{system_prompt}\n\n" if system_prompt else ""
    return f"{head}Question: {question}\nAnswer:"


def build_prompt(
    question: str, tokenizer: Any = None, *, system_prompt: str = SYSTEM_PROMPT, chat_template: Optional[str] = None
) -> str:
    """Format ``question`` with ``tokenizer``'s chat template, or the plain fallback.

    ``chat_template``: the text of a Jinja chat template used instead of the tokenizer's
    (also for tokenizers without one), rendered by :func:`render_chat_template`."""
    if chat_template is None and not _has_chat_template(tokenizer):
        return plain_prompt(question, system_prompt)

    def apply(messages):
        if chat_template is not None:
            return render_chat_template(chat_template, messages, tokenizer)
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    messages = [{"role": "user", "content": question}]
    if system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    try:
        out = apply(messages)
    except Exception:  # some templates refuse a system role: fold it into the user turn
        if not system_prompt:
            raise
        out = apply([{"role": "user", "content": f"{system_prompt}\n\n{question}"}])
    if not isinstance(out, str):
        raise TypeError(f"apply_chat_template returned {type(out).__name__}, expected str")
    return out


@functools.lru_cache(maxsize=8)
def _compiled(text: str):
    """A Jinja template compiled as Hugging Face compiles chat templates (sandboxed, trimmed blocks)."""

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(text)


def render_chat_template(text: str, messages: Sequence[dict], tokenizer: Any = None) -> str:
    """Render the Jinja chat template ``text`` for ``messages`` with ``add_generation_prompt``.

    Variables: ``messages``, ``add_generation_prompt`` (true) and the tokenizer's
    ``bos_token`` / ``eos_token`` / ``pad_token`` strings ("" without a tokenizer)."""
    backend = getattr(tokenizer, "backend", None)
    specials = {name: str(getattr(backend, name, None) or "") for name in ("bos_token", "eos_token", "pad_token")}
    return _compiled(text).render(messages=list(messages), add_generation_prompt=True, **specials)


QUESTION = "{question}"
"""The placeholder of :attr:`PromptFormat.template`."""


@dataclass(frozen=True)
class PromptFormat:
    """How a task's question becomes the model's prompt (see the module docstring).

    system_prompt: None = the task's own system prompt; "" = none.
    template:      the user turn; ``{question}`` is replaced by the question (nothing else is
                   substituted, so braces such as ``\\boxed{}`` stay as written).
    chat_template: path of a Jinja chat template file replacing the tokenizer's; None = the
                   tokenizer's own (or the plain fallback when it has none).
    Build one with :func:`prompt_format`, which checks it.
    """

    system_prompt: Optional[str] = None
    template: str = QUESTION
    chat_template: Optional[str] = None
    chat_template_text: Optional[str] = None
    """The file's text, read once by :func:`prompt_format`."""

    @property
    def is_default(self) -> bool:
        return self.system_prompt is None and self.template == QUESTION and self.chat_template is None

    def render(self, question: str, tokenizer: Any = None, *, default_system: str = "") -> str:
        """The prompt text for ``question`` (``default_system``: the task's system prompt)."""
        system = default_system if self.system_prompt is None else self.system_prompt
        return build_prompt(
            self.template.replace(QUESTION, question),
            tokenizer,
            system_prompt=system,
            chat_template=self.chat_template_text,
        )


PROMPT_FIELDS = ("rollout.system_prompt", "rollout.prompt_template", "rollout.chat_template")
"""The config fields of a :class:`PromptFormat` (their names in error messages)."""


def prompt_format(
    system_prompt: Optional[str] = None,
    template: Optional[str] = None,
    chat_template: Optional[str] = None,
    *,
    names: Sequence[str] = PROMPT_FIELDS,
) -> PromptFormat:
    """A checked :class:`PromptFormat`: the template holds ``{question}``; the chat template file
    exists, parses and renders a test conversation. A failure is one :class:`~stabledrl_mcore.common.errors.UserError`
    line naming the field (``names``: system prompt, template, chat template) and the fix."""

    template = QUESTION if template is None else template
    if not isinstance(template, str) or QUESTION not in template:
        raise UserError(
            f"{names[1]}: {template!r} has no {QUESTION} placeholder (where the question goes), "
            f"e.g. 'Solve: {QUESTION}'"
        )
    if system_prompt is not None and not isinstance(system_prompt, str):
        raise UserError(f"{names[0]} must be a string (or null for the task's own), got {system_prompt!r}")
    if chat_template is None:
        return PromptFormat(system_prompt, template)
    text = _read_template(str(chat_template), names[2])
    fmt = PromptFormat(system_prompt, template, str(chat_template), text)
    try:
        out = fmt.render("test question", default_system="test system prompt")
    except Exception as err:  # noqa: BLE001 - any Jinja failure is the file's, named in one line
        raise UserError(
            f"{names[2]}: {chat_template} does not render a test conversation: {type(err).__name__}: {err}"
        ) from None
    if not isinstance(out, str) or not out.strip():
        raise UserError(f"{names[2]}: {chat_template} renders an empty prompt for a test conversation")
    return fmt


def rollout_prompt_format(rollout: Any) -> PromptFormat:
    """The checked :class:`PromptFormat` of a config's ``rollout`` section (train, preflight).

    ``prompt_style: compact`` prompts are the bare question: the prompt fields are refused there."""

    given = {
        "rollout.system_prompt": rollout.system_prompt is not None,
        "rollout.prompt_template": rollout.prompt_template != QUESTION,
        "rollout.chat_template": rollout.chat_template is not None,
    }
    if rollout.prompt_style == "compact" and any(given.values()):
        named = ", ".join(name for name, set_ in given.items() if set_)
        raise UserError(
            f"{named}: rollout.prompt_style=compact prompts are the bare question; set "
            f"rollout.prompt_style=chat to use them, or unset them"
        )
    return prompt_format(rollout.system_prompt, rollout.prompt_template, rollout.chat_template)


def _read_template(path: str, name: str) -> str:

    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        raise UserError(f"{name}: {path} does not exist (give a Jinja chat template file)") from None
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(f"{name}: cannot read {path}: {err}") from None
    try:
        import jinja2
    except ImportError:
        raise UserError(f"{name}: rendering {path} needs jinja2 (pip install jinja2)") from None
    try:
        _compiled(text)
    except jinja2.TemplateSyntaxError as err:
        raise UserError(f"{name}: {path}: line {err.lineno}: {err.message} (not a valid Jinja template)") from None
    return text


def encode_prompts(
    tokenizer,
    texts: Sequence[str],
    *,
    max_len: Optional[int] = None,
    device: Union[str, torch.device] = "cpu",
    multiple: int = 1,
    step: int = 1,
):
    """Left-pad prompts to one length: ``(ids [B, P], valid [B, P])`` on ``device``
    (padded on the host, copied once). ``multiple``: ``P`` rounded up towards a multiple of it
    (compiled decoding: a handful of prompt widths, so a handful of graphs, whatever the batch's
    prompts), by a multiple of ``step`` tokens (the widest prompt plus whole steps: at most the
    multiple; see :func:`~stabledrl_mcore.models.decoding.prompt_padding`)."""
    encoded = [tokenizer.encode(t) for t in texts]
    if max_len is not None:
        encoded = [e[-max_len:] for e in encoded]
    width = max(len(e) for e in encoded)
    extra = -(-width // multiple) * multiple - width
    width += extra - extra % step
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(e)) + list(e) for e in encoded], dtype=torch.long, device=device).reshape(
        len(encoded), width
    )
    valid = torch.tensor(
        [[False] * (width - len(e)) + [True] * len(e) for e in encoded], dtype=torch.bool, device=device
    ).reshape(len(encoded), width)
    return ids, valid
