"""Converter pieces in isolation: config translation, safetensors I/O, mapping tables, input errors."""

import json
import os

import pytest
import torch
from hf_fixtures import DROP, load_all, random_tensors, upstream_config, upstream_shapes, write_hf_checkpoint

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.convert.engine import MappingEngine
from stabledrl_mcore.convert.hf_config import dllm_to_hf_config, hf_to_dllm_config
from stabledrl_mcore.convert.mappings import table_for
from stabledrl_mcore.convert.safetensors_io import SafetensorsReader, SafetensorsWriter


# ------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_config_round_trip_keeps_every_upstream_key(arch):
    raw = upstream_config(arch)
    cfg = hf_to_dllm_config(raw)
    assert dllm_to_hf_config(cfg, raw) == raw
    assert hf_to_dllm_config(dllm_to_hf_config(cfg)) == cfg  # template path (no base config)


@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_learned_positions_and_segments_round_trip_through_config_and_tables(arch):
    cfg = hf_to_dllm_config(upstream_config(arch)).replace(
        position_embedding="learned", segment_separator_id=7, num_segments=2
    )
    hf = dllm_to_hf_config(cfg)
    assert hf_to_dllm_config(hf) == cfg
    if arch == "llada":  # OLMo's own switch: rope false = a learned wpe table
        assert hf["rope"] is False and "stabledrl_position_embedding" not in hf
    assert (hf["stabledrl_segment_separator_id"], hf["stabledrl_num_segments"]) == (7, 2)
    assert "stabledrl_num_segments" not in dllm_to_hf_config(cfg.replace(num_segments=0))
    engine = MappingEngine(table_for(arch, cfg), cfg)
    extra = set(engine.expected_hf()) - set(MappingEngine(table_for(arch), cfg).expected_hf())
    position = "model.transformer.wpe.weight" if arch == "llada" else "model.embed_positions.weight"
    assert {n: engine.expected_hf()[n] for n in extra}[position] == (cfg.max_position_embeddings, cfg.hidden_size)
    assert len(extra) == 2
    source = random_tensors(engine.expected_hf(), seed=3)
    for _, group in engine.groups():
        for mapping in group:
            full = torch.cat(engine.to_megatron(mapping, source.__getitem__))
            assert all(torch.equal(t, source[n]) for n, t in engine.to_hf(mapping.megatron, full))


def test_llada_reads_olmo_field_names():
    cfg = hf_to_dllm_config(upstream_config("llada"))
    assert (cfg.arch, cfg.hidden_size, cfg.num_layers, cfg.num_attention_heads) == ("llada", 32, 4, 4)
    assert cfg.num_query_groups == 4 and cfg.ffn_hidden_size == 48 and not cfg.qk_layernorm
    assert cfg.vocab_size == 99, "rows of wte = embedding_size, not vocab_size"
    assert (cfg.mask_token_id, cfg.eos_token_id, cfg.pad_token_id) == (96, 95, 95)
    assert cfg.rope_theta == 500000.0 and cfg.max_position_embeddings == 64 and cfg.block_size is None


def test_sdar_reads_qwen3_field_names():
    cfg = hf_to_dllm_config(upstream_config("sdar"))
    assert (cfg.num_query_groups, cfg.kv_channels, cfg.block_size, cfg.mask_token_id) == (2, 16, 4, 127)
    assert cfg.qk_layernorm and cfg.norm_eps == 1e-6


def test_unknown_model_type_is_named():
    with pytest.raises(ConversionError, match="unknown model_type 'llama'"):
        hf_to_dllm_config(upstream_config("llada", model_type="llama"))


@pytest.mark.parametrize(
    "arch,field",
    [
        ("llada", "d_model"),
        ("llada", "mlp_hidden_size"),
        ("llada", "mask_token_id"),
        ("sdar", "intermediate_size"),
        ("sdar", "num_hidden_layers"),
    ],
)
def test_missing_field_is_named(arch, field):
    with pytest.raises(ConversionError, match=f"missing the required field '{field}'"):
        hf_to_dllm_config(upstream_config(arch, **{field: DROP}))


def test_sdar_block_size_and_mask_default_with_warning(tmp_path):
    src = write_hf_checkpoint(
        str(tmp_path / "sdar"), "sdar", config_overrides=dict(block_size=DROP, mask_token_id=DROP)
    )
    raw = json.load(open(os.path.join(src, "config.json")))
    with pytest.warns(UserWarning) as record:
        cfg = hf_to_dllm_config(raw, source_dir=src)
    messages = " ".join(str(w.message) for w in record)
    assert "'block_size'" in messages and "'mask_token_id'" in messages
    assert cfg.block_size == 4 and cfg.mask_token_id == 127  # <|MASK|> found in tokenizer.json


@pytest.mark.parametrize(
    "arch,key,value",
    [
        ("llada", "alibi", True),
        ("llada", "include_bias", True),
        ("llada", "activation_type", "gelu"),
        ("sdar", "hidden_act", "gelu"),
        ("sdar", "attention_bias", True),
    ],
)
def test_unsupported_architecture_switch_is_named(arch, key, value):
    with pytest.raises(ConversionError, match=f"'{key}'"):
        hf_to_dllm_config(upstream_config(arch, **{key: value}))


# ------------------------------------------------------------------------------ safetensors
def test_writer_shards_streams_and_indexes(tmp_path):
    tensors = {
        "a.weight": torch.randn(64, 32).bfloat16(),
        "b.norm": torch.randn(32),
        "c.weight": torch.randn(16, 8, dtype=torch.float64),
        "d.weight": torch.randn(100, 30),
    }
    plan = [(n, tuple(t.shape), t.dtype) for n, t in tensors.items()]
    writer = SafetensorsWriter(str(tmp_path), plan, max_shard_bytes=5_000)  # d alone exceeds it
    with pytest.raises(ValueError, match="write order"):
        writer.write("b.norm", tensors["b.norm"])
    for name, tensor in tensors.items():
        writer.write(name, tensor)
    writer.close()
    files = sorted(os.listdir(tmp_path))
    assert "model.safetensors.index.json" in files and len([f for f in files if f.endswith(".safetensors")]) == 3
    back = load_all(str(tmp_path))  # read with the reference safetensors library
    assert back.keys() == tensors.keys()
    assert all(torch.equal(back[n], t) and back[n].dtype == t.dtype for n, t in tensors.items())
    reader = SafetensorsReader(str(tmp_path))
    assert reader.shape("d.weight") == (100, 30) and reader.dtype("a.weight") == torch.bfloat16
    assert torch.equal(reader.get("c.weight"), tensors["c.weight"])


def test_writer_single_file_without_index(tmp_path):
    writer = SafetensorsWriter(str(tmp_path), [("x", (3, 2), torch.float32)])
    writer.write("x", torch.ones(3, 2))
    writer.close()
    assert sorted(os.listdir(tmp_path)) == ["model.safetensors"]


# ------------------------------------------------------------------------------ mapping tables
@pytest.mark.parametrize("arch", ["llada", "sdar"])
def test_tables_round_trip_every_tensor(arch):
    raw = upstream_config(arch)
    cfg = hf_to_dllm_config(raw, make_vocab_size_divisible_by=16)
    source = random_tensors(upstream_shapes(arch, raw), seed=1)
    engine = MappingEngine(table_for(arch), cfg)
    assert engine.expected_hf() == {n: tuple(t.shape) for n, t in source.items()}
    back = {}
    for _, group in engine.groups():
        for mapping in group:
            blocks = engine.to_megatron(mapping, source.__getitem__)
            full = torch.cat(blocks)
            assert tuple(full.shape) == engine.megatron_shape(mapping)
            back.update(engine.to_hf(mapping.megatron, full))
    assert back.keys() == source.keys()
    assert all(torch.equal(back[n], source[n]) for n in source)


def test_qkv_is_grouped_per_kv_group_and_fc1_is_gate_then_up():
    raw = upstream_config("sdar")  # 4 heads, 2 KV groups, head dim 16
    cfg = hf_to_dllm_config(raw)
    source = random_tensors(upstream_shapes("sdar", raw), seed=2)
    engine = MappingEngine(table_for("sdar"), cfg)
    p = "model.layers.1."
    qkv = torch.cat(
        engine.to_megatron(engine.mapping("decoder.layers.1.self_attention.linear_qkv.weight"), source.__getitem__)
    )
    q, k, v = (source[p + f"self_attn.{x}_proj.weight"] for x in "qkv")
    d = 16
    expected = torch.cat([q[0 : 2 * d], k[0:d], v[0:d], q[2 * d : 4 * d], k[d : 2 * d], v[d : 2 * d]])
    assert torch.equal(qkv, expected)
    fc1 = engine.to_megatron(engine.mapping("decoder.layers.1.mlp.linear_fc1.weight"), source.__getitem__)
    assert torch.equal(
        torch.cat(fc1), torch.cat([source[p + "mlp.gate_proj.weight"], source[p + "mlp.up_proj.weight"]])
    )


def test_vocab_rows_are_padded_with_zeros_and_cut_back():
    raw = upstream_config("llada")
    cfg = hf_to_dllm_config(raw, make_vocab_size_divisible_by=16)
    source = random_tensors(upstream_shapes("llada", raw), seed=3)
    engine = MappingEngine(table_for("llada"), cfg)
    emb = torch.cat(engine.to_megatron(engine.mapping("embedding.word_embeddings.weight"), source.__getitem__))
    assert emb.shape == (112, 32) and torch.equal(emb[99:], torch.zeros(13, 32))
    [(name, rows)] = engine.to_hf("embedding.word_embeddings.weight", emb)
    assert name == "model.transformer.wte.weight" and torch.equal(rows, source[name])


# ------------------------------------------------------------------------------ bad inputs
def _convert(src, out, **kw):
    from stabledrl_mcore.convert.convert import hf_to_mcore

    return hf_to_mcore(src, out, progress=False, **kw)


@pytest.mark.parametrize(
    "corruption,message",
    [
        (
            dict(drop=["model.layers.2.self_attn.k_norm.weight"]),
            r"missing tensor\(s\) 'model.layers.2.self_attn.k_norm.weight'",
        ),
        (
            dict(extra={"model.layers.0.self_attn.bias": torch.zeros(4)}),
            r"unexpected tensor\(s\) 'model.layers.0.self_attn.bias'",
        ),
        (
            dict(reshape={"model.layers.3.mlp.up_proj.weight": (40, 32)}),
            r"'model.layers.3.mlp.up_proj.weight' has shape \[40, 32\], expected \[48, 32\]",
        ),
    ],
)
def test_bad_tensors_are_refused_before_writing(tmp_path, corruption, message):
    src = write_hf_checkpoint(str(tmp_path / "src"), "sdar", shards=2, **corruption)
    with pytest.raises(ConversionError, match=message):
        _convert(src, str(tmp_path / "out"), model="sdar")
    assert sorted(os.listdir(tmp_path)) == ["src"], "nothing may be written for a bad input"


def test_non_empty_output_is_refused_without_overwrite(tmp_path):
    src = write_hf_checkpoint(str(tmp_path / "src"), "llada")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("precious")
    with pytest.raises(ConversionError, match="not empty; pass --overwrite"):
        _convert(src, str(tmp_path / "out"), model="llada")
    assert (tmp_path / "out" / "keep.txt").read_text() == "precious"
    with pytest.raises(ConversionError, match="outside the source"):
        _convert(src, str(tmp_path / "src" / "converted"), model="llada")


def test_missing_weights_and_wrong_model_flag(tmp_path):
    src = write_hf_checkpoint(str(tmp_path / "src"), "llada")
    with pytest.raises(ConversionError, match="--model sdar was given but config.json has model_type 'llada'"):
        _convert(src, str(tmp_path / "out"), model="sdar")
    os.remove(os.path.join(src, "model.safetensors"))
    open(os.path.join(src, "pytorch_model.bin"), "wb").close()
    with pytest.raises(ConversionError, match="neither model.safetensors.*pytorch_model.bin"):
        _convert(src, str(tmp_path / "out"), model="llada")


def test_model_choice_is_an_architecture_or_a_preset_with_its_shape():
    """slurm/convert.sh passes a preset (STABLEDRL_MODEL=llada-8b); the CLI once refused it."""
    from stabledrl_mcore.convert.convert import check_preset_shape, resolve_model_choice
    from stabledrl_mcore.models import get_preset

    assert resolve_model_choice("sdar") == ("sdar", None)
    assert resolve_model_choice("llada-8b") == ("llada", "llada-8b")
    with pytest.raises(ConversionError, match="neither an architecture .* nor a preset"):
        resolve_model_choice("llada-9b")
    check_preset_shape(get_preset("sdar-8b"), "sdar-8b")
    tiny = hf_to_dllm_config(upstream_config("llada"))
    with pytest.raises(ConversionError, match=r"hidden_size 32 \(preset 4096\).*pass --model llada"):
        check_preset_shape(tiny, "llada-8b")
