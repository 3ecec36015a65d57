"""HF -> Megatron -> HF in one process: bit-identical tensors, equivalent config, copied assets,
logits through ``load_model`` equal to independent ``transformers`` references, CLI, crash safety."""

import argparse
import json
import os

import pytest
import torch
from hf_fixtures import load_all, write_hf_checkpoint

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.cli import convert as convert_cmd
from stabledrl_mcore.convert import convert as conv
from stabledrl_mcore.convert.hf_config import hf_to_dllm_config

TOL = 1e-4
CASES = {  # name: (arch, fixture options); fp32 for logit parity, bf16 + shards for the way back
    "llada": ("llada", dict(dtype=torch.float32, shards=1)),
    "sdar": ("sdar", dict(dtype=torch.float32, shards=2)),
    "sdar_bf16_sharded": ("sdar", dict(dtype=torch.bfloat16, shards=3)),
    "sdar_tied": ("sdar", dict(dtype=torch.float32, config_overrides=dict(tie_word_embeddings=True))),
}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case converted there and back once: {name: (src, ckpt, back)}."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("convert")
    out = {}
    for name, (arch, options) in CASES.items():
        src = write_hf_checkpoint(str(root / f"{name}_hf"), arch, seed=len(out), **options)
        ckpt = conv.hf_to_mcore(src, str(root / f"{name}_mcore"), model=arch, progress=False)
        back = conv.mcore_to_hf(ckpt, str(root / f"{name}_back"), max_shard_bytes=30_000, progress=False)
        out[name] = (src, ckpt, back)
    yield out
    bootstrap.destroy()
    cpu_compat.disable()


@pytest.mark.parametrize("name", list(CASES))
def test_round_trip_is_bit_identical(converted, name):
    src, ckpt, back = converted[name]
    want, got = load_all(src), load_all(back)
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    assert os.path.isfile(os.path.join(back, "model.safetensors.index.json")), "30 kB shards expected"
    raw_src = json.load(open(os.path.join(src, "config.json")))
    raw_back = json.load(open(os.path.join(back, "config.json")))
    assert hf_to_dllm_config(raw_back) == hf_to_dllm_config(raw_src)
    assert all(raw_back[k] == v for k, v in raw_src.items() if k != "torch_dtype"), "upstream keys kept"
    copied = {"tokenizer.json", "tokenizer_config.json", "generation_config.json"}
    copied |= (
        {"modeling_llada.py", "configuration_llada.py"}
        if name == "llada"
        else {"modeling_sdar.py", "configuration_sdar.py"}
    )
    assert copied <= set(os.listdir(back)) and copied <= set(os.listdir(os.path.join(ckpt, "hf")))


def test_converted_checkpoint_layout(converted):
    from megatron.core import dist_checkpointing

    _, ckpt, _ = converted["llada"]
    marker = json.load(open(os.path.join(ckpt, "stabledrl_model.json")))
    assert marker["format"] == "stabledrl-mcore-model" and marker["arch"] == "llada"
    assert marker["dtype"] == "fp32" and marker["suggested_layout"] == {"tensor_parallel": 1, "pipeline_parallel": 1}
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    assert tuple(meta["decoder.layers.self_attention.linear_qkv.weight"].global_shape) == (4, 96, 32)
    assert tuple(meta["decoder.layers.mlp.linear_fc1.weight"].global_shape) == (4, 96, 32)
    assert not [n for n in os.listdir(os.path.dirname(ckpt)) if n.startswith((".tmp-", ".old-"))]


@pytest.mark.parametrize("name", ["llada", "sdar", "sdar_tied"])
def test_load_model_logits_match_transformers(converted, name):
    from stabledrl_mcore import load_model
    from stabledrl_mcore.convert.verify import public_reference, reference_logits

    src, ckpt, _ = converted[name]
    cfg = hf_to_dllm_config(json.load(open(os.path.join(src, "config.json"))))
    ids = torch.randint(0, cfg.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    want = reference_logits(public_reference(src), cfg, ids)
    assert want.abs().max() > 0.3, "reference logits too small for a meaningful check"
    for path in (src, ckpt):  # straight from the HF directory, and from the converted checkpoint
        with torch.no_grad():
            got = load_model(path)(ids)
        assert got.shape == (2, 11, cfg.vocab_size)
        assert (got - want).abs().max().item() < TOL, path


def test_sdar_default_mask_is_block_causal_and_llada_bidirectional(converted):
    from stabledrl_mcore import load_model
    from stabledrl_mcore.models import AttentionLayout

    ids = torch.randint(0, 90, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        sdar = load_model(converted["sdar_tied"][1])
        default = sdar(ids)
        assert torch.equal(default, sdar.model(ids, None, AttentionLayout.block_causal(4)))
        assert (default - sdar.model(ids)).abs().max() > 1e-3, "SDAR default must not be bidirectional"
        keep_all = torch.ones(1, 12, dtype=torch.long)  # 2-D HF-style padding mask, nothing padded
        assert torch.allclose(sdar(ids, attention_mask=keep_all), default, atol=1e-6)
        llada = load_model(converted["llada"][1])
        assert torch.equal(llada(ids), llada.model(ids))
        # bidirectional: the first position's logits depend on later tokens
        changed = ids.clone()
        changed[0, -1] = (changed[0, -1] + 1) % 90
        assert (llada(changed)[0, 0] - llada(ids)[0, 0]).abs().max() > 1e-6


def test_tied_head_is_omitted_again_on_export(converted):
    src, _, back = converted["sdar_tied"]
    assert "lm_head.weight" not in load_all(src) and "lm_head.weight" not in load_all(back)
    assert json.load(open(os.path.join(back, "config.json")))["tie_word_embeddings"] is True


def test_exported_directory_loads_in_transformers(converted):
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    _, _, back = converted["sdar_bf16_sharded"]
    raw = json.load(open(os.path.join(back, "config.json")))
    fields = {
        k: raw[k]
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    }
    model, info = Qwen3ForCausalLM.from_pretrained(back, config=Qwen3Config(**fields), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tok = AutoTokenizer.from_pretrained(back)
    assert tok.convert_tokens_to_ids("<|MASK|>") == raw["mask_token_id"]


def test_vocab_padding_is_stored_and_removed(converted, tmp_path):
    from megatron.core import dist_checkpointing

    src = converted["llada"][0]
    ckpt = conv.hf_to_mcore(src, str(tmp_path / "padded"), model="llada", vocab_multiple=16, tp=2, pp=2, progress=False)
    meta = dist_checkpointing.load_tensors_metadata(ckpt)
    assert tuple(meta["embedding.word_embeddings.weight"].global_shape) == (112, 32)
    assert tuple(meta["output_layer.weight"].global_shape) == (112, 32)
    back = conv.mcore_to_hf(ckpt, str(tmp_path / "back"), progress=False)
    want, got = load_all(src), load_all(back)
    assert all(torch.equal(got[k], want[k]) for k in want) and got.keys() == want.keys()


def _cli(*argv):
    parser = argparse.ArgumentParser()
    convert_cmd.add_convert_arguments(parser)
    return convert_cmd.run_convert(parser.parse_args(list(argv)))


def test_cli_verify_overwrite_and_exit_codes(converted, tmp_path, capsys):
    src, ckpt, _ = converted["sdar_tied"]
    out = str(tmp_path / "ckpt")
    assert (
        _cli(
            "hf-to-mcore",
            "--model",
            "sdar",
            "--hf-dir",
            src,
            "--out",
            out,
            "--tp",
            "2",
            "--pp",
            "2",
            "--dtype",
            "bf16",
            "--verify",
            "--tolerance",
            "0.05",
            "--no-progress",
        )
        == 0
    )
    assert "verify: max abs logit difference" in capsys.readouterr().out
    assert json.load(open(os.path.join(out, "stabledrl_model.json")))["dtype"] == "bf16"
    assert _cli("hf-to-mcore", "--model", "sdar", "--hf-dir", src, "--out", out) == 2
    assert "not empty" in capsys.readouterr().err
    assert _cli("hf-to-mcore", "--model", "sdar", "--hf-dir", src, "--out", out, "--overwrite", "--no-progress") == 0
    assert json.load(open(os.path.join(out, "stabledrl_model.json")))["dtype"] == "fp32"
    assert (
        _cli(
            "mcore-to-hf",
            "--ckpt",
            ckpt,
            "--out",
            str(tmp_path / "hf"),
            "--verify",
            "--tolerance",
            "-1",
            "--no-progress",
        )
        == 1
    ), "a negative tolerance cannot be met"
    assert _cli("hf-to-mcore", "--model", "sdar", "--hf-dir", str(tmp_path / "nope"), "--out", str(tmp_path / "x")) == 2


def test_remote_reference_fails_with_a_clear_message(converted):
    from stabledrl_mcore.convert.verify import verify

    src, ckpt, _ = converted["llada"]
    with pytest.raises(ConversionError, match="trust_remote_code.*--reference public"):
        verify(src, ckpt, reference="remote")


def test_a_crash_leaves_nothing_that_looks_valid(converted, tmp_path, monkeypatch):
    from megatron.core import dist_checkpointing

    from stabledrl_mcore import load_model

    def crash(*args, **kwargs):
        raise RuntimeError("simulated crash while writing")

    monkeypatch.setattr(dist_checkpointing, "save", crash)
    with pytest.raises(RuntimeError, match="simulated"):
        conv.hf_to_mcore(converted["llada"][0], str(tmp_path / "out"), model="llada", progress=False)
    assert os.listdir(tmp_path) == [], "no output and no temporary directory may remain"
    half = tmp_path / ".tmp-out-killed"  # what a SIGKILL mid-write would leave: refused on load
    half.mkdir()
    (half / "common.pt").write_bytes(b"")
    with pytest.raises(ConversionError, match="not a converted checkpoint"):
        load_model(str(half))


def test_tool_script_runs_as_its_own_process(converted, tmp_path):
    """tools/convert_checkpoint.py end to end (its __main__ guard matters to dist_checkpointing)."""
    import subprocess
    import sys

    src = converted["llada"][0]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    tool = os.path.join(root, "tools", "convert_checkpoint.py")
    run = subprocess.run(
        [
            sys.executable,
            tool,
            "hf-to-mcore",
            "--model",
            "llada",
            "--hf-dir",
            src,
            "--out",
            str(tmp_path / "ckpt"),
            "--tp",
            "2",
            "--pp",
            "2",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert os.path.isfile(tmp_path / "ckpt" / "stabledrl_model.json")
    bad = subprocess.run(
        [
            sys.executable,
            tool,
            "hf-to-mcore",
            "--model",
            "llada",
            "--hf-dir",
            src,
            "--out",
            str(tmp_path / "x"),
            "--pp",
            "3",
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert bad.returncode == 2 and "num_layers (4) is not divisible by 3" in bad.stderr
