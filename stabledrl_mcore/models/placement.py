"""The device rule: where a model lives, and every tensor a phase creates follows it.

One rule for the whole library: a model is built on (or moved to) this rank's
GPU before it is wrapped in DDP, norms included and in ``params_dtype``
(:func:`place_model`); every phase (rollout, likelihood, update, evaluation,
benchmarks) takes its device from the model (:func:`model_device`) and names it
in every tensor factory call and ``torch.Generator`` it makes. Host tensors
(tokenised prompts before their one copy, layout descriptors, data order) name
``device="cpu"`` explicitly. ``tests/test_device_rule.py`` enforces this on CPU.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Union

import torch


def default_device() -> torch.device:
    """This rank's GPU (``torch.cuda.current_device()``, set by the bootstrap) or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def model_device(model) -> torch.device:
    """The device of a model's (or a wrapper's, e.g. DDP) first parameter."""
    for param in model.parameters():
        return param.device
    raise ValueError("the model has no parameters, so it has no device")


def place_model(model: torch.nn.Module, device: Union[str, torch.device], params_dtype: torch.dtype) -> torch.nn.Module:
    """Every parameter and buffer on ``device``, every floating parameter in ``params_dtype``.

    Megatron creates its linears and embeddings on ``cuda:current`` (or the CPU with
    ``use_cpu_initialization``) in ``params_dtype``, but the local spec's norms are
    plain ``torch.nn.RMSNorm`` modules: CPU and fp32 whatever the config says. Left
    there they break the first GPU forward, and in bf16 Megatron's optimizer cannot
    map them (``Param id ... does not match any model sharded param``). Megatron-LM's
    ``Float16Module`` casts the whole model the same way; the norms still normalise in
    fp32 inside ``torch.rms_norm``.
    """
    model.to(device=device)
    for param in model.parameters():
        if param.is_floating_point() and param.dtype != params_dtype:
            param.data = param.data.to(params_dtype)
    return model


@contextlib.contextmanager
def eval_mode(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """``model.eval()`` for the block, then the previous train/eval mode again.

    Rollouts and evaluation decode in eval mode whatever the training mode:
    Megatron's activation recompute (and dropout) only act in training mode, and
    a KV cache cannot be combined with recompute.
    """
    was_training = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was_training)
