"""Nothing a checkpoint directory holds runs code or reaches outside it (issue #40).

A converted checkpoint (one process, like ``test_convert_roundtrip``) with a crafted ``.metadata``,
``common.pt`` or sharded object is refused by every opener (``mcore-to-hf``, ``load_model``,
``read_checkpoint_info``, ``load_model_weights``, Megatron's own reader once bound) in one line, and
the command in the pickle never runs; the real metadata holds only the allow-listed classes. A
manifest naming a file outside the checkpoint, or a symbolic link inside it, is refused before any
file is hashed. NaN/inf weights read from safetensors are refused by name unless opted in.
(The training-checkpoint side, ``stabledrl train --resume`` and ``model.checkpoint``, is in
``test_run_safety.py``.)
"""

import hashlib
import json
import os
import pickle
import shutil

import pytest
import torch
from hf_fixtures import upstream_config, upstream_shapes, write_hf_checkpoint

from stabledrl_mcore.checkpoint.errors import ConversionError
from stabledrl_mcore.checkpoint.integrity import CheckpointError, verify_checksums, write_checksums
from stabledrl_mcore.convert import convert as conv

LAYER0_UP = "model.transformer.blocks.0.up_proj.weight"
SYSTEM = f"{os.system.__module__}.system"  # what a pickle of os.system names (posix.system)


class _Exploit:
    """Unpickling this runs a shell command."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def write_metadata_exploit(path, marker):
    """A ``.metadata`` shaped like the real one whose unpickling runs ``touch marker``."""
    with open(path, "wb") as handle:
        pickle.dump(
            {"state_dict_metadata": {"embedding.word_embeddings.weight": _Exploit(marker)}, "storage_data": {}},
            handle,
        )


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A converted tiny LLaDA checkpoint, and HF directories holding a NaN / a value beyond fp16."""
    from stabledrl_mcore.parallel import bootstrap, cpu_compat

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("trust")
    shape = upstream_shapes("llada", upstream_config("llada"))[LAYER0_UP]
    nan, huge = torch.full(shape, 0.01), torch.full(shape, 0.01)
    nan[0, 0], huge[1, 1] = float("nan"), 1e6
    clean = write_hf_checkpoint(str(root / "clean"), "llada")
    yield {
        "clean": clean,
        "ckpt": conv.hf_to_mcore(clean, str(root / "mcore"), model="llada", progress=False),
        "nan": write_hf_checkpoint(str(root / "nan"), "llada", extra={LAYER0_UP: nan}),
        "huge": write_hf_checkpoint(str(root / "huge"), "llada", extra={LAYER0_UP: huge}),
    }
    bootstrap.destroy()
    cpu_compat.disable()


def _copy(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


def _reseal(path):
    """Rewrite ``checksums.json`` after tampering, as whoever crafts a checkpoint can: what is left
    to refuse the crafted file is the reader itself."""
    write_checksums(str(path))


def _one_line_refusal(err, *parts):
    text = str(err)
    assert "\n" not in text and all(p in text for p in parts), text


def _stabledrl(*argv):
    """The ``stabledrl`` console script, in this process."""
    from stabledrl_mcore.cli.app import main

    return main(list(argv))


# ---------------------------------------------------------------------------- .metadata
def test_real_metadata_holds_only_the_allow_listed_classes(sources):
    """The allow-list is what the converter's metadata names (training ones: test_run_safety)."""
    from stabledrl_mcore.checkpoint import trust

    seen = set()

    class Recorder(pickle.Unpickler):
        def find_class(self, module, name):
            seen.add((module, name))
            return super().find_class(module, name)

    path = os.path.join(sources["ckpt"], ".metadata")
    with open(path, "rb") as handle:
        plain = Recorder(handle).load()
    allowed = {(m, n) for m, names in trust.METADATA_GLOBALS.items() for n in names}
    extra = {(m, n) for m, n in seen - allowed if not (m == "torch" and isinstance(getattr(torch, n), torch.dtype))}
    assert extra == {("torch.serialization", "_get_layout")}, extra  # answered by a lookup of the layouts
    safe = trust.read_metadata(sources["ckpt"])
    assert safe.state_dict_metadata == plain.state_dict_metadata and safe.storage_data == plain.storage_data


def _open(opener, path, clean, capsys, tmp_path):
    """Open ``path`` the way ``opener`` does (a model for it built like the ``clean`` checkpoint's):
    the refusal's text (one line), or '' if none came."""
    from megatron.core import dist_checkpointing

    from stabledrl_mcore.checkpoint.info import read_checkpoint_info
    from stabledrl_mcore.checkpoint.mcore_io import build_shell, ensure_single_process, load_model_weights
    from stabledrl_mcore.convert.loader import load_model

    if opener == "mcore-to-hf":
        code = _stabledrl("convert", "mcore-to-hf", "--ckpt", path, "--out", str(tmp_path / "hf"), "--no-progress")
        err = capsys.readouterr().err.strip()
        assert code == 2 and len(err.splitlines()) == 1 and not os.path.exists(tmp_path / "hf"), (code, err)
        return err
    try:
        if opener == "load_model":
            load_model(path)
        elif opener == "read_checkpoint_info":
            read_checkpoint_info(path)
        elif opener == "load_model_weights":
            ensure_single_process()
            load_model_weights(build_shell(read_checkpoint_info(clean).config, torch.float32), path)
        else:  # Megatron's own reader, once bound (every load here binds it first)
            from stabledrl_mcore.checkpoint.trust import bind_safe_reads

            bind_safe_reads()
            dist_checkpointing.load_tensors_metadata(path)
    except CheckpointError as err:
        assert "\n" not in str(err), str(err)
        return str(err)
    return ""


@pytest.mark.parametrize(
    "opener", ["mcore-to-hf", "load_model", "read_checkpoint_info", "load_model_weights", "megatron_reader"]
)
def test_a_crafted_metadata_runs_no_code(sources, tmp_path, capsys, opener):
    evil = _copy(sources["ckpt"], tmp_path / "evil")
    marker = tmp_path / "exploit_ran"
    write_metadata_exploit(os.path.join(evil, ".metadata"), marker)
    _reseal(evil)
    try:
        refusal = _open(opener, evil, sources["ckpt"], capsys, tmp_path)
    finally:
        assert not marker.exists(), f"{opener} ran code from the checkpoint's .metadata"
    assert f"{evil}/.metadata: refused to unpickle {SYSTEM} (not checkpoint metadata)" in refusal, refusal
    assert "the checkpoint is not trusted" in refusal, refusal


def test_the_real_checkpoint_still_loads_through_every_opener(sources, tmp_path, capsys):
    from stabledrl_mcore.checkpoint.trust import bind_safe_reads

    bind_safe_reads()
    for opener in ("load_model", "read_checkpoint_info", "load_model_weights", "megatron_reader"):
        assert _open(opener, sources["ckpt"], sources["ckpt"], capsys, tmp_path) == "", opener


def test_a_crafted_common_state_is_one_line(sources, tmp_path):
    from stabledrl_mcore.convert.loader import load_model

    evil = _copy(sources["ckpt"], tmp_path / "evil")
    marker = tmp_path / "exploit_ran"
    for legacy in (False, True):  # torch.save's zip format, and its legacy one
        torch.save(
            {"rng": _Exploit(marker)}, os.path.join(evil, "common.pt"), _use_new_zipfile_serialization=not legacy
        )
        _reseal(evil)
        with pytest.raises(CheckpointError) as info:
            load_model(evil)
        _one_line_refusal(info.value, f"{evil}/common.pt: refused to unpickle {SYSTEM}", "not trusted")
        assert not marker.exists()


@pytest.mark.parametrize("protocol", [2, pickle.DEFAULT_PROTOCOL])
@pytest.mark.parametrize("crafted", [False, True])
def test_a_raw_pickle_common_state_is_named(sources, tmp_path, protocol, crafted):
    """A ``pickle.dump``-ed ``common.pt`` (issue #62): one line saying what it is, why and what to do
    (before: torch's 365 characters, or a RuntimeError 'Invalid magic number')."""
    from stabledrl_mcore.convert.loader import load_model

    evil = _copy(sources["ckpt"], tmp_path / "evil")
    marker = tmp_path / "exploit_ran"
    state = {"rng": _Exploit(marker)} if crafted else {}
    with open(os.path.join(evil, "common.pt"), "wb") as handle:
        pickle.dump(state, handle, protocol=protocol)
    _reseal(evil)
    with pytest.raises(CheckpointError) as info:
        load_model(evil)
    _one_line_refusal(
        info.value,
        f"{evil}/common.pt is a raw pickle, not a torch.save file",
        "weights_only=True",
        "would run any code",
        "re-save the checkpoint with the version that wrote it",
    )
    assert len(str(info.value)) < 300 + len(evil), str(info.value)
    assert not marker.exists()


def test_a_legacy_torch_save_common_state_still_loads(sources, tmp_path):
    from stabledrl_mcore.convert.loader import load_model

    old = _copy(sources["ckpt"], tmp_path / "old")
    common = torch.load(os.path.join(old, "common.pt"), weights_only=True)
    torch.save(common, os.path.join(old, "common.pt"), _use_new_zipfile_serialization=False)
    _reseal(old)
    load_model(old)


def test_a_crafted_sharded_object_runs_no_code(sources, tmp_path):
    """torch's load planner reads a sharded object (``_extra_state``) with weights_only=False."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    from stabledrl_mcore.convert.loader import load_model

    evil = _copy(sources["ckpt"], tmp_path / "evil")
    marker = tmp_path / "exploit_ran"
    with open(os.path.join(evil, ".metadata"), "rb") as handle:
        metadata = pickle.load(handle)  # our own file: trusted here
    index, info = next(
        (i, s)
        for i, s in metadata.storage_data.items()
        if isinstance(metadata.state_dict_metadata[i.fqn], BytesStorageMetadata)
    )
    shard = os.path.join(evil, info.relative_path)
    payload = pickle.dumps(_Exploit(marker), protocol=2)
    offset = os.path.getsize(shard)
    with open(shard, "ab") as handle:
        handle.write(payload)
    metadata.storage_data[index] = type(info)(relative_path=info.relative_path, offset=offset, length=len(payload))
    with open(os.path.join(evil, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    _reseal(evil)
    with pytest.raises(CheckpointError) as err:
        load_model(evil)
    _one_line_refusal(err.value, f"{evil}: refused to unpickle {SYSTEM} from the sharded object {index.fqn}")
    assert not marker.exists(), "loading the checkpoint ran code from a sharded object"


@pytest.mark.parametrize("name", ["../../etc/hostname", "..", "."])
def test_metadata_naming_a_shard_outside_the_checkpoint_is_refused(sources, tmp_path, name):
    """Refused by its name: ``..`` and ``.`` are directories (the read would fail anyway, with another
    error), so only the message shows the name check ran."""
    from stabledrl_mcore.convert.loader import load_model

    evil = _copy(sources["ckpt"], tmp_path / "evil")
    with open(os.path.join(evil, ".metadata"), "rb") as handle:
        metadata = pickle.load(handle)
    index, info = next(iter(metadata.storage_data.items()))
    metadata.storage_data[index] = type(info)(relative_path=name, offset=0, length=8)
    with open(os.path.join(evil, ".metadata"), "wb") as handle:
        pickle.dump(metadata, handle)
    _reseal(evil)
    with pytest.raises(CheckpointError) as err:
        load_model(evil)
    _one_line_refusal(err.value, f"a shard is stored in {name!r}, not in a file of the checkpoint")


# ---------------------------------------------------------------------------- checksums.json
def _manifest_dir(tmp_path):
    ckpt = tmp_path / "step_00000001"
    (ckpt / "rng").mkdir(parents=True)
    (ckpt / "__0_0.distcp").write_bytes(b"shard" * 100)
    (ckpt / "rng" / "rank00000.pt").write_bytes(b"rng")
    write_checksums(str(ckpt))
    verify_checksums(str(ckpt))
    return ckpt


def _add_entry(ckpt, name, target):
    data = open(target, "rb").read()
    manifest = json.loads((ckpt / "checksums.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (ckpt / "checksums.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("kind", ["relative", "absolute"])
def test_a_manifest_naming_a_file_outside_the_checkpoint_is_refused(tmp_path, kind):
    ckpt = _manifest_dir(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_text("not part of the checkpoint")
    name = "../outside.txt" if kind == "relative" else str(outside)
    _add_entry(ckpt, name, outside)
    with pytest.raises(CheckpointError) as err:
        verify_checksums(str(ckpt))
    _one_line_refusal(err.value, f"{ckpt}/checksums.json names {name!r}, a path outside the checkpoint", "not trusted")
    assert "bytes" not in str(err.value), "the outside file was looked at"


@pytest.mark.parametrize("what", ["file", "directory"])
def test_a_symbolic_link_inside_a_checkpoint_is_refused(tmp_path, what):
    ckpt = _manifest_dir(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    if what == "file":  # the same bytes, so the digest matches
        elsewhere.write_bytes((ckpt / "__0_0.distcp").read_bytes())
        (ckpt / "__0_0.distcp").unlink()
        os.symlink(elsewhere, ckpt / "__0_0.distcp")
        link = ckpt / "__0_0.distcp"
    else:
        shutil.move(str(ckpt / "rng"), str(elsewhere))
        os.symlink(elsewhere, ckpt / "rng")
        link = ckpt / "rng"
    with pytest.raises(CheckpointError) as err:
        verify_checksums(str(ckpt))
    _one_line_refusal(err.value, f"{link} is a symbolic link (to {elsewhere})", "not trusted")


# ---------------------------------------------------------------------------- NaN from safetensors
def test_load_model_refuses_nonfinite_hf_weights_by_name_unless_allowed(sources):
    from stabledrl_mcore.convert.loader import load_model

    with pytest.raises(ConversionError) as err:
        load_model(sources["nan"])
    numel = upstream_shapes("llada", upstream_config("llada"))[LAYER0_UP]
    _one_line_refusal(
        err.value, f"tensor '{LAYER0_UP}' holds 1 NaN and 0 inf value(s) of {numel[0] * numel[1]}", "allow_nonfinite"
    )
    model = load_model(sources["nan"], allow_nonfinite=True)
    assert sum(int((~torch.isfinite(p)).sum()) for p in model.parameters()) == 1
    with pytest.raises(ConversionError, match=r"cast to torch.float16: tensor 'decoder\.layers\.0\.mlp\.linear_fc1"):
        load_model(sources["huge"], dtype=torch.float16)


def test_conversion_refuses_values_a_dtype_cast_makes_infinite(sources, tmp_path):
    with pytest.raises(ConversionError) as err:
        conv.hf_to_mcore(sources["huge"], str(tmp_path / "m16"), model="llada", dtype="fp16", progress=False)
    _one_line_refusal(
        err.value, "cast to float16: tensor 'decoder.layers.0.mlp.linear_fc1.weight' holds 0 NaN and 1 inf"
    )
    assert not os.path.exists(tmp_path / "m16")
    fp32 = conv.hf_to_mcore(sources["huge"], str(tmp_path / "m32"), model="llada", progress=False)
    with pytest.raises(ConversionError) as err:
        conv.mcore_to_hf(fp32, str(tmp_path / "hf16"), dtype="fp16", progress=False)
    _one_line_refusal(err.value, f"cast to float16: tensor '{LAYER0_UP}' holds 0 NaN and 1 inf", "--allow-nonfinite")
    assert not os.path.exists(tmp_path / "hf16")
