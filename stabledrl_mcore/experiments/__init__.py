"""Small self-contained experiments built from the library: the demo (docs/experiments.md)
(:mod:`.demo`) and the GRPO-vs-StableDRL stability experiment (:mod:`.stress`),
both on the embedded tiny Sudoku setting (:mod:`.tiny_sudoku`)."""
