"""The HF <-> Megatron tables of docs/models.md, generated from stabledrl_mcore/convert/mappings.py.

    python tools/mapping_tables.py                   # print every table (Markdown)
    python tools/mapping_tables.py --check docs/models.md   # exit 1 if a table there is stale

Rows in table order: the embedding, one layer's rows (``{i}``), an MoE layer's per-expert rows
(``{e}``), the final norm and the head.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, List

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from stabledrl_mcore.convert.mappings import (  # noqa: E402
    LLADA,
    MOE_TABLES,
    QKV,
    SDAR,
    Direct,
    GatedMLP,
    Mapping,
    ModelTable,
    VocabRows,
)

TABLE_NAMES = {"llada": LLADA, "sdar": SDAR, "sdar-moe": MOE_TABLES["sdar"]}
HEADER = "| Megatron-Core parameter | Hugging Face tensor(s) | how |\n| --- | --- | --- |"


def how(mapping: Mapping) -> str:
    """One mapping row's rule in words."""
    if isinstance(mapping, VocabRows):
        text = "rows zero-padded to the padded vocabulary, cut back on export"
        return text + (f"; a tied head is read from `{mapping.tied_to}`" if mapping.tied_to else "")
    if isinstance(mapping, QKV):
        return "rows grouped per KV group g: [q heads of g; k_g; v_g]"
    if isinstance(mapping, GatedMLP):
        return "concatenated rows [gate; up]"
    if isinstance(mapping, Direct):
        return "the same tensor"
    raise TypeError(f"no description for {type(mapping).__name__}")


def render(table: ModelTable) -> str:
    rows: List[str] = [HEADER]
    for mapping in [*table.head, *table.layer, *table.expert, *table.tail]:
        names = ", ".join(f"`{n}`" for n in mapping.hf_names())
        rows.append(f"| `{mapping.megatron}` | {names} | {how(mapping)} |")
    return "\n".join(rows)


def all_tables() -> Dict[str, str]:
    return {name: render(table) for name, table in TABLE_NAMES.items()}


def stale_tables(doc_path: str) -> List[str]:
    """Names of the tables whose generated text does not appear verbatim in ``doc_path``."""
    with open(doc_path) as handle:
        text = handle.read()
    return [name for name, table in all_tables().items() if table not in text]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", metavar="DOC", help="check that DOC holds every table as generated")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_tables(args.check)
        if stale:
            print(
                f"{args.check}: stale mapping table(s) {stale}; regenerate with python tools/mapping_tables.py",
                file=sys.stderr,
            )
            return 1
        return 0
    for name, table in all_tables().items():
        print(f"**{name}**\n\n{table}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
