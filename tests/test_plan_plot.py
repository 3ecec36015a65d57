"""``stabledrl plan --plot``: the bar chart's components add up to each layout's total; the PNG is written."""

import pytest

from stabledrl_mcore.bench.plan import PlanSpec, all_layouts
from stabledrl_mcore.bench.plan_plot import COMPONENTS, memory_components
from stabledrl_mcore.cli.app import main
from stabledrl_mcore.models import get_preset


@pytest.mark.parametrize(
    "preset, kw",
    [
        ("llada-8b", dict(recompute="full")),
        ("llada-8b", dict(recompute="none", reference_model=True, distributed_optimizer=False)),
        ("sdar-8b", dict(recompute="selective", likelihood="staircase", seq_len=4096, gen_length=2048)),
        ("sdar-30b-a3b", dict(recompute="full", likelihood="staircase", ep=2)),
    ],
)
def test_components_add_up_to_the_total_of_every_layout(preset, kw):
    rows = all_layouts(PlanSpec(model=get_preset(preset), **kw).validate())
    assert len(rows) >= 4
    for row in rows:
        parts = memory_components(row)
        assert [name for name, _ in parts] == [name for name, _ in COMPONENTS]
        assert all(value >= 0 for _, value in parts)
        assert sum(value for _, value in parts) == pytest.approx(row["total"], rel=1e-12)
        assert dict(parts)["weights"] == row["weights"] and dict(parts)["optimizer"] == row["optimizer"]
    if get_preset(preset).is_moe:  # every EP of the expert grid, each bar with its expert shards
        assert {r["ep"] for r in rows} == {1, 2, 4, 8} and all(r["expert_params"] > 0 for r in rows)
    if kw.get("reference_model"):
        assert all(dict(memory_components(r))["reference weights"] > 0 for r in rows)


def test_a_rollout_peak_above_the_training_peak_shows_as_its_excess():
    row = dict(
        weights=8.0,
        reference_weights=0.0,
        gradients=16.0,
        optimizer=12.0,
        activations=5.0,
        recomputed_layer=2.0,
        training_peak=6.0,
        rollout_peak=10.0,
        overhead=4.0,
    )
    row["total"] = 8 + 16 + 12 + max(6, 10) + 4
    parts = dict(memory_components(row))
    assert parts["activations kept for the backward"] == 3.0  # 5 - the recomputed layer
    assert parts["LM head or one recomputed layer (the larger)"] == 3.0  # training peak 6 - 3 kept
    assert parts["rollout beyond the training peak"] == 4.0 and sum(parts.values()) == row["total"]


def test_plot_flag_writes_a_png_and_is_documented(tmp_path, capsys):
    out = tmp_path / "plan.png"
    assert main(["plan", "--model", "llada-8b", "--tp", "2", "--recompute", "full", "--plot", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"written: {out}" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        main(["plan", "--help"])
    assert exc.value.code == 0 and "--plot FILE.png" in capsys.readouterr().out


@pytest.mark.parametrize("name, expected", [("plan.jpg", "give a .png file name"), ("no/such/plan.png", "no folder")])
def test_bad_plot_path_is_refused_before_any_estimate(tmp_path, capsys, name, expected):
    assert main(["plan", "--model", "llada-8b", "--plot", str(tmp_path / name)]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and expected in captured.err and len(captured.err.strip().splitlines()) == 1
