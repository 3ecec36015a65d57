"""The one Registry behind losses, advantages, mask schemes and tasks (common/registry.py)."""

import pytest

from stabledrl_mcore.algorithms import advantages, losses, token_losses
from stabledrl_mcore.common.registry import Registry
from stabledrl_mcore.diffusion import mask_schemes
from stabledrl_mcore.tasks import base as task_base


def test_register_get_names_and_refusals():
    table = Registry("widget")

    @table.register("b")
    def b():
        return 2

    table.add("a", len)
    assert table.get("b") is b and table["a"] is len and table.names() == ("a", "b") and "a" in table
    table.add("a", len)  # the very same object again (a module imported twice) is fine
    with pytest.raises(ValueError, match="widget 'a' is already registered"):
        table.add("a", abs)
    table.add("a", abs, overwrite=True)
    assert table.get("a") is abs
    with pytest.raises(ValueError, match="non-empty string"):
        table.register("")
    assert table.pop("a") is abs and table.names() == ("b",) and table.get("zz", None) is None


def test_an_unknown_name_lists_the_valid_ones_closest_first_or_as_told():
    table = Registry("widget")
    for name in ("alpha", "beta", "gamma"):
        table.add(name, name)
    with pytest.raises(ValueError, match=r"unknown widget 'betta'; valid names \(closest first\): beta, "):
        table.get("betta")
    custom = Registry("thing", unknown=lambda name, valid: KeyError(f"{name} not in {valid}"))
    with pytest.raises(KeyError, match=r"x not in \(\)"):
        custom.get("x")


def test_every_registry_of_the_project_is_this_one():
    tables = [
        losses._REGISTRY,
        token_losses._REGISTRY,
        advantages._REGISTRY,
        mask_schemes._SCHEMES,
        task_base._REGISTRY,
    ]
    assert all(type(t) is Registry for t in tables)
    assert "stabledrl" in tables[0] and "uniform" in tables[3] and "sudoku" in tables[4]
