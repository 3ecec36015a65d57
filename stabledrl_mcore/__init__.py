"""stabledrl_mcore: StableDRL post-training of diffusion language models on Megatron-Core.

Subpackages: ``models`` (specs, attention, presets), ``diffusion`` (masking,
likelihood, sampling), ``rl`` (losses, advantages, rollout, trainer), ``tasks``,
``checkpoint`` (mapping tables, converters, training state), ``parallel``
(bootstrap, CPU layer). ``config`` holds the typed run configuration and
``cli`` the ``stabledrl`` command.
"""

from stabledrl_mcore.common.version import __version__  # noqa: F401  (the package API)


def _quiet_cpu_warnings() -> None:
    """megatron-core warns at import that TE/apex are absent (expected on CPU), and its
    checkpoint loader uses torch.distributed.checkpoint APIs that torch marks deprecated;
    neither is actionable for a user, so both are silenced."""
    import warnings

    for text in ("Transformer Engine and Apex are not installed", "Apex is not installed"):
        warnings.filterwarnings("ignore", message=text, category=UserWarning)
    for text in ("`load_state_dict` is deprecated", "Please use DTensor instead"):
        warnings.filterwarnings("ignore", message=text, category=FutureWarning)


_quiet_cpu_warnings()


def load_model(*args, **kwargs):
    """HF directory or converted checkpoint -> single-process logits module
    (see :func:`stabledrl_mcore.checkpoint.loader.load_model`)."""
    from stabledrl_mcore.checkpoint.loader import load_model as _load_model

    return _load_model(*args, **kwargs)
