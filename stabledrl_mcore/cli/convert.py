"""``stabledrl convert hf-to-mcore | mcore-to-hf``: the converters of :mod:`stabledrl_mcore.convert.convert` with progress, verification and safe interruption."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import warnings
from typing import Callable

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.convert.convert import VerificationFailed, hf_to_mcore, mcore_to_hf
from stabledrl_mcore.convert.safetensors_io import DEFAULT_MAX_SHARD_BYTES
from stabledrl_mcore.convert.verify import verify


# ------------------------------------------------------------------ command line
def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MB"``, ``"2GiB"`` or a byte count."""
    units = {"kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30, "b": 1}
    low = text.strip().lower()
    for suffix in sorted(units, key=len, reverse=True):
        if low.endswith(suffix):
            return int(float(low[: -len(suffix)]) * units[suffix])
    return int(low)


def add_convert_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``hf-to-mcore`` / ``mcore-to-hf`` subcommands to ``parser``."""
    sub = parser.add_subparsers(dest="direction", metavar="DIRECTION")
    sub.required = True
    a = sub.add_parser("hf-to-mcore", help="Hugging Face directory -> Megatron torch_dist checkpoint")
    a.add_argument(
        "--model",
        required=True,
        metavar="ARCH|PRESET",
        help="llada or sdar (any shape), or a preset such as llada-8b / sdar-8b "
        "(the checkpoint must then have the preset's shape)",
    )
    a.add_argument("--hf-dir", required=True, metavar="DIR")
    a.add_argument("--tp", type=int, default=1, help="suggested tensor parallel size (checked, recorded)")
    a.add_argument("--pp", type=int, default=1, help="suggested pipeline parallel size (checked, recorded)")
    a.add_argument(
        "--ep", type=int, default=1, help="suggested expert parallel size of an MoE model (checked, recorded)"
    )
    a.add_argument(
        "--vocab-multiple",
        type=int,
        default=1,
        metavar="K",
        help="pad vocab rows to a multiple of K x TP (make_vocab_size_divisible_by)",
    )
    b = sub.add_parser("mcore-to-hf", help="Megatron checkpoint -> Hugging Face safetensors directory")
    b.add_argument("--ckpt", required=True, metavar="DIR")
    b.add_argument(  # as eval's and generate's (cli/args.py); not imported: convert starts light
        "--trust-unverified",
        action="store_true",
        help="export a checkpoint that has no checksums.json (written by an older stabledrl), unverified; "
        "refused by default. Links, FIFOs and devices in it are refused either way",
    )
    b.add_argument("--hf-assets", metavar="DIR", help="config/tokenizer source (default: <ckpt>/hf)")
    b.add_argument(
        "--lora-base",
        metavar="DIR",
        help="a LoRA run's checkpoint: where its base is now (default: the model.checkpoint of its config.yaml)",
    )
    b.add_argument(
        "--peft-out",
        metavar="DIR",
        help="a LoRA run's checkpoint: also write its adapter in PEFT's format (adapter_model.safetensors)",
    )
    b.add_argument(
        "--max-shard-size",
        type=parse_size,
        default=DEFAULT_MAX_SHARD_BYTES,
        metavar="SIZE",
        help="largest safetensors shard, e.g. 5GB (default)",
    )
    b.add_argument(
        "--remote-code",
        action="append",
        metavar="FILE.py",
        help="with --verify: load the export with this upstream modeling file (e.g. modeling_llada.py; "
        "its configuration_*.py beside it is taken too) under the installed transformers and compare "
        "its logits with the Megatron model (implies --reference remote; repeatable). This EXECUTES the "
        "file (and that configuration_*.py) as Python, with your permissions (trust_remote_code): give "
        "only code you trust",
    )
    for p in (a, b):
        p.add_argument("--out", required=True, metavar="DIR")
        p.add_argument(
            "--dtype",
            choices=("auto", "bf16", "fp32"),
            default="auto",
            help="weight dtype of the output (auto = as stored)",
        )
        p.add_argument(
            "--overwrite",
            action="store_true",
            help="replace a non-empty --out: what it held is moved aside to OUT.overwritten-<UTC>, not deleted",
        )
        p.add_argument(
            "--verify", action="store_true", help="compare logits of an independent reference with the converted model"
        )
        p.add_argument(
            "--reference",
            choices=("public", "remote"),
            default=None,
            help="public transformers classes (default) or the upstream remote code (the export's own *.py, "
            "or --remote-code), which runs that code as Python (trust_remote_code)",
        )
        p.add_argument("--tolerance", type=float, default=1e-4, help="max abs logit difference")
        p.add_argument(
            "--allow-nonfinite",
            action="store_true",
            help="convert weights holding NaN/inf (refused by default, naming the tensor)",
        )
        p.add_argument("--no-progress", action="store_true", help="no progress bar")


def run_convert(args: argparse.Namespace) -> int:
    """Run a parsed ``convert`` command; returns the exit status."""

    # torch.distributed.checkpoint deprecation notices raised inside megatron: noise for users
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"(torch\.distributed|megatron)\.")
    dtype = None if args.dtype == "auto" else args.dtype
    remote_code = getattr(args, "remote_code", None) or []
    if remote_code and not args.verify:
        print("stabledrl convert: error: --remote-code is used by --verify; add --verify", file=sys.stderr)
        return 2
    if remote_code and args.reference == "public":
        print(
            "stabledrl convert: error: --remote-code runs the upstream code: drop --reference public", file=sys.stderr
        )
        return 2
    missing = [path for path in remote_code if not os.path.isfile(path)]
    if missing:
        print(f"stabledrl convert: error: --remote-code {missing[0]}: no such file", file=sys.stderr)
        return 2
    args.reference = "remote" if remote_code else (args.reference or "public")
    common = dict(
        dtype=dtype,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        allow_nonfinite=args.allow_nonfinite,
        before_commit=_verifier(args) if args.verify else None,
    )
    restore = _exit_on_sigterm()
    try:
        if args.direction == "hf-to-mcore":
            out = hf_to_mcore(
                args.hf_dir,
                args.out,
                model=args.model,
                tp=args.tp,
                pp=args.pp,
                ep=args.ep,
                vocab_multiple=args.vocab_multiple,
                **common,
            )
        else:
            out = mcore_to_hf(
                args.ckpt,
                args.out,
                hf_assets=args.hf_assets,
                max_shard_bytes=args.max_shard_size,
                lora_base=args.lora_base,
                peft_out=args.peft_out,
                trust_unverified=args.trust_unverified,
                **common,
            )
        print(f"wrote {out}")
        return 0
    except VerificationFailed as err:
        print(f"stabledrl convert: error: {err}", file=sys.stderr)
        return 1
    except ConversionError as err:
        print(f"stabledrl convert: error: {err}", file=sys.stderr)
        return 2
    finally:
        restore()


def _verifier(args: argparse.Namespace) -> Callable[[str], None]:
    """``--verify`` as a check of the finished temporary output (raises :class:`VerificationFailed`)."""

    def check(tmp: str) -> None:

        hf_dir, ckpt = (args.hf_dir, tmp) if args.direction == "hf-to-mcore" else (tmp, args.ckpt)
        diff = verify(
            hf_dir,
            ckpt,
            reference=args.reference,
            remote_code=getattr(args, "remote_code", None) or (),
            trust_unverified=getattr(args, "trust_unverified", False),
        )
        ok = diff <= args.tolerance
        print(f"verify: max abs logit difference {diff:.3e} ({'ok' if ok else 'ABOVE'} tolerance {args.tolerance:g})")
        if not ok:
            raise VerificationFailed(
                f"--verify: max abs logit difference {diff:.3e} is above --tolerance "
                f"{args.tolerance:g}; nothing was written to {os.path.abspath(args.out)}"
            )

    return check


def _exit_on_sigterm() -> Callable[[], None]:
    """SIGTERM ends the conversion like Ctrl-C (its temporary output removed); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)
