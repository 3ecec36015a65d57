"""Throughput benchmarks of a StableDRL step (``stabledrl bench``).

- :mod:`.phases`: timing of each phase (warm-up, repetitions, median, IQR) over the library's step functions;
- :mod:`.flops`: model FLOPs per token of the presets (what MFU counts) and a forward-hook FLOP counter;
- :mod:`.peak`: the peak MFU is taken against, in the model's dtype (a GPU's rated bf16 peak for a bf16
  model, else the matmul rate of that dtype measured in the run);
- :mod:`.baseline`: the same step the way public dLLM RL code runs it (``transformers`` model, loops);
- :mod:`.scaling`: weak scaling at 1 vs 2 data-parallel ranks;
- :mod:`.report`: console table and JSON; :mod:`.run`: the command.

The memory/throughput planner is :mod:`stabledrl_mcore.bench.plan` (``stabledrl plan``).
"""
