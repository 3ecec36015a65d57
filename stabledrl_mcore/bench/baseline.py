"""The side-by-side baseline: the same StableDRL step written the way public dLLM RL code does it.

Same model size, same prompts, same masks, same loss; what differs is how the
work is done, following the public LLaDA/d1 and SDAR code paths:

- the model is ``transformers``' ``LlamaForCausalLM`` (LLaDA shape, bidirectional
  through an all-zero additive 4-D mask) or ``Qwen3ForCausalLM`` (SDAR shape,
  block-causal additive mask; ``Qwen3MoeForCausalLM`` for a mixture of experts), ``sdpa`` attention;
- LLaDA rollouts (LLaDA ``generate.py`` / d1): every denoising step runs the whole
  sequence, adds Gumbel noise to the full ``[B, S, V]`` logits in float64, takes
  the float64 softmax of all of them, and picks the tokens to commit with a
  per-sample Python loop of ``topk`` (with ``rollout.threshold``: at least the scheduled count
  and every position at or above it, a block ending once decoded, as our sampler and Fast-dLLM);
- SDAR rollouts (SDAR's ``generate``): block by block with ``transformers``'
  ``DynamicCache`` (each denoising step attends to the cache, then its keys are
  cropped off; a finished block is run once more to store it), multinomial
  sampling, per-sample ``topk`` loop (or ``rollout.threshold``'s dynamic rule, as upstream);
- likelihoods: one forward per draw and micro-batch, then a per-sample loop of
  full-vocabulary ``log_softmax`` over every position (not just the scored ones);
  the block-diffusion (staircase) estimate is one forward *per block* (clean
  prefix + noisy block), as block-diffusion RL code computes it;
- the update keeps the autograd graph of the whole batch and calls
  ``backward`` once on the StableDRL loss (no linearisation); ``torch.optim.AdamW``
  with ``clip_grad_norm_``; gradients all-reduced parameter by parameter when
  several ranks run it.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Dict, Optional, Sequence

import torch

from stabledrl_mcore.algorithms.losses import sequence_policy_loss
from stabledrl_mcore.bench.phases import fill_flat_groups, phase_jobs
from stabledrl_mcore.convert.hf_config import transformers_shape
from stabledrl_mcore.engine.seeding import chunk_generators, derive_seed, first_chunk
from stabledrl_mcore.models.masks import block_causal_mask, padding_mask
from stabledrl_mcore.rl.estimates import draw_plan, sequence_estimates
from stabledrl_mcore.rl.rollout import RolloutBatch, completion_mask_until_eos, score_rollouts
from stabledrl_mcore.tasks.prompts import encode_prompts


def hf_model(cfg, dtype: torch.dtype = torch.float32):
    """A randomly initialised ``transformers`` model with the shapes of ``cfg`` (a DLLMConfig)."""
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    transformers.logging.set_verbosity_error()
    common = transformers_shape(cfg, tied=False, attn_implementation="sdpa", initializer_range=cfg.init_std)
    if cfg.arch == "llada":
        model = LlamaForCausalLM(LlamaConfig(mlp_bias=False, **common))
    elif cfg.is_moe:  # every layer sparse, the router's top-k (renormalised as ours), no aux loss
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(
                use_sliding_window=False,
                decoder_sparse_step=1,
                mlp_only_layers=[],
                num_experts=cfg.num_experts,
                num_experts_per_tok=cfg.moe_router_topk,
                moe_intermediate_size=cfg.moe_ffn_hidden_size,
                norm_topk_prob=cfg.moe_norm_topk_prob,
                output_router_logits=False,
                router_aux_loss_coef=0.0,
                **common,
            )
        )
    else:
        model = Qwen3ForCausalLM(Qwen3Config(use_sliding_window=False, **common))
    return model.to(dtype)


def additive(blocked: torch.Tensor, batch: int, dtype=torch.float32) -> torch.Tensor:
    """Bool mask (True = blocked, broadcastable to ``[B, 1, S, K]``) -> additive float mask."""
    shape = (batch, 1, blocked.shape[-2], blocked.shape[-1])
    return torch.zeros(shape, dtype=dtype, device=blocked.device).masked_fill(
        blocked.expand(shape), torch.finfo(dtype).min
    )


class BaselineStep:
    """Phases of the baseline step on a plain ``transformers`` model (see the module doc)."""

    def __init__(self, ours, *, device: Optional[str] = None):
        """``ours``: the :class:`~stabledrl_mcore.bench.phases.StableDRLPhases` whose batch and masks to reuse."""
        s = ours.s
        self.ours, self.cfg, self.dcfg = ours, s.cfg, s.model.dllm_config
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        dtype = torch.bfloat16 if self.cfg.model.dtype == "bf16" else torch.float32
        self.dtype = dtype
        self.model = hf_model(self.dcfg, dtype).to(self.device).train()
        o = self.cfg.optim
        self.opt = torch.optim.AdamW(
            self.model.parameters(), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay
        )
        self.batch = dataclasses.replace(ours.batch)
        self.train()  # leaves gradients for the isolated optimizer phase

    # ------------------------------------------------------------------ helpers
    def _logits(self, ids, blocked=None, position_ids=None, cache=None):
        ids = ids.to(self.device)
        if blocked is None:
            blocked = torch.zeros(1, 1, ids.shape[1], ids.shape[1], dtype=torch.bool)
        mask = additive(blocked.to(self.device), ids.shape[0], self.dtype)
        extra = {} if cache is None else {"cache": cache, "use_cache": True}  # transformers 5: `cache`
        return self.model(input_ids=ids, attention_mask=mask, position_ids=position_ids, **extra).logits

    def _generator(self, k: int) -> torch.Generator:

        return torch.Generator().manual_seed(derive_seed(self.cfg.parallel.seed, "baseline", k))

    # ----------------------------------------------------------------- rollout
    @torch.no_grad()
    def _generate_llada(self, prompt, valid, gen):
        r, mask_id = self.cfg.rollout, self.dcfg.mask_token_id
        B, P = prompt.shape
        x = torch.full((B, P + r.gen_length), mask_id, dtype=torch.long)
        x[:, :P] = prompt
        keys = torch.cat([valid, torch.ones(B, r.gen_length, dtype=torch.bool)], 1)
        blocked = padding_mask(keys)
        num_blocks = r.gen_length // r.block_length
        per_block = r.steps // num_blocks
        for b in range(num_blocks):
            start, end = P + b * r.block_length, P + (b + 1) * r.block_length
            counts = (x[:, start:end] == mask_id).sum(1)
            schedule = torch.zeros(B, per_block, dtype=torch.long)
            for j in range(B):  # per-sample schedule, as upstream
                schedule[j] = counts[j] // per_block
                schedule[j, : int(counts[j] % per_block)] += 1
            for i in range(per_block):
                masked = x == mask_id
                if r.threshold is not None and not bool(masked[:, start:end].any()):
                    break  # threshold decoding: a block ends once every row has decoded it
                logits = self._logits(x, blocked).cpu()
                l64 = logits.double()
                noise = torch.rand(l64.shape, generator=gen, dtype=torch.float64)
                x0 = (l64.exp() / (-torch.log(noise)) ** max(r.temperature, 1e-6)).argmax(-1)
                p = torch.softmax(l64, -1)
                conf = p.gather(-1, x0.unsqueeze(-1)).squeeze(-1)
                conf[:, end:] = -torch.inf
                x0 = torch.where(masked, x0, x)
                conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
                transfer = torch.zeros_like(x0, dtype=torch.bool)
                for j in range(B):  # per-sample top-k, as upstream (Fast-dLLM: or all above the threshold)
                    k = min(int(schedule[j, i]), int(torch.isfinite(conf[j]).sum()))
                    if r.threshold is not None:
                        k = max(k, int((conf[j] >= r.threshold).sum()))
                    _, idx = torch.topk(conf[j], k=k)
                    transfer[j, idx] = True
                x[transfer] = x0[transfer]
        return x

    @torch.no_grad()
    def _generate_sdar(self, prompt, valid, gen):
        from transformers import DynamicCache

        r, mask_id = self.cfg.rollout, self.dcfg.mask_token_id
        bs = int(r.block_length or self.dcfg.block_size)  # what the trainer passes to the sampler
        B, P = prompt.shape
        total = -(-(P + r.gen_length) // bs) * bs
        x = torch.full((B, total), mask_id, dtype=torch.long)
        x[:, :P] = prompt
        keys = torch.cat([valid, torch.ones(B, total - P, dtype=torch.bool)], 1)
        pos = torch.arange(total, device=self.device)[None].expand(B, -1)
        base, rem = bs // r.steps, bs % r.steps
        schedule = [base + (1 if i < rem else 0) for i in range(r.steps)]
        cache, prefill = DynamicCache(), (P // bs) * bs
        if prefill:  # prompt blocks into the cache (block-causal)
            self._logits(
                x[:, :prefill],
                block_causal_mask(prefill, bs) | padding_mask(keys[:, :prefill]),
                pos[:, :prefill],
                cache,
            )
        for blk in range(P // bs, total // bs):
            s, e = blk * bs, (blk + 1) * bs
            blocked = padding_mask(keys[:, :e]).expand(B, 1, bs, e)  # a block sees the cache and itself
            for i in range(r.steps):
                masked = x[:, s:e] == mask_id
                if not bool(masked.any()):
                    break
                logits = self._logits(x[:, s:e], blocked, pos[:, s:e], cache).float().cpu()
                cache.crop(-bs)  # attend to the cache without keeping this step's keys
                probs = torch.softmax(logits / max(r.temperature, 1e-6), -1)
                tok = torch.multinomial(probs.reshape(-1, probs.shape[-1]), 1, generator=gen).reshape(B, -1)
                conf = probs.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
                conf = torch.where(masked, conf, torch.full_like(conf, -torch.inf))
                for j in range(B):  # per-sample top-k (or every position above the threshold)
                    k = min(schedule[i], int(masked[j].sum()))
                    high = (conf[j] > r.threshold).nonzero().flatten() if r.threshold is not None else None
                    idx = high if high is not None and len(high) >= k else torch.topk(conf[j], k=k).indices
                    x[j, s + idx] = tok[j, idx]
            if e < total:  # store the finished block
                self._logits(x[:, s:e], blocked, pos[:, s:e], cache)
        return x

    def generate(self):
        """Rollouts of the same prompts as ours (``RolloutBatch``), micro-batch by micro-batch."""

        s, r = self.ours.s, self.cfg.rollout
        examples = s.prompts.for_step(0)
        prompt, valid = encode_prompts(s.tokenizer, [s.task.prompt(ex, s.tokenizer) for ex in examples])
        prompt, valid = prompt.repeat_interleave(r.group_size, 0), valid.repeat_interleave(r.group_size, 0)
        fn = self._generate_llada if self.dcfg.arch == "llada" else self._generate_sdar
        mb = self.cfg.parallel.micro_batch_size
        seqs = torch.cat(
            [
                fn(prompt[i : i + mb], valid[i : i + mb], self._generator(k))
                for k, i in enumerate(range(0, prompt.shape[0], mb))
            ]
        )
        width = prompt.shape[1]
        comp = torch.zeros_like(seqs, dtype=torch.bool)
        comp[:, width:] = completion_mask_until_eos(seqs[:, width:], s.tokenizer.eos_token_id)
        return RolloutBatch(
            sequences=seqs,
            prompt_len=width,
            prompt_valid=torch.cat([valid, torch.ones_like(seqs[:, width:], dtype=torch.bool)], 1),
            completion_mask=comp,
            group_index=torch.arange(len(examples)).repeat_interleave(r.group_size),
            completions=[s.tokenizer.decode(row.tolist()) for row in seqs[:, width:]],
            references=[ex.reference for ex in examples for _ in range(r.group_size)],
        )

    def rollout(self) -> float:
        batch = self.generate()
        return float(batch.size * (batch.sequences.shape[1] - batch.prompt_len))

    # -------------------------------------------------------------- likelihood
    def token_logp(self, batch, plan, spec, rows: slice, draw: int) -> torch.Tensor:
        """``[n, S]`` log-probs of the clean tokens at the scored positions of draw ``draw``."""
        ids = batch.sequences[rows]
        noisy = ids.masked_fill(plan.masked[draw, rows], self.dcfg.mask_token_id)
        scored = plan.scored[draw, rows].to(self.device)
        keys_ok = batch.prompt_valid[rows]
        n, S = ids.shape
        if spec.kind == "staircase":  # one forward per block: clean prefix + noisy block
            bs, pieces = spec.block_size, []
            for s0 in range(0, S, bs):
                e = min(s0 + bs, S)
                if not bool(scored[:, s0:e].any()):
                    pieces.append(torch.zeros(n, e - s0, device=self.device))
                    continue
                x = torch.cat([ids[:, :s0], noisy[:, s0:e]], 1)
                blocked = block_causal_mask(e, bs) | padding_mask(keys_ok[:, :e])
                logits = self._logits(x, blocked)[:, s0:e]
                rows_lp = []
                for j in range(n):  # per-sample log-softmax
                    lp = torch.log_softmax(logits[j].float(), -1)
                    rows_lp.append(lp.gather(-1, ids[j, s0:e, None].to(self.device)).squeeze(-1))
                pieces.append(torch.stack(rows_lp) * scored[:, s0:e])
            return torch.cat(pieces, 1)
        logits = self._logits(noisy, padding_mask(keys_ok))
        out = []
        for j in range(n):  # per-sample full-vocabulary log-softmax over every position
            lp = torch.log_softmax(logits[j].float(), -1)
            out.append(lp.gather(-1, ids[j, :, None].to(self.device)).squeeze(-1) * scored[j])
        return torch.stack(out)

    def all_token_logp(self, batch, plan, spec) -> torch.Tensor:
        mb = self.cfg.parallel.micro_batch_size
        draws = [
            torch.cat([self.token_logp(batch, plan, spec, slice(i, i + mb), m) for i in range(0, batch.size, mb)])
            for m in range(plan.num_mc)
        ]
        return torch.stack(draws).cpu()

    def _plan(self, batch, spec):
        """The masks of the step: the same draws as ours (identical work on both sides)."""

        return draw_plan(
            batch,
            spec,
            chunk_generators(self.cfg, 0)("masks"),
            micro_batch=self.cfg.parallel.micro_batch_size,
            first_chunk=first_chunk(self.ours.s),
        )

    def likelihood(self, name: str) -> float:

        spec = self.ours.specs[name]
        batch = dataclasses.replace(self.ours.batch)
        batch.plan = self._plan(batch, spec)
        with torch.no_grad():
            sequence_estimates(self.all_token_logp(batch, batch.plan, spec), batch.plan, batch, spec)
        return float(batch.plan.num_mc * batch.sequences.numel())

    # ------------------------------------------------------------------ update
    def _loss(self, batch, spec) -> torch.Tensor:

        tok = self.all_token_logp(batch, batch.plan, spec)
        logp = sequence_estimates(tok, batch.plan, batch, spec)
        value, _ = sequence_policy_loss(
            self.cfg.algo.loss, logp, batch.old_logp, batch.advantages, batch.group_index, eps=self.cfg.algo.eps
        )
        return value

    def train(self, batch=None) -> float:
        batch = batch or self.batch
        self.opt.zero_grad(set_to_none=True)
        self._loss(batch, self.ours.spec).backward()
        if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            for p in self.model.parameters():  # per-parameter all-reduce
                if p.grad is not None:
                    torch.distributed.all_reduce(p.grad)
                    p.grad /= torch.distributed.get_world_size()
        return float(batch.plan.num_mc * batch.sequences.numel())

    def optimizer(self) -> float:
        if self.cfg.optim.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.optim.clip_grad)
        self.opt.step()
        return 0.0

    def step(self) -> float:

        spec = self.ours.spec
        batch = score_rollouts(self.generate(), self.ours.s.task, advantage=self.cfg.algo.advantage)
        fill_flat_groups(batch)
        batch.plan = self._plan(batch, spec)
        with torch.no_grad():
            batch.old_token_logp = self.all_token_logp(batch, batch.plan, spec)
            batch.old_logp = sequence_estimates(batch.old_token_logp, batch.plan, batch, spec)
        for _ in range(self.cfg.algo.inner_iterations):
            self.train(batch)
            self.optimizer()
        return float(batch.sequences.numel())

    def jobs(self, phases: Sequence[str]) -> Dict[str, Callable[[], float]]:

        return phase_jobs(self, phases)
