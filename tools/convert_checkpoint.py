#!/usr/bin/env python
"""Convert LLaDA / SDAR checkpoints between Hugging Face and Megatron-Core (torch_dist).

Same command as ``stabledrl convert``::

    python tools/convert_checkpoint.py hf-to-mcore --model llada --hf-dir LLaDA-8B-Instruct \\
        --out ckpt/llada-8b --tp 2 --pp 2 --dtype bf16 [--verify]
    python tools/convert_checkpoint.py mcore-to-hf --ckpt ckpt/llada-8b --out LLaDA-8B-export

See ``stabledrl_mcore/convert/convert.py`` for every option and the exit codes.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None) -> int:
    from stabledrl_mcore.cli.convert import add_convert_arguments, run_convert

    parser = argparse.ArgumentParser(prog="convert_checkpoint", description=__doc__.split("\n")[0])
    add_convert_arguments(parser)
    return run_convert(parser.parse_args(argv))


if __name__ == "__main__":  # the guard matters: dist_checkpointing's writer re-imports __main__
    sys.exit(main())
