"""HF <-> Megatron-Core checkpoint conversion for LLaDA and SDAR (dense and MoE), and its command line.

``hf_to_mcore``: upstream directory (``config.json`` in the model's own field
names, ``model.safetensors`` or shards + ``model.safetensors.index.json``,
tokenizer files, optional ``*.py`` remote code) -> model-only ``torch_dist``
checkpoint (:mod:`..checkpoint.mcore_io` describes the layout) loadable at any TP/PP.
``mcore_to_hf``: the way back, to safetensors shards + index, ``config.json``
and every non-weight upstream file, so that ``transformers`` loads the result.

Both run in one process at TP=1/PP=1 and stream: HF -> Megatron reads tensors
one at a time from memory maps into a never-initialised model shell and saves
once; Megatron -> HF loads one layer at a time and writes each tensor straight
into its safetensors shard. Peak memory is about one copy of the weights
(``tools/bench_convert.py``). A conversion first claims its target (``.<name>.claim.json``
beside it, created atomically): a second conversion into the same target is refused at once,
naming the first one's pid and the claim's date; a claim whose process is gone, or whose pid now runs
a process started after the claim (pid reuse), is taken over. Output goes to
``.tmp-<name>-*`` beside the target and is renamed into place only when complete (and, with
``--verify``, checked), so an interrupted run never leaves anything that looks like a valid
checkpoint; any failure (an error, Ctrl-C, SIGTERM) removes it, and one left by a SIGKILLed run
is removed by the next conversion to the same target. ``--overwrite`` moves what the target held
aside to ``<target>.overwritten-<UTC>`` at the commit; nothing is deleted. Non-finite weights (NaN/inf), in
either direction, and finite ones that a ``--dtype`` cast turns into inf are refused, naming the
tensor and the count, unless ``--allow-nonfinite``.

CLI (``stabledrl convert ...`` and ``python tools/convert_checkpoint.py ...``)::

    hf-to-mcore --model {llada,sdar,<preset>} --hf-dir DIR --out DIR [--tp N] [--pp M] [--ep E]
                [--dtype auto|bf16|fp32] [--vocab-multiple K] [--overwrite] [--verify]
                [--allow-nonfinite]
    mcore-to-hf --ckpt DIR --out DIR [--hf-assets DIR] [--dtype ...]
                [--max-shard-size 5GB] [--overwrite] [--verify] [--allow-nonfinite]

Exit status: 0 done, 1 ``--verify`` found logits further apart than ``--tolerance``
(nothing is written; an existing output stays), 2 bad input
(:class:`~..checkpoint.errors.ConversionError`, message names the culprit), 143 SIGTERM.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import time
from typing import Callable, Optional

import torch
from tqdm import tqdm

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.info import DTYPES, HF_ASSETS, read_checkpoint_info, write_json
from stabledrl_mcore.checkpoint.integrity import verify_checksums, write_checksums
from stabledrl_mcore.checkpoint.mcore_io import (
    attach,
    build_shell,
    copy_assets,
    discard_output,
    ensure_single_process,
    expanded_sharded_state_dict,
    finalize_output,
    iter_full_tensors,
    prepare_output,
    write_marker,
)
from stabledrl_mcore.checkpoint.state import read_lora_run
from stabledrl_mcore.checkpoint.writers import save_sharded
from stabledrl_mcore.convert import hf_config as hfc
from stabledrl_mcore.convert.engine import MappingEngine
from stabledrl_mcore.convert.loader import is_hf_dir
from stabledrl_mcore.convert.lora_io import Adapters, base_source, write_peft_adapter
from stabledrl_mcore.convert.mappings import VocabRows, table_for
from stabledrl_mcore.convert.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    FiniteReader,
    SafetensorsReader,
    SafetensorsWriter,
    check_finite,
)
from stabledrl_mcore.models import DLLMConfig, available_presets, get_preset
from stabledrl_mcore.parallel import bootstrap

HF_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


class VerificationFailed(ConversionError):
    """``--verify``: the converted model's logits differ from the reference's beyond the tolerance."""


def _fault_injection_pause() -> None:
    """Tests set ``STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT`` (seconds) to kill a conversion mid-way."""
    pause = float(os.environ.get("STABLEDRL_FAULT_PAUSE_BEFORE_COMMIT", "0") or 0)
    if pause > 0:
        time.sleep(pause)


def _by_group(items, total: int, desc: str, enabled: bool):
    """Pass ``(group, ...)`` items through, with a tqdm bar advancing once per group."""

    with tqdm(total=total, desc=desc, unit="group", disable=not enabled, file=sys.stderr) as bar:
        current = None
        for item in items:
            if item[0] != current:
                bar.update(current is not None)
                current = item[0]
            yield item
        bar.update(current is not None)


def check_layout(cfg: DLLMConfig, tp: int, pp: int, ep: int = 1) -> None:
    """The suggested layout must split heads, KV groups, FFN (each expert's, for MoE: the expert
    tensor-parallel size is TP), layers and experts (``ep``) evenly."""
    problems = []
    ffn = ("moe_ffn_hidden_size", cfg.moe_ffn_hidden_size) if cfg.is_moe else ("ffn_hidden_size", cfg.ffn_hidden_size)
    for name, value, parts in (
        ("num_attention_heads", cfg.num_attention_heads, tp),
        ("num_query_groups", cfg.num_query_groups, tp),
        (*ffn, tp),
        ("num_layers", cfg.num_layers, pp),
    ):
        if parts < 1 or value % parts:
            problems.append(f"{name} ({value}) is not divisible by {parts}")
    if ep != 1 and not cfg.is_moe:
        problems.append(f"--ep {ep} needs a mixture-of-experts model; this one is dense (use --ep 1)")
    elif ep < 1 or (cfg.is_moe and cfg.num_experts % ep):
        problems.append(f"num_experts ({cfg.num_experts}) is not divisible by --ep {ep}")
    elif ep > 1 and pp > 1:
        problems.append("expert parallelism runs with PP=1 only (use --pp 1 with --ep)")
    if problems:
        shown = f"TP={tp} PP={pp}" + (f" EP={ep}" if ep != 1 else "")
        raise ConversionError(f"layout {shown} does not fit the model: " + "; ".join(problems))


def layout_record(cfg: DLLMConfig, tp: int, pp: int, ep: int = 1) -> dict:
    """The ``suggested_layout`` of the marker (``expert_parallel`` only for MoE models)."""
    layout = {"tensor_parallel": tp, "pipeline_parallel": pp}
    if cfg.is_moe:
        layout["expert_parallel"] = ep
    return layout


# ------------------------------------------------------------------ HF -> Megatron
SHAPE_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "ffn_hidden_size",
    "qk_layernorm",
    "num_experts",
    "moe_ffn_hidden_size",
    "moe_router_topk",
)


def resolve_model_choice(model: Optional[str]):
    """``--model``: an architecture (``llada``/``sdar``) or a preset name (``llada-8b``, ...).

    Returns ``(arch or None, preset name or None)``; a preset also fixes the shape
    the checkpoint must have (:func:`check_preset_shape`).
    """

    if model is None or model in hfc.MODEL_TYPES.values():
        return model, None
    if model in available_presets():
        return get_preset(model).arch, model
    raise ConversionError(
        f"--model {model!r} is neither an architecture "
        f"({', '.join(sorted(hfc.MODEL_TYPES.values()))}) nor a preset "
        f"({', '.join(available_presets())})"
    )


def check_preset_shape(cfg, preset: str) -> None:
    """The checkpoint has the shape of ``preset`` (else a one-line error naming the fields)."""

    want = get_preset(preset)
    wrong = [
        f"{f} {getattr(cfg, f)} (preset {getattr(want, f)})"
        for f in SHAPE_FIELDS
        if getattr(cfg, f) != getattr(want, f)
    ]
    if wrong:
        raise ConversionError(
            f"--model {preset}: the checkpoint does not have the preset's shape: "
            f"{', '.join(wrong)}; pass --model {want.arch} to convert any {want.arch} "
            "checkpoint"
        )


def hf_to_mcore(
    hf_dir: str,
    out: str,
    *,
    model: Optional[str] = None,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    dtype: Optional[str] = None,
    vocab_multiple: int = 1,
    overwrite: bool = False,
    progress: bool = True,
    allow_nonfinite: bool = False,
    before_commit: Optional[Callable[[str], None]] = None,
) -> str:
    """Convert an upstream LLaDA/SDAR directory to a model-only ``torch_dist`` checkpoint.

    ``dtype``: ``"bf16"``/``"fp32"``/``"fp16"`` or None (keep the stored dtype).
    ``vocab_multiple``: ``make_vocab_size_divisible_by`` recorded in the config
    (rows are zero-padded to it). ``tp``/``pp``/``ep`` (expert parallel, MoE) are checked and
    recorded as the suggested layout; the checkpoint loads at any layout. ``before_commit(tmp)``
    (e.g. a logit check) runs on the finished temporary output; if it raises,
    nothing is written. Returns ``out``.
    """

    raw = hfc.read_hf_config(hf_dir)
    expected_arch, preset = resolve_model_choice(model)
    arch = hfc.detect_arch(raw, expected_arch)
    cfg = hfc.hf_to_dllm_config(raw, arch, source_dir=hf_dir, make_vocab_size_divisible_by=vocab_multiple)
    if preset is not None:
        check_preset_shape(cfg, preset)
    check_layout(cfg, tp, pp, ep)
    reader = SafetensorsReader(hf_dir)
    tied = hfc.is_tied(raw, arch)
    engine = MappingEngine(table_for(arch, cfg), cfg, tied=tied)
    engine.check_source(reader)
    first = engine.groups()[0][1][0]
    target = DTYPES[dtype] if dtype else reader.dtype(first.hf_names()[0])
    if target not in HF_DTYPE_NAMES:
        raise ConversionError(f"weights are stored as {target}; pass --dtype bf16 or fp32")
    tmp = prepare_output(out, overwrite, protect=hf_dir)
    started, owns_megatron = time.time(), False
    try:
        owns_megatron = ensure_single_process()
        entries = expanded_sharded_state_dict(build_shell(cfg, target))
        expected = {m.megatron for _, group in engine.groups() for m in group}
        tensors = {k for k, v in entries.items() if k.endswith(".weight")}
        if tensors != expected:
            raise ConversionError(f"mapping table and model disagree: {sorted(tensors ^ expected)[:5]}")
        items = engine.iter_megatron(reader if allow_nonfinite else FiniteReader(reader), target)
        for _, name, blocks in _by_group(items, len(engine.groups()), "hf-to-mcore", progress):
            if not allow_nonfinite and dtype:  # finite in the source, but beyond the range of --dtype?
                for block in blocks:
                    check_finite(name, block, f"{hf_dir} cast to {HF_DTYPE_NAMES[target]}")
            attach(entries[name], blocks)
        save_sharded(entries, tmp)
        del entries
        copy_assets(hf_dir, os.path.join(tmp, HF_ASSETS), skip=())
        write_marker(
            tmp,
            cfg,
            dtype=target,
            tied=tied,
            layout=layout_record(cfg, tp, pp, ep),
            source={
                "hf_dir": os.path.abspath(hf_dir),
                "weight_bytes": reader.nbytes(),
                "seconds": round(time.time() - started, 2),
            },
        )
        write_checksums(tmp)  # last: size and SHA-256 of every file above, verified at every load
        _fault_injection_pause()
        if before_commit is not None:
            before_commit(tmp)
        return finalize_output(tmp, out)
    finally:
        discard_output(tmp, out)  # nothing left once finalized; the unfinished output on any failure; the claim
        if owns_megatron:
            bootstrap.destroy()


# ------------------------------------------------------------------ Megatron -> HF
def _head_still_tied(path, shell, engine, dtype) -> bool:
    """Export a tied model without ``lm_head`` only if training left head == embedding."""
    pair = [("tie check", [m for _, g in engine.groups() for m in g if isinstance(m, VocabRows)])]
    tensors = [t for _, _, t in iter_full_tensors(path, shell, pair, dtype)]
    return torch.equal(tensors[0][: engine.cfg.vocab_size], tensors[1][: engine.cfg.vocab_size])


def mcore_to_hf(
    ckpt: str,
    out: str,
    *,
    hf_assets: Optional[str] = None,
    dtype: Optional[str] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    progress: bool = True,
    allow_nonfinite: bool = False,
    before_commit: Optional[Callable[[str], None]] = None,
    lora_base: Optional[str] = None,
    peft_out: Optional[str] = None,
    trust_unverified: bool = False,
) -> str:
    """Export a converted (or training) checkpoint to an upstream-format HF directory.

    ``hf_assets``: where ``config.json``/tokenizer/``*.py`` come from (default:
    the checkpoint's ``hf/``); without any, a template config is written.
    ``allow_nonfinite``/``before_commit``: as in :func:`hf_to_mcore`. A LoRA run's checkpoint
    (adapters only, :mod:`.lora_io`) is exported merged into its base (``lora_base`` replaces
    the base its ``config.yaml`` names); ``peft_out`` also writes the adapter in PEFT's format.
    ``ckpt`` (and a Megatron base) is verified first (``checksums.json``: one without is refused
    unless ``trust_unverified``; links and FIFOs always).
    """
    if not os.path.isdir(ckpt):
        raise ConversionError(f"{ckpt} is not a directory")
    verify_checksums(ckpt, trust_unverified=trust_unverified)
    lora = read_lora_run(ckpt, lora_base)
    if peft_out and lora is None:
        raise ConversionError(f"--peft-out: {ckpt} holds no LoRA adapters (its run had model.lora.rank=0)")
    source = None
    if lora is not None:
        if not is_hf_dir(lora.base):
            verify_checksums(lora.base, trust_unverified=trust_unverified)
        base_info, source = base_source(lora.base, ckpt)
        own_assets = os.path.join(ckpt, HF_ASSETS)
        info = dataclasses.replace(  # the adapted model ran in the run's model.dtype
            base_info,
            path=ckpt,
            dtype=DTYPES[lora.dtype],
            hf_assets=own_assets if os.path.isdir(own_assets) else base_info.hf_assets,
        )
    else:
        info = read_checkpoint_info(ckpt)
    cfg, assets = info.config, hf_assets or info.hf_assets
    base = hfc.read_hf_config(assets) if assets and os.path.isfile(os.path.join(assets, "config.json")) else None
    target = DTYPES[dtype] if dtype else info.dtype
    engine = MappingEngine(table_for(cfg.arch, cfg), cfg, tied=info.tied_embeddings)
    tmp = prepare_output(out, overwrite, protect=ckpt)
    owns_megatron, writer = False, None
    try:
        owns_megatron = ensure_single_process()
        shell = build_shell(cfg, info.dtype)
        found = Adapters(ckpt, cfg, lora.settings) if lora is not None else None
        tied = info.tied_embeddings and (lora is not None or _head_still_tied(ckpt, shell, engine, info.dtype))
        if info.tied_embeddings and not tied:
            print(
                "stabledrl convert: warning: LM head no longer equals the embedding; exporting it untied",
                file=sys.stderr,
            )
        writer = SafetensorsWriter(tmp, engine.hf_plan(target, omit_head=tied), max_shard_bytes)
        if source is None:
            items = iter_full_tensors(ckpt, shell, engine.groups(), info.dtype)
        else:  # the base as stored, streamed; each adapted weight gets its adapter's change in float32
            items = ((g, name, found.merged(name, full)) for g, name, full in source(shell, engine))
        for _, name, full in _by_group(items, len(engine.groups()), "mcore-to-hf", progress):
            if tied and name == "output_layer.weight":
                continue
            if not allow_nonfinite:
                check_finite(name, full, ckpt)
            for hf_name, tensor in engine.to_hf(name, full):
                cast = tensor.to(target)  # the one rounding (a merged LoRA weight arrives in float32)
                if not allow_nonfinite and cast.dtype != tensor.dtype:  # beyond the range of the output?
                    check_finite(hf_name, cast, f"{ckpt} cast to {HF_DTYPE_NAMES[target]}")
                writer.write(hf_name, cast)
        writer.close()
        if assets:
            copy_assets(assets, tmp)
        config = hfc.dllm_to_hf_config(cfg, base, dtype=HF_DTYPE_NAMES[target], tied=tied)
        write_json(os.path.join(tmp, "config.json"), config)
        if before_commit is not None:
            before_commit(tmp)
        if peft_out:
            write_peft_adapter(peft_out, found, base_name=os.path.abspath(lora.base), dtype=target)
        return finalize_output(tmp, out)
    finally:
        if writer is not None:
            writer.abort()
        discard_output(tmp, out)
        if owns_megatron:
            bootstrap.destroy()
