"""stabledrl_mcore: StableDRL post-training of diffusion language models on Megatron-Core.

Subpackages: ``models`` (specs, attention, presets), ``diffusion`` (masking,
likelihood, sampling), ``rl`` (losses, advantages, rollout, trainer), ``tasks``,
``checkpoint`` (mapping tables, converters, training state), ``parallel``
(bootstrap, CPU layer). ``config`` holds the typed run configuration and
``cli`` the ``stabledrl`` command.
"""

__version__ = "0.1.0"
