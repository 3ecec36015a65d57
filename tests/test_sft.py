"""``stabledrl sft``: masking, the loss against hand computations (LLaDA, SDAR per block), data rows,
training of both architectures with an exact ``--resume auto``, and the command line."""

import contextlib
import json
import os

import pytest
import torch
import torch.nn.functional as F

from stabledrl_mcore.common.errors import DataError
from stabledrl_mcore.diffusion.pretrain import sft_mask_plan, sft_sequence_losses
from stabledrl_mcore.diffusion.toy import ToyDiffusionLM, ToyDLLMConfig
from stabledrl_mcore.models.masks import block_causal_mask
from stabledrl_mcore.parallel.launch import spawn
from stabledrl_mcore.sft import SFTSection, encode_rows

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class CharTokenizer:
    """Characters as ids 3..14 of a 16-id vocabulary (EOS 1, mask 15), no chat template."""

    eos_token_id, pad_token_id, mask_token_id, chat_template = 1, 1, 15, None

    def encode(self, text):
        return [3 + ord(ch) % 12 for ch in text]


def _toy_batch():
    rows = [("r0", {"prompt": "abc=", "response": "cb"}), ("r1", {"prompt": "ab=", "response": "bacd"})]
    return encode_rows(rows, SFTSection(data_path="-"), CharTokenizer(), source="toy")


def test_rows_hold_prompt_then_answer_eos_and_eos_padding():
    data = _toy_batch()
    tok = CharTokenizer()
    assert data.ids.shape == (2, 8)
    assert data.ids[0].tolist() == tok.encode("abc=") + tok.encode("cb") + [1, 1]
    assert data.answer[0].tolist() == [False] * 4 + [True] * 4, "answer, its EOS and the EOS padding"
    assert data.ids[1].tolist() == tok.encode("ab=") + tok.encode("bacd") + [1]
    assert data.answer[1].tolist() == [False] * 3 + [True] * 5


def test_prompt_tokens_are_never_masked():
    data = _toy_batch()
    for block_size in (None, 4):
        for seed in range(200):
            plan = sft_mask_plan(data.answer, generator=torch.Generator().manual_seed(seed), block_size=block_size)
            assert not (plan.masked[0] & ~data.answer).any()
            assert torch.equal(plan.scored[0], plan.masked[0])
    hits = torch.stack(
        [sft_mask_plan(data.answer, generator=torch.Generator().manual_seed(s)).masked[0] for s in range(200)]
    )
    assert hits.any(0).equal(data.answer), "every answer token is masked by some draw"


@torch.no_grad()
def test_llada_loss_equals_a_hand_computation():
    data = _toy_batch()
    model = ToyDiffusionLM(ToyDLLMConfig(arch="llada", vocab_size=16, mask_token_id=15), seed=3)
    plan = sft_mask_plan(data.answer, generator=torch.Generator().manual_seed(7))
    losses, _ = sft_sequence_losses(model, data.ids, data.answer, mask_id=15, plan=plan)
    for b in range(2):
        p = float(plan.ratio[0, b, 0])  # one t per sequence
        noisy = [15 if plan.masked[0, b, i] else int(data.ids[b, i]) for i in range(8)]
        logp = F.log_softmax(model(torch.tensor([noisy]))[0].double(), -1)
        total = sum(-float(logp[i, data.ids[b, i]]) / p for i in range(8) if noisy[i] == 15)
        assert losses[b].item() == pytest.approx(total / int(data.answer[b].sum()), rel=1e-5)
    with pytest.raises(TypeError, match="generator"):
        sft_sequence_losses(model, data.ids, data.answer, mask_id=15)


@torch.no_grad()
def test_sdar_staircase_loss_equals_one_block_causal_forward_per_block():
    data = _toy_batch()
    model = ToyDiffusionLM(ToyDLLMConfig(arch="sdar", vocab_size=16, mask_token_id=15, block_size=4), seed=5)
    plan = sft_mask_plan(data.answer, generator=torch.Generator().manual_seed(11), block_size=4)
    assert plan.ratio.shape == (1, 2, 2) and plan.ratio[0, :, 0].ne(plan.ratio[0, :, 1]).all(), "t per block"
    losses, _ = sft_sequence_losses(model, data.ids, data.answer, mask_id=15, plan=plan, block_size=4)
    noisy = data.ids.masked_fill(plan.masked[0], 15)
    for b in range(2):
        total = 0.0
        for start in (0, 4):  # block k sees the clean blocks before it and its own noisy block
            x = torch.cat([data.ids[b, :start], noisy[b, start : start + 4]])[None]
            logits = model(x, attention_mask=block_causal_mask(start + 4, 4))[0, start : start + 4]
            logp = F.log_softmax(logits.double(), -1)
            p = float(plan.ratio[0, b, start // 4])
            total += sum(-float(logp[i, data.ids[b, start + i]]) / p for i in range(4) if plan.masked[0, b, start + i])
        assert losses[b].item() == pytest.approx(total / int(data.answer[b].sum()), rel=1e-5)


def test_bad_rows_are_named_by_file_and_line(tmp_path):
    from stabledrl_mcore.sft.data import load_sft_data

    path = tmp_path / "d.jsonl"
    path.write_text('{"prompt": "a", "response": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:2: no text field 'response'"):
        load_sft_data(SFTSection(data_path=str(path)), CharTokenizer())
    path.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: a 'messages' chat needs a tokenizer with a chat template"):
        load_sft_data(SFTSection(data_path=str(path)), CharTokenizer())
    path.write_text('{"prompt": "abcdef", "response": "b"}\n')
    with pytest.raises(DataError, match=r"d.jsonl:1: 8 tokens .* more than sft.max_length=4"):
        load_sft_data(SFTSection(data_path=str(path), max_length=4), CharTokenizer())


class ChatTokenizer(CharTokenizer):
    chat_template = "<user>{content}<assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def test_parquet_and_messages_rows_use_the_chat_template(tmp_path):
    import datasets

    from stabledrl_mcore.sft.data import load_sft_data

    path = str(tmp_path / "d.parquet")
    datasets.Dataset.from_list(
        [
            {"question": "2+2", "answer": "4", "chat": None},
            {
                "question": None,
                "answer": None,
                "chat": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
            },
        ]
    ).to_parquet(path)
    section = SFTSection(data_path=path, prompt_key="question", response_key="answer", messages_key="chat")
    data = load_sft_data(section, ChatTokenizer())
    tok = ChatTokenizer()
    first = tok.encode("<user>2+2<assistant>") + tok.encode("4") + [1]
    second = tok.encode("<user>hi<assistant>") + tok.encode("yo") + [1]
    assert data.ids[0, : len(first)].tolist() == first and data.ids[1, : len(second)].tolist() == second
    assert int(data.answer[0].sum()) == data.ids.shape[1] - len(tok.encode("<user>2+2<assistant>"))
    plain = load_sft_data(SFTSection(data_path=str(_plain_file(tmp_path)), chat_template="never"), ChatTokenizer())
    assert plain.ids[0, :4].tolist() == tok.encode("2+2=")


def _plain_file(tmp_path):
    path = tmp_path / "plain.jsonl"
    path.write_text('{"prompt": "2+2=", "response": "4"}\n')
    return path


# --- training (Megatron, one gloo rank per spawned process) -------------------------------------------


def _write_data(path):
    import random

    r = random.Random(0)
    with open(path, "w") as handle:
        for _ in range(16):
            s = "".join(r.choice("abcd") for _ in range(5))
            handle.write(json.dumps({"q": s + "=", "a": s[::-1]}) + "\n")


def _overrides(run_dir, data, preset, **extra):
    base = {
        "model.preset": preset,
        "sft.data_path": data,
        "sft.prompt_key": "q",
        "sft.response_key": "a",
        "sft.batch_size": 8,
        "parallel.micro_batch_size": 4,
        "parallel.threads": 1,
        "optim.lr": 3e-3,
        "optim.clip_grad": 1.0,
        "optim.weight_decay": 0.0,
        "logging.run_dir": run_dir,
        "logging.wandb_mode": "disabled",
        "logging.progress": False,
        "checkpoint.save_every": 0,
        "steps": 4,
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def _fixed_mask_loss(s):
    """The loss of the whole data under one fixed mask draw (a noise-free training curve)."""
    with torch.no_grad():
        losses, _ = sft_sequence_losses(
            s.model,
            s.data.ids,
            s.data.answer,
            mask_id=s.model.dllm_config.mask_token_id,
            generator=torch.Generator().manual_seed(0),
            block_size=s.block_size,
        )
    return {"fixed_mask_loss": float(losses.mean())}


def _sft_worker(tmp, out):
    """Both architectures: an uninterrupted run, the same run cut at step 2 and resumed with
    ``checkpoint.resume=auto``; then ``stabledrl sft`` itself (in this rank's process)."""
    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.parallel import bootstrap
    from stabledrl_mcore.sft import SFTConfig, train_sft

    data = os.path.join(tmp, "data.jsonl")
    _write_data(data)
    results = {}
    for preset in ("llada-tiny", "sdar-tiny"):
        for name, extra, stop_after in (
            ("full", {}, None),
            ("cut", {"checkpoint.save_every": 2}, 2),
            ("cut", {"checkpoint.save_every": 2, "checkpoint.resume": "auto"}, None),
        ):
            cfg = load_config(None, _overrides(os.path.join(tmp, preset, name), data, preset, **extra), cls=SFTConfig)
            s = train_sft(cfg, hooks=[lambda s, step: _fixed_mask_loss(s)], stop_after=stop_after)
            results[preset, name] = (
                {k: v.detach().clone() for k, v in s.model.state_dict().items() if torch.is_tensor(v)},
                s.block_size,
            )
            bootstrap.destroy()
    from stabledrl_mcore.engine import preemption as rl_trainer

    def preempt(s, step):  # as SIGUSR1 would: the step finishes, a checkpoint is written, the run stops
        rl_trainer._PREEMPTION["caught"] = step == 2

    cfg = load_config(None, _overrides(os.path.join(tmp, "preempted"), data, "llada-tiny"), cls=SFTConfig)
    results["preempted"] = train_sft(cfg, hooks=[preempt]).preempted
    rl_trainer._PREEMPTION["caught"] = False
    bootstrap.destroy()
    # stop_when (the demo's validation target) at step 2 of 4, no save schedule: a checkpoint there
    cfg = load_config(None, _overrides(os.path.join(tmp, "stopped"), data, "llada-tiny"), cls=SFTConfig)
    s = train_sft(cfg, hooks=[lambda s, step: {"at": float(step)}], stop_when=lambda m: m["at"] >= 2)
    results["stopped"] = (s.stopped_early, s.finished, s.preempted)
    bootstrap.destroy()
    cli = _overrides(os.path.join(tmp, "cli"), data, "llada-tiny", steps=1)
    results["cli"] = [main(["sft", *cli])]
    with open(os.path.join(tmp, "cli_stderr.txt"), "w") as err, contextlib.redirect_stderr(err):
        results["cli"].append(main(["sft", *cli]))  # the run directory is used now
    torch.save(results, out)


def test_example_sft_config_passes_preflight(monkeypatch, tmp_path):
    from stabledrl_mcore.cli.preflight import preflight_sft
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.sft import SFTConfig

    monkeypatch.chdir(ROOT)
    cfg = load_config("examples/sft/tiny_cpu.yaml", [f"logging.run_dir={tmp_path / 'run'}"], cls=SFTConfig)
    summary = preflight_sft(cfg, world_size=2)
    assert "preflight ok: model.preset llada-tiny" in summary and "data-parallel 2" in summary and "64 rows" in summary
    with pytest.raises(
        Exception,
        match=r"sft.batch_size=16 must split into 2 data-parallel rank\(s\) of whole "
        r"parallel.micro_batch_size=16",
    ):
        preflight_sft(
            load_config("examples/sft/tiny_cpu.yaml", ["parallel.micro_batch_size=16"], cls=SFTConfig), world_size=2
        )

    # the logging / save-schedule fields train honours are honoured (or refused) the same way here
    with pytest.raises(Exception, match="logging.wandb_name has no effect with logging.wandb_mode=disabled"):
        load_config(
            "examples/sft/tiny_cpu.yaml", ["logging.wandb_mode=disabled", "logging.wandb_name=x"], cls=SFTConfig
        )
    with pytest.raises(Exception, match="checkpoint.save_every_minutes must be >= 0"):
        load_config("examples/sft/tiny_cpu.yaml", ["checkpoint.save_every_minutes=-1"], cls=SFTConfig)


def _layout_worker(tmp, name, extra, out):
    """The uninterrupted llada-tiny run of :func:`_sft_worker` on 2 ranks (one layout per launch)."""
    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.sft import SFTConfig, train_sft

    run = os.path.join(tmp, name)
    s = train_sft(
        load_config(None, _overrides(run, os.path.join(tmp, "data.jsonl"), "llada-tiny", **extra), cls=SFTConfig)
    )
    state = {k: v.detach().clone() for k, v in s.model.state_dict().items() if torch.is_tensor(v)}
    torch.save(state, out.format(rank=torch.distributed.get_rank()))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Every Megatron run of this file, once: both architectures (full, cut + resumed, the CLI) on
    one rank, the llada-tiny run again on two (DP=2, TP=2)."""
    tmp = tmp_path_factory.mktemp("sft")
    spawn(_sft_worker, 1, (str(tmp), str(tmp / "one_rank.pt")), timeout=300)
    two = [{}, {}]
    for name, extra in (("dp2", {}), ("tp2", {"parallel.tensor_parallel": 2})):
        spawn(_layout_worker, 2, (str(tmp), name, extra, str(tmp / (name + ".{rank}.pt"))), timeout=300)
        for rank in (0, 1):
            two[rank][name] = torch.load(tmp / f"{name}.{rank}.pt")
    return tmp, torch.load(tmp / "one_rank.pt"), two


@pytest.mark.multiprocess
@pytest.mark.parametrize("preset,block_size", [("llada-tiny", None), ("sdar-tiny", 4)])
def test_sft_trains_checkpoints_and_resumes_exactly(trained, preset, block_size):
    tmp, results, _ = trained
    (full, used_block), (resumed, _) = results[preset, "full"], results[preset, "cut"]
    assert used_block == block_size, "SDAR trains through the staircase layout, LLaDA bidirectionally"
    run = tmp / preset
    curve = [json.loads(line)["fixed_mask_loss"] for line in open(run / "full" / "metrics.jsonl")]
    assert len(curve) == 4 and curve[-1] < curve[0] - 0.1, f"{preset}: loss did not fall: {curve}"
    assert sorted(os.listdir(run / "cut" / "checkpoints")) == ["step_00000002", "step_00000004"]
    steps = [json.loads(line)["step"] for line in open(run / "cut" / "metrics.jsonl")]
    assert steps == [1, 2, 3, 4], "the resumed run continued at step 3"
    state = json.load(open(run / "cut" / "checkpoints" / "step_00000004" / "train_state.json"))
    assert state["step"] == 4 and state["data_position"] == 4 * 8
    for key in full:
        assert torch.equal(full[key], resumed[key]), f"{preset}: {key} differs after --resume auto"


@pytest.mark.multiprocess
def test_stabledrl_sft_trains_and_refuses_a_used_run_directory(trained):
    tmp, results, _ = trained
    assert results["cli"] == [0, 2], "stabledrl sft trains; a second run into the used directory is refused"
    assert os.path.isdir(tmp / "cli" / "checkpoints" / "step_00000001" / "hf"), "the tokenizer travels with it"
    assert "--resume auto" in (tmp / "cli_stderr.txt").read_text()


@pytest.mark.multiprocess
def test_a_preempted_sft_run_checkpoints_and_stops(trained):
    tmp, results, _ = trained
    assert results["preempted"] is True
    assert os.listdir(tmp / "preempted" / "checkpoints") == ["step_00000002"]


@pytest.mark.multiprocess
def test_an_sft_run_stopped_by_stop_when_leaves_a_checkpoint_at_that_step(trained):
    """Issue 71 (3c): ``train_sft(stop_when=...)`` True after step 2 of 4 (checkpoint.save_every=0)
    ends the run there, finished, with that step's checkpoint (the demo's RL phase starts from it)."""
    tmp, results, _ = trained
    assert results["stopped"] == (True, True, False)
    assert os.listdir(tmp / "stopped" / "checkpoints") == ["step_00000002"]
    assert [json.loads(line)["step"] for line in open(tmp / "stopped" / "metrics.jsonl")] == [1, 2]


@pytest.mark.multiprocess
def test_dp2_equals_dp1_and_tp2_trains(trained):
    tmp, results, two = trained
    ref = results["llada-tiny", "full"][0]
    for rank in (0, 1):
        got = two[rank]["dp2"]
        assert max((got[k] - ref[k]).abs().max().item() for k in ref) < 1e-5, f"DP=2 rank {rank} differs from DP=1"
    loss = [
        [json.loads(line)["loss"] for line in open(d / "metrics.jsonl")]
        for d in (tmp / "llada-tiny" / "full", tmp / "dp2", tmp / "tp2")
    ]
    assert loss[1] == pytest.approx(loss[0], rel=1e-5), "the logged loss is the job's mean"
    assert all(0 < v < 10 for v in loss[2]), "TP=2 trains"
    tp = two[0]["tp2"]
    fc2 = [k for k in tp if k.endswith("linear_fc2.weight")][0]
    assert tp[fc2].shape[1] * 2 == ref[fc2].shape[1], "TP=2 holds half of fc2"


def test_sft_command_refuses_bad_input_before_any_rank(tmp_path, capsys):
    from stabledrl_mcore.cli.app import main

    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a="}\n')
    assert main(["sft", f"sft.data_path={data}", f"logging.run_dir={tmp_path / 'run'}"]) == 2
    assert f"{data}:1: no text field 'response'" in capsys.readouterr().err
    assert main(["sft", "logging.run_dir=x"]) == 2
    assert "sft.data_path is required" in capsys.readouterr().err
    assert main(["sft", f"sft.data_path={data}", "parallel.retain_update_graph=true"]) == 2
    assert "parallel.retain_update_graph belongs to the RL loop" in capsys.readouterr().err
    assert main(["sft", f"sft.data_path={data}", "rollout.task=gsm8k"]) == 2
    assert "rollout" in capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "nothing written"


def test_one_sft_step_is_the_hand_computed_sgd_update(tmp_path, monkeypatch):
    """Absolute anchor of the SFT loop (DP=2 == DP=1 and resume compare two runs; Adam hides a
    constant gradient scale): one in-process step with SGD moves the weights by exactly -lr x the
    autograd gradient of the step's mean per-sequence loss, computed in one graph over all its rows
    (two micro-batches), with the masks the step draws from (seed, step, micro-batch, "sft")."""
    from test_trainer import in_process_trainer

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.diffusion.pretrain import sft_mask_plan
    from stabledrl_mcore.engine.seeding import phase_generator
    from stabledrl_mcore.sft import SFTConfig
    from stabledrl_mcore.sft import trainer as sft_trainer

    lr, seen, real = 0.05, {}, sft_trainer.sft_update

    def anchored(s, step):
        params = [p for p in s.model.parameters() if p.requires_grad]
        before = [p.detach().clone() for p in params]
        rows = s.prompts.for_step(step)
        micro = s.cfg.parallel.micro_batch_size
        losses = []
        for k, begin in enumerate(range(0, len(rows), micro)):
            chosen = rows[begin : begin + micro]
            gen = phase_generator(s.cfg.parallel.seed, step, k, "sft", device=torch.device("cpu"))
            plan = sft_mask_plan(s.data.answer[chosen], generator=gen, eps=s.cfg.sft.eps)
            mask_id = s.model.dllm_config.mask_token_id
            losses.append(
                sft_sequence_losses(s.model, s.data.ids[chosen], s.data.answer[chosen], mask_id=mask_id, plan=plan)[0]
            )
        value = torch.cat(losses).mean()
        grads = torch.autograd.grad(value, params)
        out = real(s, step)
        seen["loss"], seen["logged"], seen["micro"] = float(value.detach()), out[0]["loss"], len(losses)
        seen["pairs"] = [(p.detach().clone(), b - lr * g) for p, b, g in zip(params, before, grads)]
        seen["moved"] = max(float((p - b).abs().max()) for p, b in zip(params, before))
        return out

    monkeypatch.setattr(sft_trainer, "sft_update", anchored)
    data = str(tmp_path / "data.jsonl")
    _write_data(data)
    extra = {
        "optim.name": "sgd",
        "optim.distributed": False,
        "optim.weight_decay": 0.0,
        "optim.clip_grad": 0.0,
        "optim.lr": lr,
        "steps": 1,
    }
    with in_process_trainer():
        cfg = load_config(None, _overrides(str(tmp_path / "run"), data, "llada-tiny", **extra), cls=SFTConfig)
        sft_trainer.train_sft(cfg)
    assert seen["micro"] == 2
    assert seen["logged"] == pytest.approx(seen["loss"], rel=1e-5)
    assert seen["moved"] > 1e-6
    for got, want in seen["pairs"]:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
