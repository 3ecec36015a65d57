"""Tokenizers: Hugging Face (``tokenizer.json``) or sentencepiece (``*.model``), one small interface.

Special ids (mask, EOS, pad, BOS) always come from the tokenizer files, never
from code. :func:`train_sentencepiece` trains the project's own tiny tokenizer
offline (used by the CPU demo and the tests) with the special tokens the
diffusion LM needs.
"""

from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Iterable, List, Optional, Sequence

MASK_TOKEN, EOS_TOKEN, PAD_TOKEN, BOS_TOKEN = "<|mask|>", "<|eos|>", "<|pad|>", "<|bos|>"
# Upstream names of the mask token, tried in order when loading an HF tokenizer.
KNOWN_MASK_TOKENS = ("<|mdm_mask|>", "<|MASK|>", "<|mask|>", "[MASK]", "<mask>")


@dataclass
class Tokenizer:
    """Encode/decode plus the special ids a diffusion LM needs."""

    backend: object
    kind: str  # "hf" | "sentencepiece"
    mask_token_id: int
    eos_token_id: int
    pad_token_id: int
    bos_token_id: Optional[int]
    vocab_size: int
    path: Optional[str] = None

    @property
    def chat_template(self):
        return getattr(self.backend, "chat_template", None) if self.kind == "hf" else None

    def apply_chat_template(self, messages, **kwargs):
        return self.backend.apply_chat_template(messages, **kwargs)

    def encode(self, text: str) -> List[int]:
        if self.kind == "hf":
            return list(self.backend.encode(text, add_special_tokens=False))
        return list(self.backend.encode(text))

    def decode(self, ids: Sequence[int], *, stop_at_eos: bool = True) -> str:
        ids = [int(i) for i in ids]
        if stop_at_eos and self.eos_token_id in ids:
            ids = ids[: ids.index(self.eos_token_id)]
        specials = {self.mask_token_id, self.pad_token_id, self.eos_token_id}
        ids = [i for i in ids if i not in specials]
        if self.kind == "hf":
            return self.backend.decode(ids, skip_special_tokens=True)
        return self.backend.decode(ids)


def train_sentencepiece(
    texts: Iterable[str], out_dir: str, *, vocab_size: int = 64, model_type: str = "char"
) -> Tokenizer:
    """Train a sentencepiece tokenizer on ``texts`` (offline, well under a second for small data).

    Ids: 0 pad, 1 BOS, 2 EOS, 3 mask, then the learned pieces.
    """
    import sentencepiece as spm

    os.makedirs(out_dir, exist_ok=True)
    corpus = os.path.join(out_dir, "corpus.txt")
    with open(corpus, "w") as handle:
        for text in texts:
            handle.write(text.replace("\n", " ") + "\n")
    prefix = os.path.join(out_dir, "tokenizer")
    spm.SentencePieceTrainer.train(
        input=corpus,
        model_prefix=prefix,
        vocab_size=vocab_size,
        model_type=model_type,
        pad_id=0,
        bos_id=1,
        eos_id=2,
        unk_id=4,
        pad_piece=PAD_TOKEN,
        bos_piece=BOS_TOKEN,
        eos_piece=EOS_TOKEN,
        user_defined_symbols=[MASK_TOKEN],
        character_coverage=1.0,
        hard_vocab_limit=False,
        minloglevel=2,
        num_threads=1,
    )
    os.remove(corpus)
    return load_tokenizer(out_dir)


def load_tokenizer(path: str) -> Tokenizer:
    """Load from a directory with ``tokenizer.json`` (HF) or a ``*.model`` (sentencepiece), or a file."""
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "tokenizer.json")):
            return _load_hf(path)
        models = sorted(glob.glob(os.path.join(path, "*.model")))
        if models:
            return _load_sentencepiece(models[0])
        raise FileNotFoundError(f"no tokenizer.json or *.model in {path}")
    if path.endswith(".model") and os.path.isfile(path):
        return _load_sentencepiece(path)
    raise FileNotFoundError(f"tokenizer not found: {path}")


def _load_sentencepiece(model_file: str) -> Tokenizer:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model_file)
    mask = sp.piece_to_id(MASK_TOKEN)
    if sp.id_to_piece(mask) != MASK_TOKEN:
        raise ValueError(f"{model_file} has no {MASK_TOKEN} piece; train it with train_sentencepiece()")
    return Tokenizer(
        sp,
        "sentencepiece",
        mask,
        sp.eos_id(),
        sp.pad_id(),
        sp.bos_id() if sp.bos_id() >= 0 else None,
        sp.get_piece_size(),
        model_file,
    )


def _load_hf(path: str) -> Tokenizer:
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast.from_pretrained(path)
    vocab = tok.get_vocab()
    mask = next((vocab[t] for t in KNOWN_MASK_TOKENS if t in vocab), None)
    config_file = os.path.join(path, "config.json")
    config = json.load(open(config_file)) if os.path.isfile(config_file) else {}
    mask = config.get("mask_token_id", mask)
    if mask is None:
        raise ValueError(f"{path}: tokenizer has no mask token (tried {', '.join(KNOWN_MASK_TOKENS)})")
    eos = tok.eos_token_id if tok.eos_token_id is not None else config.get("eos_token_id")
    if eos is None:
        raise ValueError(f"{path}: tokenizer has no EOS token")
    pad = tok.pad_token_id if tok.pad_token_id is not None else config.get("pad_token_id", eos)
    return Tokenizer(tok, "hf", int(mask), int(eos), int(pad), tok.bos_token_id, len(tok), path)
