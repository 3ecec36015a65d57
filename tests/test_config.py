"""Typed config: YAML + dotted overrides, clear errors, atomic save."""

import pytest
import yaml

from stabledrl_mcore.common.errors import ConfigError
from stabledrl_mcore.config.io import to_dict
from stabledrl_mcore.config.schema import RunConfig, load_config, save_config


def test_defaults_validate_and_round_trip(tmp_path):
    cfg = load_config()
    assert isinstance(cfg, RunConfig) and cfg.algo.loss == "stabledrl"
    path = save_config(cfg, str(tmp_path / "sub" / "config.yaml"))
    again = load_config(path)
    assert to_dict(again) == to_dict(cfg)
    assert not [p for p in (tmp_path / "sub").iterdir() if p.name.startswith(".config-")]


def test_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {"algo": {"eps": 0.3}, "optim": {"betas": [0.9, 0.95]}, "model": {"overrides": {"num_layers": 2}}}
        )
    )
    cfg = load_config(
        str(path), ["algo.eps=0.1", "parallel.tensor_parallel=2", "algo.ratio_noise=student_t", "optim.lr=3e-5"]
    )
    assert cfg.algo.eps == 0.1 and cfg.parallel.tensor_parallel == 2
    assert cfg.optim.betas == (0.9, 0.95) and cfg.optim.lr == 3e-5
    assert cfg.model.overrides == {"num_layers": 2}
    assert load_config(None, ["algo.ratio_noise=null"]).algo.ratio_noise is None
    widened = load_config(None, ["optim.lr=1"]).optim.lr
    assert isinstance(widened, float) and widened == 1.0


def test_unknown_key_names_closest():
    with pytest.raises(ConfigError, match=r"unknown config key algo\.epz.*did you mean algo\.eps"):
        load_config(None, ["algo.epz=0.1"])
    with pytest.raises(ConfigError, match=r"unknown config key algorithm.*did you mean algo"):
        load_config(None, ["algorithm.eps=0.1"])


def test_wrong_type_names_field_and_type():
    with pytest.raises(ConfigError, match=r"parallel\.tensor_parallel: expected int, got str"):
        load_config(None, ["parallel.tensor_parallel=two"])
    with pytest.raises(ConfigError, match=r"algo\.length_normalize: expected bool"):
        load_config(None, ["algo.length_normalize=3"])
    with pytest.raises(ConfigError, match=r"optim\.betas: expected a list of 2 values"):
        load_config(None, ["optim.betas=[0.9]"])


def test_a_wrong_optional_value_names_the_field_and_what_it_takes():
    """An Optional field's wrong value says what it takes, not "expected Optional" (issue #70): every
    Optional[int] field, and a number YAML reads as text (1e9, no dot) gets the way to write it."""
    import dataclasses
    import typing

    from stabledrl_mcore.config.io import from_dict

    with pytest.raises(ConfigError) as err:
        load_config(None, ["rollout.decode_rows=1e9"])
    message = str(err.value)
    assert message.startswith("rollout.decode_rows: expected int or null, got str '1e9'"), message
    assert "1000000000" in message and "\n" not in message
    with pytest.raises(ConfigError, match=r"^rollout\.decode_rows: expected int or null, got float 2\.5$"):
        load_config(None, ["rollout.decode_rows=2.5"])
    optional_ints = [
        f"{section}.{name}"
        for section, kind in typing.get_type_hints(RunConfig).items()
        if dataclasses.is_dataclass(kind)
        for name, field_type in typing.get_type_hints(kind).items()
        if field_type == typing.Optional[int]
    ]
    assert "rollout.decode_rows" in optional_ints and len(optional_ints) > 3, optional_ints
    for name in optional_ints:
        with pytest.raises(ConfigError, match=rf"^{name}: expected int or null, got str 'many'$"):
            load_config(None, [f"{name}=many"])

    @dataclasses.dataclass
    class Inner:
        size: int = 1

    @dataclasses.dataclass
    class Outer:
        inner: typing.Optional[Inner] = None

    with pytest.raises(ConfigError, match=r"^inner\.size: expected int, got str 'x'$"):
        from_dict(Outer, {"inner": {"size": "x"}})  # the nested field, not "expected Optional"


def test_value_checks():
    with pytest.raises(ConfigError, match=r"algo\.eps must be in \(0, 1\)"):
        load_config(None, ["algo.eps=1.5"])
    with pytest.raises(ConfigError, match=r"model\.dtype must be one of"):
        load_config(None, ["model.dtype=fp8"])
    with pytest.raises(ConfigError, match=r"rollout\.group_size must be >= 1"):
        load_config(None, ["rollout.group_size=0"])
    with pytest.raises(ConfigError, match="not of the form"):
        load_config(None, ["algo.eps"])
    with pytest.raises(ConfigError, match=r"algo\.coupled_masks needs an even algo\.num_mc \(got 3\)"):
        load_config(None, ["algo.coupled_masks=true", "algo.num_mc=3"])
    with pytest.raises(ConfigError, match=r"coupled_masks.*not 'mean_field'"):
        load_config(None, ["algo.coupled_masks=true", "algo.likelihood=mean_field"])
    assert load_config(None, ["algo.coupled_masks=true", "algo.num_mc=4"]).algo.coupled_masks
    with pytest.raises(ConfigError, match=r"optim\.distributed=true needs optim\.name=adam.*'sgd'"):
        load_config(None, ["optim.name=sgd"])  # accepted and ignored before: now refused by name
    assert not load_config(None, ["optim.name=sgd", "optim.distributed=false"]).optim.distributed


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(str(bad))


def test_example_configs_load():
    import glob
    import os

    here = os.path.join(os.path.dirname(__file__), "..", "examples", "configs")
    files = sorted(glob.glob(os.path.join(here, "*.yaml")))
    assert files, "examples/configs/*.yaml are missing"
    for path in files:
        load_config(path)


def test_algorithm_fields_that_would_be_ignored_are_refused():
    cases = {
        ("algo.loss=ppo",): r"unknown loss 'ppo'",
        ("algo.loss_options={foo: 1}",): r"foo not an option of loss 'stabledrl'",
        ("algo.loss=diffu_grpo",): r"token level: it needs algo.likelihood=mean_field",
        ("algo.mask_scheme=block_random", "algo.likelihood=staircase"): r"applies to the elbo/spg likelihoods",
        ("algo.spg_beta=2.0",): r"set algo.likelihood=spg",
        ("algo.kl_estimator=k2",): r"no effect with algo.kl_coef=0",
        ("algo.reference_sync_every=64",): r"need a reference",
        ("algo.loss=spg", "algo.eps=0.3"): r"algo.eps has no effect with algo.loss=spg",
        ("algo.loss=spg", "algo.ratio_noise=lognormal"): r"ratio_noise has no effect",
        ("algo.mask_sampling=sometimes",): r"algo.mask_sampling must be one of",
        ("algo.post_eos=drop",): r"algo.post_eos must be one of",
    }
    for overrides, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            load_config(None, list(overrides))
    ok = load_config(
        None,
        [
            "algo.loss=spg",
            "algo.likelihood=spg",
            "algo.spg_beta=2.0",
            "algo.loss_options={aggregation: length_weighted}",
            "algo.kl_coef=0.01",
            "algo.kl_estimator=k2",
            "algo.mask_scheme=block_random",
            "algo.post_eos=mask_and_skip",
        ],
    )
    assert ok.algo.loss_options == {"aggregation": "length_weighted"} and ok.algo.spg_beta == 2.0
