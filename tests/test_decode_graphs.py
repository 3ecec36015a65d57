"""The captured decoding step (issue: one compiled graph per generation, ready for CUDA graphs).

Every decoding mode compiles with ``fullgraph=True`` (a graph break or a host read inside the
step is an error), a multi-block generation compiles the documented number of graphs and a second
generation none, the tokens equal the eager sampler's, and the KV buffers are the static inputs of
the captured step (the only inputs it mutates). The mode tests trace with ``aot_eager`` (Dynamo and
AOT's functionalisation, no code generation: CI time); one test runs inductor itself.
"""

from __future__ import annotations

import os
import re

import pytest
import torch
from test_models_hf import megatron_tp1  # noqa: F401  (module-scoped Megatron TP=1 state)
from torch._dynamo.backends.common import aot_autograd

from stabledrl_mcore.diffusion import generate_llada, generate_sdar
from stabledrl_mcore.models import build_model, get_preset
from stabledrl_mcore.models.decoding import DecodingForward, HostReadInStepError, checked_backend, decoding_forward


def _model(arch, layers=1, dtype=torch.float32):
    torch.manual_seed(0)
    return build_model(get_preset(f"{arch}-tiny", init_std=0.2, num_layers=layers), params_dtype=dtype).eval()


def _prompt(rows=2, length=6):
    ids = torch.randint(3, 250, (rows, length), generator=torch.Generator().manual_seed(1))
    valid = torch.ones(rows, length, dtype=torch.bool)
    valid[-1, :2] = False
    return ids, valid


MODES = {
    # (arch, sampler options, graphs per generation shape: see models/decoding.py)
    # read counts: each step's masked positions (sampling_llada.READ_BUCKETS); 2 steps per block:
    # all 4 positions, then the 2 still masked
    "llada-exact": ("llada", dict(cache="none", steps=8, block_length=4), 2),
    "llada-prefix": ("llada", dict(cache="prefix", steps=8, block_length=4), 5),
    "llada-dual": ("llada", dict(cache="dual", steps=8, block_length=4), 2),
    # the fill; block steps reading at most 3, 2, 1 masked positions
    "llada-dual-threshold": ("llada", dict(cache="dual", steps=16, block_length=4, threshold=0.2), 4),
    # sampled, 8 steps of an 8-token block: eager reads the 8, 7, ..., 1 masked positions, compiled
    # 8 (the fill), then 8, 6, 6, 4, 4, 2, 2 (4 graphs): the draws do not depend on what is read
    "llada-dual-sampled": ("llada", dict(cache="dual", steps=16, block_length=8, temperature=1.0), 5),
    "llada-exact-random": ("llada", dict(cache="none", steps=16, block_length=8, remasking="random"), 4),
    "sdar": ("sdar", dict(steps=2), 2),
    # sampled, 8-token blocks, 8 steps: compiled reads 8, 6, 4, 2 positions where eager reads 7, 6, 5, ...
    "sdar-sampled-block8": ("sdar", dict(steps=8, block_length=8, temperature=1.0, top_k=50), 5),
    "sdar-threshold-chunks": (
        "sdar",
        dict(
            steps=4,
            threshold=0.3,
            temperature=1.0,
            stop_at_eos=True,
            repeats=2,
            row_chunks=[(2, torch.Generator().manual_seed(3)), (2, torch.Generator().manual_seed(4))],
        ),
        4,  # 4 steps of a 4-token block: the store step reading 4 positions, block steps reading 3, 2, 1
    ),
}


def _generate(model, arch, options, compile):
    ids, valid = _prompt()
    options = dict(options)
    if "row_chunks" in options:  # fresh generators: every run draws the same
        options["row_chunks"] = [
            (n, torch.Generator().manual_seed(k)) for k, (n, _) in enumerate(options["row_chunks"])
        ]
    sample = (
        options.get("temperature", 0.0) > 0 or options.get("remasking") == "random"
    ) and "row_chunks" not in options
    gen = torch.Generator().manual_seed(5) if sample else None
    fn = generate_llada if arch == "llada" else generate_sdar
    return fn(model, ids, prompt_valid=valid, gen_length=16, generator=gen, progress=False, compile=compile, **options)


@pytest.mark.parametrize("name", list(MODES))
def test_each_decoding_mode_is_a_fixed_number_of_graphs_equal_to_eager(megatron_tp1, name):
    arch, options, graphs = MODES[name]
    torch._dynamo.reset()
    model = _model(arch)
    compiled = DecodingForward(model, "default", backend="aot_eager")
    first = _generate(model, arch, options, compiled)
    assert compiled.stats.graphs == graphs, "4 blocks, the same graphs from the first block on"
    again = _generate(model, arch, options, compiled)
    assert compiled.stats.graphs == graphs, "a second generation of the same shape compiles nothing"
    eager = _generate(model, arch, options, "none")
    assert torch.equal(first, eager) and torch.equal(again, eager)
    assert compiled.stats.forwards > 2 * graphs


def test_the_prefix_step_is_a_fixed_number_of_static_graphs_whatever_the_blocks(megatron_tp1):
    """LLaDA's prefix step forwards the block and the suffix after it, a length that shrinks per
    block: it was compiled as one graph over a symbolic length (on a GPU, a CUDA graph per length).
    It forwards one of 4 fixed windows now (a quarter to all of the generation): a generation of 8
    blocks and one of 16 each compile 5 graphs (the filling forward, 4 windows) of fixed shapes (no
    symbolic size in any input), a second generation none, and the tokens equal eager."""
    from torch.fx.experimental.symbolic_shapes import free_symbols

    torch._dynamo.reset()
    symbolic = []
    aot = torch._dynamo.lookup_backend("aot_eager")

    def backend(gm, example_inputs):  # what Dynamo traced: symbols in the inputs' example values?
        values = [node.meta.get("example_value") for node in gm.graph.find_nodes(op="placeholder")]
        symbolic.append(any(free_symbols(v) for v in values if isinstance(v, (torch.Tensor, torch.SymInt))))
        return aot(gm, example_inputs)

    model = _model("llada")
    ids, valid = _prompt()
    compiled = DecodingForward(model, "default", backend=backend)
    for blocks in (8, 16):
        kw = dict(prompt_valid=valid, gen_length=4 * blocks, steps=2 * blocks, block_length=4, progress=False)
        before = compiled.stats.graphs
        first = generate_llada(model, ids, cache="prefix", compile=compiled, **kw)
        assert compiled.stats.graphs - before == 5 and not any(symbolic), (blocks, symbolic)
        again = generate_llada(model, ids, cache="prefix", compile=compiled, **kw)
        assert compiled.stats.graphs - before == 5, "a second generation compiles nothing"
        eager = generate_llada(model, ids, cache="prefix", **kw)
        assert torch.equal(first, eager) and torch.equal(again, eager)


def test_the_compiled_prefix_window_decodes_as_eager_with_guidance_and_as_exact_rebuilt(megatron_tp1):
    """The prefix step's window with classifier-free guidance (the rows doubled) and a padded batch:
    the eager prefix tokens; with the cache rebuilt every step, the exact decode's."""
    torch._dynamo.reset()
    model = _model("llada")
    ids, valid = _prompt()
    kw = dict(prompt_valid=valid, gen_length=12, steps=6, block_length=4, cfg_scale=0.5, progress=False)
    compiled = DecodingForward(model, "default", backend="aot_eager")
    fast = generate_llada(model, ids, cache="prefix", compile=compiled, **kw)
    assert torch.equal(fast, generate_llada(model, ids, cache="prefix", **kw))
    rebuilt = generate_llada(model, ids, cache="prefix", refresh_every_step=True, compile=compiled, **kw)
    assert torch.equal(rebuilt, generate_llada(model, ids, cache="none", **kw))
    assert compiled.stats.graphs == 4  # the filling forward, windows of 4, 8 and 12


def test_compiled_decoding_says_before_its_first_compile_and_how_long_it_took(megatron_tp1, capsys):
    """Issue 70: a compiled generation waited 50-100 s in silence (eval, generate). A line goes out
    before the first graph compiles (the backend sees it already printed), one with the graphs and
    seconds once they are compiled, and nothing for a generation of a shape already compiled."""
    torch._dynamo.reset()
    seen = []

    def backend(gm, inputs):  # what was printed when the compilation began
        seen.append(capsys.readouterr().err)
        return gm.forward

    arch, options, graphs = MODES["llada-dual"]
    model = _model(arch)
    compiled = DecodingForward(model, "default", backend=backend)
    capsys.readouterr()
    _generate(model, arch, options, compiled)
    assert len(seen) == graphs == 2 and seen[0].startswith("stabledrl: compiling the decoding graphs (compile=default;")
    lines = (seen[0] + seen[1] + capsys.readouterr().err).strip().splitlines()
    assert len(lines) == 2 and lines[0].endswith("...")
    assert re.fullmatch(r"stabledrl: compiled 2 decoding graphs in \d+\.\d s \(compile=default\)", lines[1]), lines
    _generate(model, arch, options, compiled)
    assert capsys.readouterr().err == "" and len(seen) == 2
    _generate(model, arch, options, "none")  # eager: silent
    assert capsys.readouterr().err == ""


def test_generate_and_eval_say_when_they_compile(llada_hf, tmp_path, monkeypatch, capsys):
    """The lines of a compiled generation reach ``stabledrl generate`` and ``eval`` (their
    ``rollout_compile_s`` was 0.0 and nothing was printed); the ``eager`` backend stands in for
    inductor (the same Dynamo capture, no code generation: CI time)."""
    from stabledrl_mcore.cli.app import main
    from stabledrl_mcore.models import decoding

    real = decoding.checked_backend
    monkeypatch.setattr(decoding, "checked_backend", lambda backend, mode, device: real("eager", mode, device))
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch._dynamo.reset()
    sampling = ["--gen-length", "8", "--block-length", "4", "--steps", "4", "--compile", "default", "--no-progress"]
    assert main(["generate", "--ckpt", llada_hf, "--prompt", "tok5 tok6", *sampling]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stabledrl: ")]
    assert said[0].startswith("stabledrl: compiling the decoding graphs (compile=default") and len(said) == 2
    # exact, 2 steps of a 4-token block: a graph reading all 4, one reading the 2 still masked
    assert re.fullmatch(r"stabledrl: compiled 2 decoding graphs in \d+\.\d s \(compile=default\)", said[1]), said
    out = str(tmp_path / "eval.jsonl")
    assert main(["eval", "--ckpt", llada_hf, "--task", "sudoku", "--limit", "2", "--out", out, *sampling]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("stabledrl: ")]
    assert said[0].startswith("stabledrl: compiling the decoding graphs") and "compiled 2 decoding graphs in" in said[1]


def test_the_kv_buffers_are_the_static_inputs_the_captured_step_mutates(megatron_tp1):
    """What CUDA-graph capture needs: every input the step mutates is a static address (else
    torch skips the capture), and those are exactly the KV buffers."""
    torch._dynamo.reset()
    seen, real = [], []

    def capture(gm, fake_inputs):  # AOT's metadata of the graph's inputs, in Dynamo's order
        meta = torch._guards.TracingContext.get().fw_metadata
        inputs = real[-1]
        seen.append(
            dict(
                static={inputs[i].data_ptr() for i in meta.static_input_indices},
                mutated={inputs[i].data_ptr() for i, info in enumerate(meta.input_info) if info.mutates_data},
            )
        )
        return gm

    aot = aot_autograd(fw_compiler=capture)

    def backend(gm, example_inputs):  # Dynamo hands the real tensors to the backend
        real.append(list(example_inputs))
        return aot(gm, example_inputs)

    for arch, mode in (("sdar", "sdar"), ("llada", "llada-dual"), ("llada", "llada-prefix")):
        model, options = _model(arch), MODES[mode][1]
        compiled = DecodingForward(model, "reduce-overhead", backend=backend)
        seen.clear()
        _generate(model, arch, options, compiled)
        (cache,) = compiled._caches.values()
        buffers = {t.data_ptr() for pair in cache._buffers.values() for t in pair}
        assert len(buffers) == 2 * model.config.num_layers
        slot_steps = [graph for graph in seen if graph["mutated"]]
        assert slot_steps, arch
        for graph in slot_steps:
            assert graph["mutated"] == buffers, arch
            assert buffers <= graph["static"], arch
        assert all(getattr(t, "_dynamo_static_input_type", None) for pair in cache._buffers.values() for t in pair)


def test_a_step_called_where_autograd_records_is_still_one_graph(megatron_tp1):
    """A caller outside ``torch.no_grad()`` (a tool filling the cache): the step records nothing,
    so the model takes its inference path, not Megatron's ``make_viewless_tensor`` (a break)."""
    torch._dynamo.reset()
    model = _model("llada")
    compiled = DecodingForward(model, "default", backend="aot_eager")
    ids, _ = _prompt(rows=1, length=12)
    cache = compiled.cache(1, 12)
    assert torch.is_grad_enabled()
    logits = compiled(ids, kv_cache=cache, logit_positions=torch.arange(4, 8))
    assert compiled.stats.graphs == 1 and not logits.requires_grad
    with torch.no_grad():
        eager = model(ids, logit_positions=torch.arange(4, 8))
    torch.testing.assert_close(logits, eager)


def test_the_cache_buffers_keep_their_addresses_across_generations(megatron_tp1):
    model = _model("sdar")
    forward = decoding_forward(model, "none")
    first = forward.cache(4, 16)
    addresses = [t.data_ptr() for pair in first._buffers.values() for t in pair]
    for pair in first._buffers.values():
        for t in pair:
            t.fill_(1.0)
    second = forward.cache(4, 16)
    assert second is first and [t.data_ptr() for pair in second._buffers.values() for t in pair] == addresses
    assert all(not t.any() for pair in second._buffers.values() for t in pair), "zeroed for the new generation"
    assert forward.cache(2, 16) is not first


def test_a_full_cache_pool_drops_the_oldest_shape_and_keeps_the_newest(megatron_tp1):
    """Issue 71 (1a): past ``CACHE_POOL`` shapes the least recently used one goes; the one just
    asked for, and one used again, stay (their buffers, i.e. a compiled graph's static inputs)."""
    from stabledrl_mcore.models import decoding

    forward = DecodingForward(_model("sdar"), "none")
    pool = decoding.CACHE_POOL
    first = [forward.cache(rows, 8) for rows in range(1, pool + 1)]
    assert forward.cache(1, 8) is first[0]  # used again: now the most recent
    newest = forward.cache(pool + 1, 8)  # one shape too many: rows=2 (the oldest) goes
    assert len(forward._caches) == pool
    assert forward.cache(pool + 1, 8) is newest, "the newest shape was dropped"
    assert forward.cache(1, 8) is first[0] and all(forward.cache(r, 8) is first[r - 1] for r in range(3, pool + 1))
    assert forward.cache(2, 8) is not first[1], "the oldest shape was kept"


def test_inductor_compiles_the_sdar_and_llada_steps_to_the_eager_tokens(megatron_tp1):
    """The shipped backend (inductor, C++ on CPU): the SDAR recipe's sampler (threshold, chunks)
    and LLaDA's dual cache give the eager tokens, and the logits agree to rounding."""
    torch._dynamo.reset()
    for arch, name in (("sdar", "sdar-threshold-chunks"), ("llada", "llada-dual")):
        model = _model(arch)
        options = MODES[name][1]
        compiled = DecodingForward(model, "default")
        assert torch.equal(_generate(model, arch, options, compiled), _generate(model, arch, options, "none"))
        assert compiled.stats.graphs == MODES[name][2] and compiled.stats.compile_s > 0


def _compiled_layer_counts(layers, tmp_path, monkeypatch):
    """Compile LLaDA's exact step of a ``layers``-deep llada-tiny with inductor from a fresh cache:
    (kernels inductor generated, layer calls of the captured graph, subgraphs they call)."""
    from torch._inductor import metrics

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / f"inductor-{layers}"))
    torch._dynamo.reset()
    metrics.reset()
    graphs = []
    inductor = checked_backend("inductor", "default", "cpu")

    def backend(gm, example_inputs):  # what Dynamo captured, before inductor's passes rewrite it
        calls = [n for n in gm.graph.nodes if n.target is torch.ops.higher_order.invoke_subgraph]
        graphs.append((len(calls), len({getattr(gm, n.args[0].target) for n in calls})))
        return inductor(gm, example_inputs)

    model = _model("llada", layers=layers)
    compiled = DecodingForward(model, "default", backend=backend)
    ids, _ = _prompt(rows=1, length=8)
    with torch._inductor.config.patch(fx_graph_cache=False):
        logits = compiled(ids, logit_positions=torch.arange(4, 8))
    with torch.no_grad():
        torch.testing.assert_close(logits, model(ids, logit_positions=torch.arange(4, 8)))
    ((calls, bodies),) = graphs
    return metrics.generated_kernel_count, calls, bodies


def test_the_layer_code_is_generated_once_whatever_the_depth(megatron_tp1, tmp_path, monkeypatch):
    """Issue 73: inductor compiled the 32-36 identical layers of a captured step one by one (a cold
    compile of 136-296 s per graph at the 8B layer counts). Each layer is now a call of one nested
    compile region: the captured graph calls one subgraph per layer with that layer's parameters as
    inputs, and inductor generates the same kernels for 8 layers as for 3 (before: ~3x as many).
    The last layer, which runs its MLP on the read rows only (``model._layer_at_rows``), is traced
    in the step itself, the same for any depth."""
    kernels3, calls3, bodies3 = _compiled_layer_counts(3, tmp_path, monkeypatch)
    kernels8, calls8, bodies8 = _compiled_layer_counts(8, tmp_path, monkeypatch)
    assert (calls3, calls8) == (2, 7), "every layer but the last a call of the region"
    assert bodies3 == bodies8 == 1, "one subgraph for all the layers"
    assert kernels3 > 0 and kernels8 == kernels3, (kernels3, kernels8)


def test_a_compiled_sampler_refuses_what_it_cannot_capture(megatron_tp1):
    model = _model("sdar")
    ids, valid = _prompt()
    with pytest.raises(ValueError, match="use_cache=False is the eager reference"):
        generate_sdar(model, ids, gen_length=8, steps=2, use_cache=False, compile="default")
    with pytest.raises(ValueError, match="compile must be one of"):
        generate_sdar(model, ids, gen_length=8, steps=2, compile="max-autotune")
    with pytest.raises(ValueError, match="another model"):
        generate_sdar(_model("sdar"), ids, gen_length=8, steps=2, compile=decoding_forward(model, "default"))


def test_a_host_read_inside_the_step_is_refused():
    """Dynamo captures ``int(tensor)`` into a ``fullgraph`` graph instead of breaking it; the
    decoding step's backend refuses it by name (a CUDA graph cannot hold a host read)."""
    step = torch.compile(lambda t: t * int(t[0]), fullgraph=True, backend=checked_backend("eager", "default", "cpu"))
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="reads a tensor on the host") as raised:
        step(torch.arange(3))
    assert isinstance(raised.value.inner_exception, HostReadInStepError)
    # inside a nested compile region (each transformer layer is one): the subgraph's nodes are checked
    region = torch.compiler.nested_compile_region(lambda t: t * int(t[0]))
    step = torch.compile(
        lambda t: region(region(t) + 1), fullgraph=True, backend=checked_backend("eager", "default", "cpu")
    )
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match="reads a tensor on the host") as raised:
        step(torch.arange(3))
    assert isinstance(raised.value.inner_exception, HostReadInStepError)


def test_compile_and_decode_rows_are_refused_by_name_where_they_cannot_work():
    from stabledrl_mcore.common.errors import ConfigError
    from stabledrl_mcore.config.checks import check_model_options
    from stabledrl_mcore.config.schema import load_config

    with pytest.raises(ConfigError, match=r"rollout\.compile must be one of"):
        load_config(None, ["rollout.compile=max-autotune"])
    for layout in ("parallel.tensor_parallel=2", "parallel.pipeline_parallel=2"):
        with pytest.raises(ConfigError, match=r"rollout\.compile=default captures one rank's whole model"):
            load_config(None, ["rollout.compile=default", layout])
    moe = get_preset("sdar-moe-tiny")
    with pytest.raises(ConfigError, match="mixture of experts"):
        check_model_options(load_config(None, ["rollout.compile=default", "rollout.block_length=4"]), moe)
    with pytest.raises(
        ConfigError, match=r"multiple of lcm\(parallel\.micro_batch_size=4, rollout\.group_size=8\) = 8"
    ):
        load_config(None, ["rollout.decode_rows=12"])
    assert load_config(None, ["rollout.decode_rows=24"]).rollout.decode_rows == 24
    with pytest.raises(ConfigError, match=r"rollout\.compile=none compiles nothing"):
        load_config(None, ["rollout.compile_cache_dir=/tmp/x"])
    assert load_config(None, ["rollout.compile=default", "rollout.compile_cache_dir=/tmp/x"]).rollout.compile_cache_dir


def test_an_rl_step_with_compiled_rollouts_logs_its_compile_time_and_decode_rows(tmp_path, capsys, monkeypatch):
    """``rollout.compile=default`` through the trainer (the shipped inductor backend): the first
    step compiles and logs its seconds, the second compiles nothing; the decoding rows chosen from
    memory (every row of the rank here) are logged once and kept."""
    import json

    from test_trainer import CONFIG, in_process_trainer, overrides

    from stabledrl_mcore.config.schema import load_config
    from stabledrl_mcore.rl.trainer import train

    torch._dynamo.reset()
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))  # restored after the test
    run_dir = tmp_path / "run"
    extra = {"logging.progress": False, "steps": 2, "rollout.prompts_per_step": 2, "rollout.compile": "default"}
    extra["model.overrides.num_layers"] = 1  # compile time (CI)
    with in_process_trainer():
        train(load_config(CONFIG, overrides(str(run_dir), **extra)))
    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert rows[0]["rollout_compile_s"] > 0 and rows[1]["rollout_compile_s"] == 0.0
    assert rows[0]["rollout_decode_rows"] == rows[1]["rollout_decode_rows"] == 2 * 4  # 2 prompts x G=4
    captured = capsys.readouterr()
    assert "rollouts decode 8 rows per forward (set by the memory left for decoding)" in captured.out
    said = [line for line in captured.err.splitlines() if line.startswith("stabledrl: compil")]
    assert said[0].startswith("stabledrl: compiling the decoding graphs (compile=default") and len(said) == 2, said
    cache = run_dir / "inductor-cache"  # rollout.compile_cache_dir's default: a requeued job reuses it
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(cache) and any(p.is_file() for p in cache.rglob("*"))


def test_decode_rows_follow_the_memory_left_for_decoding(megatron_tp1, monkeypatch):
    from stabledrl_mcore.models.decoding import decode_row_bytes, decode_rows_for_memory
    from stabledrl_mcore.rl import group_rollout

    model = _model("sdar", layers=2)
    cfg = model.dllm_config
    # keys and values of 2 layers x 2 query groups x 16 dims x 40 positions in fp32; the largest
    # forward's working memory per query token: the residual, its normed copy and a sublayer's output
    # (3 x 64) beside the
    # larger of attention's (2 x 4 heads + 2 x 2 groups) x 16 (+ on CPU the 4 heads x 10 x 40 scores)
    # and the MLP's 4 x 176; the block's logits (fp32) and the sampler's float64 work per vocabulary entry
    kv = 2 * 2 * 2 * 16 * 40 * 4
    attention, mlp = 10 * 4 * (3 * 64 + 12 * 16) + 4 * 4 * 10 * 40, 10 * 4 * (3 * 64 + 4 * 176)
    sampler = 4 * cfg.vocab_size * (4 + 28)
    assert decode_row_bytes(model, 40, 4, cfg.vocab_size, query=10, cached=True) == kv + max(attention, mlp) + sampler
    assert decode_row_bytes(model, 40, 4, cfg.vocab_size, query=10, cached=False) == max(attention, mlp) + sampler
    assert (
        decode_row_bytes(model, 40, 4, cfg.vocab_size, query=40, cached=False)
        > 40 * 4 * (3 * 64 + 12 * 16) + 4 * 4 * 40 * 40
    )
    assert decode_rows_for_memory(1000, 100, 4, 64) == 8  # 10 rows fit: whole units of 4
    assert decode_rows_for_memory(1e12, 100, 4, 10) == 12  # at most the rank's rows, rounded up to a unit
    assert decode_rows_for_memory(50, 100, 4, 64) == 4  # never below one unit
    row = decode_row_bytes(model, 40, 4, cfg.vocab_size, query=10, cached=True)
    monkeypatch.setattr(group_rollout, "free_decoding_memory", lambda device: 7.5 * row)
    kw = dict(micro_batch=2, group_size=3, capacity=40, block=4, query=10, cached=True)
    assert group_rollout.memory_decode_rows(model, rows=60, **kw) == 6  # 7 fit: one unit of lcm(2, 3)
    monkeypatch.setattr(group_rollout, "free_decoding_memory", lambda device: 5.0 * row)
    assert group_rollout.memory_decode_rows(model, rows=60, **kw) == 2  # not a whole unit: one micro-batch


def test_forward_row_bytes_at_tp2_by_hand():
    """Issue 71 (1d): a rank at TP=2 holds half of every head's and the MLP's tensors (not the
    residual stream): llada-tiny (4 heads, 4 query groups of 16, hidden 64, FFN 176) and sdar-tiny
    (2 groups), 10 query tokens over 200 keys in fp32; with CPU's scores attention is the larger."""
    from stabledrl_mcore.models.decoding import forward_row_bytes

    llada, sdar = get_preset("llada-tiny"), get_preset("sdar-tiny")
    mlp = 10 * 4 * (3 * 64 + 4 * 176 / 2)  # 21760: gate, up, activation, product of F/2 columns
    assert forward_row_bytes(llada, 10, 200, 4, tp=2) == mlp
    assert forward_row_bytes(llada, 10, 200, 4, tp=2, mlp_tensors=3) == 10 * 4 * (3 * 64 + 3 * 176 / 2)
    # q, k, v and the output: (2 x 4/2 heads + 2 x 4/2 groups) x 16; the scores: 4/2 heads x 10 x 200
    attention = 10 * 4 * (3 * 64 + (2 * 2 + 2 * 2) * 16) + 4 * 2 * 10 * 200
    assert attention == 28800 and forward_row_bytes(llada, 10, 200, 4, tp=2, scores=True) == attention
    attention = 10 * 4 * (3 * 64 + (2 * 2 + 2 * 1) * 16) + 4 * 2 * 10 * 200  # sdar: 2/2 groups
    assert forward_row_bytes(sdar, 10, 200, 4, tp=2, scores=True) == attention == 27520
    assert forward_row_bytes(sdar, 10, 200, 2, tp=2) == mlp / 2  # bf16


@pytest.mark.parametrize(
    "arch,cache,cached", [("sdar", "none", True), ("llada", "none", False), ("llada", "dual", True)]
)
def test_the_rollouts_memory_based_rows_charge_the_kv_cache_the_sampler_keeps(
    megatron_tp1, monkeypatch, arch, cache, cached
):
    """Issue 71 (1c): ``rollout.decode_rows`` unset, the rows per decoding forward are chosen from a
    row's memory with SDAR's own KV cache (``rollout.cache`` is LLaDA's option: SDAR always keeps
    one), LLaDA's only with ``rollout.cache`` on."""
    from test_device_rule import CharTokenizer

    from stabledrl_mcore.rl import group_rollout, rollout
    from stabledrl_mcore.tasks import get_task

    model = _model(arch)
    seen = []
    real = group_rollout.decode_row_bytes
    monkeypatch.setattr(group_rollout, "decode_row_bytes", lambda *a, **k: (seen.append(k["cached"]), real(*a, **k))[1])
    task = get_task("sudoku", prompt_style="compact")
    batch = rollout.generate_rollouts(
        model,
        CharTokenizer(),
        task,
        task.load("train", n=1, seed=0),
        group_size=2,
        gen_length=4,
        steps=2,
        block_length=4,
        temperature=0.0,
        threshold=None,
        micro_batch=2,
        cache=cache,
        chunk_generator=lambda k: torch.Generator().manual_seed(k),
    )
    assert seen == [cached] and batch.stats["rollout_decode_rows"] == 2


def _live_peak(model, rows: int, prompt: int) -> int:
    """The peak of the live tensor bytes (torch's profiler: each op's allocations, each free) while
    ``rows`` prompts of ``prompt`` tokens decode 8 tokens without a cache: not the allocator's RSS."""
    from torch.profiler import ProfilerActivity, profile

    from stabledrl_mcore.diffusion import generate

    vocab = model.dllm_config.vocab_size
    ids = torch.randint(3, vocab - 2, (rows, prompt), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        generate(model, ids, generator=torch.Generator().manual_seed(0), gen_length=8, steps=4, block_length=8)
    live = peak = 0
    for event in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += event.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("prompt,vocab", [(18, 27), (200, 256)])
def test_a_decoded_rows_estimate_bounds_its_measured_memory(megatron_tp1, prompt, vocab):
    """Issue #62: with ``rollout.group_size=100000`` the tiny recipe's first rollout took 2e5 rows per
    forward (18-token prompts, the tokenizer's 27 tokens) and grew past 20 GB on a 23 GB host: the
    estimate counted a KV cache the cache-free forward does not keep (69.6 KB) and the sampler's
    work (6.9 KB), not the forward over the whole sequence (measured 101 KB). Per row added (64 ->
    256 rows), the measured live bytes are at most the estimate (+2%: it leaves out the sampler's
    per-position integer state, its ids and masks, ~1% at 26 tokens) and not far below it."""
    from stabledrl_mcore.models.decoding import decode_row_bytes

    torch.manual_seed(0)
    model = build_model(get_preset("llada-tiny", vocab_size=vocab, mask_token_id=vocab - 1)).eval()
    per_row = (_live_peak(model, 256, prompt) - _live_peak(model, 64, prompt)) / 192
    estimate = decode_row_bytes(model, prompt + 16, 8, vocab, query=prompt + 8, cached=False)
    assert 0.6 * estimate <= per_row <= 1.02 * estimate, (per_row, estimate)


def test_each_mode_of_one_model_traces_with_its_own_layer_regions(megatron_tp1):
    """One model decoded with ``reduce-overhead`` (CPU: inductor's C++ wrapper, no code for a
    nested region) and with ``default`` (regions on): each mode's step runs, and traces, with its
    own ``layer_regions`` whichever was made last. Before, the last DecodingForward made set the
    model's flag for all: ``tools/bench_peers.py --compile reduce-overhead default`` crashed at the
    C++ wrapper's next shape (batch 4) with ``codegen invoke_subgraph is not implemented for cpp
    wrapper``."""
    model = _model("llada")
    seen = []

    def record(*args):
        seen.append(model.layer_regions)
        return torch.zeros(1)

    cpp = DecodingForward(model, "reduce-overhead")
    python = DecodingForward(model, "default")
    cpp._fn = python._fn = record  # what the step would trace with; nothing compiled
    ids, _ = _prompt(rows=1, length=4)
    cpp(ids)
    python(ids)
    cpp(ids)
    assert seen == [False, True, False]
    assert model.layer_regions  # the class default outside a step
