"""The benchmark CLI on CPU (``--quick``), its record, the renderer, and the baselines against a NumPy oracle."""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CHILD_CWD, PACKAGE_HOME
from jax.sharding import PartitionSpec as P

from jax_moe_comm import bench
from jax_moe_comm.bench import baselines
from jax_moe_comm.bench.record import format_table

ROOT = Path(__file__).resolve().parent.parent
ROW_KEYS = {"backend", "config", "tokens", "dispatch_us", "combine_us", "total_us", "gbps"}


def _load_render():
    spec = importlib.util.spec_from_file_location("bench_render", ROOT / "benchmarks" / "render.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    """One ``--quick`` run in a subprocess (no XLA_FLAGS: the bench sets up its 8 CPU devices itself)."""
    out = tmp_path_factory.mktemp("bench")
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith("JAX_") or k == "JAX_ENABLE_X64"}
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_HOME), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "jax_moe_comm.bench", "--quick", "--backends", "reference,padded,ragged",
           "--json", str(out / "tmp.json"), "--plot", str(out / "tmp.png")]
    proc = subprocess.run(cmd, cwd=CHILD_CWD, env=env, capture_output=True, text=True, timeout=600)
    print(proc.stdout[-5000:])
    print(proc.stderr[-5000:], file=sys.stderr)
    return proc, out


def test_quick_bench_runs_and_writes_the_record(quick_run):
    proc, out = quick_run
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((out / "tmp.json").read_text())
    for key in ("date", "commit", "device", "world", "command", "jax", "rows"):
        assert key in record, key
    assert record["world"] == 8 and record["device"] == "8x cpu"
    assert "--quick" in record["command"] and record["jax"] == jax.__version__ and record["weights_to"] == "combine"
    rows = record["rows"]
    assert {(r["config"], r["tokens"], r["backend"]) for r in rows} == {
        (c, 8, b) for c in ("r1", "v2lite") for b in ("reference", "padded", "ragged")}
    for row in rows:
        assert ROW_KEYS <= set(row), row
        if row["backend"] in ("reference", "padded"):
            assert row.get("error") is None, row
            # A time, with its bandwidth; on a busy CPU a round trip can be below the timing resolution (the
            # chains' difference is then <= 0), which the row must say.
            assert row["total_us"] is not None and math.isfinite(row["total_us"]), row
            assert (row["total_us"] > 0 and row["gbps"] is not None) or "timing resolution" in row.get("note", ""), row
            assert row["dispatch_us"] is not None and row["combine_us"] is not None, row
            assert row["rel_err"] < 2e-2, row
            each = row["total_us_each"]  # every repeat's time, so a record shows the spread behind its median
            assert len(each) == record["repeats"] and statistics.median(each) == pytest.approx(row["total_us"],
                                                                                                   abs=2e-3), row
        else:  # XLA:CPU has no ragged_all_to_all; a platform that has one must give a time
            assert row.get("error") or row["total_us"] > 0, row
            if row.get("error"):
                assert row["total_us"] is None
    # The table went to stdout.
    assert "reference" in proc.stdout and "padded" in proc.stdout and "total_us" in proc.stdout


def test_the_backward_mode_times_and_checks_forward_and_backward_round_trips(tmp_path):
    """--backward: each step of the chain is a round trip and its gradient's; the padded baseline's gradient of the
    weights is checked against the reference backend's (plain AD), and the record says which mode it holds."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith("JAX_") or k == "JAX_ENABLE_X64"}
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_HOME), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "jax_moe_comm.bench", "--quick", "--backward", "--configs", "v2lite",
           "--backends", "reference,padded", "--json", str(tmp_path / "backward.json")]
    proc = subprocess.run(cmd, cwd=CHILD_CWD, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "backward.json").read_text())
    assert record["backward"] is True and "forward + backward" in proc.stdout
    rows = {row["backend"]: row for row in record["rows"]}
    assert rows.keys() == {"reference", "padded"}
    for row in rows.values():
        assert row.get("error") is None and row["total_us"] is not None, row
        assert row["dispatch_us"] is None and row["combine_us"] is None, row  # no halves
    assert rows["reference"]["rel_err"] is None  # the check itself
    assert rows["padded"]["rel_err"] < 2e-2, rows["padded"]


def test_render_writes_the_table_between_the_markers(quick_run, tmp_path, capsys):
    _, out = quick_run
    render = _load_render()
    readme = tmp_path / "README.md"
    readme.write_text(f"# Results\n\nbefore\n{render.BEGIN}\nold table\n{render.END}\nafter\n")
    assert render.main([str(out / "tmp.json"), "--readme", str(readme), "--png", str(tmp_path / "latest.png")]) == 0
    text = readme.read_text()
    table = text[text.index(render.BEGIN):text.index(render.END)]
    assert "old table" not in table and "before" in text and "after" in text
    assert "reference µs" in table and "padded µs" in table and "ragged µs" in table
    assert "| r1 | 8 |" in table and "| v2lite | 8 |" in table
    assert "8x cpu" in table

    no_markers = tmp_path / "plain.md"
    no_markers.write_text("nothing here\n")
    render.main([str(out / "tmp.json"), "--readme", str(no_markers), "--png", str(tmp_path / "x.png")])
    printed = capsys.readouterr().out
    assert "padded µs" in printed and "no <!-- bench:begin -->" in printed
    assert no_markers.read_text() == "nothing here\n"


def test_render_speedups_and_newest_record(tmp_path):
    render = _load_render()
    row = dict(config="r1", tokens=128, dispatch_us=None, combine_us=None, gbps=1.0)
    old = {"date": "2026-01-01T00:00:00+00:00", "rows": [dict(row, backend="padded", total_us=100.0)]}
    new = {"date": "2026-02-01T00:00:00+00:00", "device": "2x NVIDIA H200", "world": 2, "commit": "abc",
           "command": "python -m jax_moe_comm.bench", "jax": "0.11.2",
           "rows": [dict(row, backend="nvshmem", total_us=50.0), dict(row, backend="padded", total_us=100.0),
                    dict(row, backend="ragged", total_us=None, error="UNIMPLEMENTED")]}
    (tmp_path / "b.json").write_text(json.dumps(old))
    (tmp_path / "a.json").write_text(json.dumps(new))
    assert render.newest_record(tmp_path).name == "a.json"
    table = render.markdown_table(new)
    assert "nvshmem vs padded" in table and "2.00×" in table and "| error |" in table
    assert "ragged: r1 tokens 128: UNIMPLEMENTED" in table


# Baselines vs a NumPy brute force ------------------------------------------------------------------------------


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name, axis_index_groups=None):
    """jax.lax.ragged_all_to_all from all_gathers (XLA:CPU has no ragged-all-to-all): for each source s, its chunk
    for me (rows input_offsets[s][me] + [0, send_sizes[s][me])) lands at output_offsets[s][me] of my output."""
    del recv_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    rows = jax.lax.all_gather(operand, axis_name)
    starts, sizes, dests = (jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes,
                                                                              output_offsets))
    index = jnp.arange(operand.shape[0])
    for s in range(jax.lax.axis_size(axis_name)):
        inside = (index >= starts[s]) & (index < starts[s] + sizes[s])
        target = jnp.where(inside, dests[s] + index - starts[s], output.shape[0])
        output = output.at[target].set(rows[s], mode="drop")
    return output


def _brute_force(x, ids, w, expert_fn):
    y = np.zeros(x.shape, np.float64)
    for t in range(x.shape[0]):
        for k in range(ids.shape[1]):
            if ids[t, k] >= 0:
                y[t] += w[t, k] * expert_fn(x[t].astype(np.float64))
    return y


@pytest.mark.parametrize("kind", ["padded", "ragged"])
def test_baseline_round_trip_matches_numpy(kind, make_mesh, rng, monkeypatch):
    world, T, H, E, K = 4, 6, 32, 16, 3
    mesh = make_mesh(world)
    if kind == "ragged" and jax.devices()[0].platform == "cpu":
        monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    x = rng.standard_normal((world * T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]).astype(np.int32)
    ids[rng.random(ids.shape) < 0.25] = -1  # unused slots
    ids[0] = [0, 1, 2]  # one token with every slot on rank 0's experts
    w = rng.random((world * T, K)).astype(np.float32)

    def expert_fn(rows):
        return rows * 3.0 - 1.0  # exact in float32 for these inputs' scale

    round_trip = getattr(baselines, f"{kind}_round_trip")
    fn = functools.partial(round_trip, num_experts=E, axis_name="ep", expert_fn=expert_fn)
    y = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(x, ids, w)
    np.testing.assert_allclose(np.asarray(y), _brute_force(x, ids, w, expert_fn), rtol=1e-5, atol=1e-5)

    # The dispatch half: each rank gets exactly the rows routed to its experts, grouped by local expert.
    dispatch = getattr(baselines, f"{kind}_dispatch")
    d = jax.jit(jax.shard_map(functools.partial(dispatch, num_experts=E, axis_name="ep"), mesh=mesh,
                              in_specs=P("ep"), out_specs=P("ep")))(x, ids)
    L, rows_per_rank = E // world, d.expert_x.shape[0] // world
    for r in range(world):
        rows = np.asarray(d.expert_x[r * rows_per_rank:(r + 1) * rows_per_rank])
        mine = [(e, t) for t in range(world * T) for e in ids[t] if e // L == r]
        if kind == "ragged":  # by local expert, then source rank, then token
            sizes = np.asarray(d.group_sizes[r * L:(r + 1) * L])
            assert sizes.tolist() == [sum(e == r * L + j for e, _ in mine) for j in range(L)]
            expect = np.stack([x[t] for _, t in sorted(mine)]) if mine else np.zeros((0, H), np.float32)
            np.testing.assert_array_equal(rows[:len(mine)], expect)
            assert not rows[len(mine):].any()
        else:  # one chunk per source rank, each sorted by expert, then zero padding
            local = np.asarray(d.expert_ids[r * rows_per_rank:(r + 1) * rows_per_rank])
            got = sorted((r * L + int(e), tuple(row)) for e, row in zip(local, rows, strict=True) if e >= 0)
            assert got == sorted((e, tuple(x[t])) for e, t in mine)
            assert not rows[local < 0].any()


def test_baseline_round_trip_fp8_with_scales(make_mesh, rng):
    """fp8 payload + block scales through padded: the expert sees dequantizable rows with their scales."""
    world, T, H, E, K, B = 4, 4, 256, 8, 2, 128
    mesh = make_mesh(world)
    xq = (rng.standard_normal((world * T, H)) * 50).astype(jnp.float8_e4m3fn)
    scales = (rng.random((world * T, H // B)) + 0.5).astype(np.float32)
    ids = np.stack([rng.choice(E, K, replace=False) for _ in range(world * T)]).astype(np.int32)
    w = rng.random((world * T, K)).astype(np.float32)

    def expert_fn(rows, row_scales):
        n = rows.shape[0]
        deq = rows.astype(jnp.float32).reshape(n, H // B, B) * row_scales[:, :, None]
        return deq.reshape(n, H).astype(jnp.bfloat16)

    def fn(x, ids, w, scales):
        return baselines.padded_round_trip(x, ids, w, num_experts=E, axis_name="ep", expert_fn=expert_fn,
                                           scales=scales)

    y = jax.jit(jax.shard_map(fn, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(xq, ids, w, scales)
    assert y.dtype == jnp.bfloat16
    deq = (xq.astype(np.float32).reshape(-1, H // B, B) * scales[:, :, None]).reshape(-1, H)
    want = _brute_force(deq.astype(jnp.bfloat16).astype(np.float32), ids, w, lambda r: r)
    np.testing.assert_allclose(np.asarray(y, np.float32), want, rtol=2e-2, atol=2e-2 * np.abs(want).max())


@pytest.mark.parametrize("backend", ["padded", "reference"])
def test_round_trip_chain_keeps_every_round_trip(backend, make_mesh):
    """XLA runs n chained round trips as n (none merged with another for identical inputs, none dropped as unused),
    and the bench's check says so; a chain tied only by optimization barriers is merged, and the check says that."""
    mesh = make_mesh(2)
    cfg, T, n = bench.QUICK_CONFIGS["r1"], 8, 3
    rng = bench.seeded(1)
    x, scales = bench.make_tokens(rng, cfg, 2 * T)
    ids, w = bench.make_routing(rng, cfg, 2 * T)
    args = tuple(bench.to_global(a, mesh) for a in (x, scales, ids, w))
    impl = bench.make_impl(backend, cfg, T, mesh, check_errors=False)

    def compiled(chain):
        return [bench.lower_chain(chain(impl, cfg, steps), mesh, args).compile() for steps in (1, n)]

    pair = compiled(bench.round_trip_chain)
    one, many = (bench.communication_ops(fn) for fn in pair)
    # Every step's payload collectives stay; only those of the routing alone (the same ids each step) may be shared.
    assert one >= 2 and many - one >= 2 * (n - 1)
    assert bench.merged_steps(pair, n, 2) is None

    def barrier_chain(impl, cfg, steps):
        def body(x, scales, ids, w):
            expert_y = y = None
            for _ in range(steps):
                rows, row_scales, aux = impl.dispatch(x, scales, ids, w)
                if expert_y is None:
                    expert_y = bench.expert_stand_in(cfg, rows, row_scales)
                else:
                    expert_y, _ = jax.lax.optimization_barrier((expert_y, rows))
                y = impl.combine(expert_y, aux, w)
                x, _ = jax.lax.optimization_barrier((x, y))
            return x, y
        return body

    assert "XLA merged chained steps" in bench.merged_steps(compiled(barrier_chain), n, 2)


def test_weights_to_dispatch_gives_the_same_round_trips(make_mesh):
    """--weights-to dispatch: the MoEComm backends get the weights with dispatch; the chain's result is the same."""
    mesh = make_mesh(2)
    cfg, T = bench.QUICK_CONFIGS["r1"], 8
    rng = bench.seeded(2)
    x, scales = bench.make_tokens(rng, cfg, 2 * T)
    ids, w = bench.make_routing(rng, cfg, 2 * T)
    args = tuple(bench.to_global(a, mesh) for a in (x, scales, ids, w))
    ys = []
    for weights_to in ("combine", "dispatch"):
        impl = bench.make_impl("reference", cfg, T, mesh, check_errors=False, weights_to=weights_to)
        ys.append(np.asarray(bench.lower_chain(bench.round_trip_chain(impl, cfg, 2), mesh, args).compile()(*args)[1],
                             np.float32))
    np.testing.assert_array_equal(ys[1], ys[0])
    assert bench.parse_args(["--weights-to", "dispatch"]).weights_to == "dispatch"


def test_options_reach_the_moecomm_backends(make_mesh):
    """--option NAME=VALUE sets a MoEComm keyword option of the MoEComm backends; unknown names and values that are
    no Python literal are refused by the parser."""
    args = bench.parse_args(["--option", "prereduce_min_tokens=1", "--option", "staged=True"])
    assert args.options == {"prereduce_min_tokens": 1, "staged": True}
    impl = bench.make_impl("reference", bench.QUICK_CONFIGS["r1"], 8, make_mesh(2), options=args.options)
    assert (impl.comm.options.prereduce_min_tokens, impl.comm.options.staged) == (1, True)
    for bad in ("check_errors=False", "fused=1", "staged=yes", "staged"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--option", bad])


def test_floor_backends_need_the_nvshmem_backend(make_mesh):
    """The floor probes (ffi/probe.cu: fence and signal, or flagged words) run only where the NVSHMEM backend does;
    elsewhere they are listed as unavailable with the NVSHMEM backend's reason."""
    available, why_not = bench.available_backends(make_mesh(2), "no GPU here")
    for probe in ("floor", "floor_flagged"):
        assert probe not in available and why_not[probe] == why_not["nvshmem"] == "no GPU here"
    assert bench.parse_args(["--backends", "floor,floor_flagged"]).backends == ["floor", "floor_flagged"]


def test_timing_note_says_when_repeats_fall_below_the_resolution():
    """A repeat <= 0 means the chain was shorter than the host's jitter: the row says so, with how many."""
    assert bench.timing_note([10.0, 12.0, 11.0], 20) is None
    assert bench.timing_note([], 20) is None
    loose = bench.timing_note([14.5, -5.9, 13.0, 11.5, -11.0], 20)
    assert loose.startswith("2 of 5 repeats at or below zero") and "--chain" in loose
    assert "timing resolution" in bench.timing_note([-1.0, 0.0, 2.0], 20)


def test_committed_records_have_the_schema_and_the_readme_shows_the_newest():
    """Every record under benchmarks/results/ (subfolders included) carries what makes it a record, and the table in
    the project README is the one render.py makes from the newest top-level record."""
    render = _load_render()
    results = ROOT / "benchmarks" / "results"
    paths = sorted(results.rglob("*.json"))
    assert paths, "no committed record"
    for path in paths:
        record = json.loads(path.read_text())
        assert {"date", "commit", "device", "world", "command", "rows"} <= set(record), path
        assert record["rows"], path
        for row in record["rows"]:
            assert {"backend", "config", "tokens", "dispatch_us", "combine_us", "total_us"} <= set(row), (path, row)
    newest_path = render.newest_record(results)
    newest = json.loads(newest_path.read_text())
    readme = (ROOT / "README.md").read_text()
    shown = readme[readme.index(render.BEGIN) + len(render.BEGIN):readme.index(render.END)].strip()
    assert shown == render.markdown_table(newest, str(newest_path.relative_to(ROOT))).strip()


@pytest.mark.parametrize("at", ["dispatch", "combine"])
def test_the_overlap_mode_times_compute_between_the_split_halves(tmp_path, at):
    """--overlap: each MoEComm backend's size gets the round trip, the shared expert alone and the round trip with the
    shared expert between the dispatch's (or with --overlap-at combine, the combine's) halves, and hidden_us is
    exactly what the first two add up to beyond the third; a backend without split halves says so instead of a
    time."""
    env = {k: v for k, v in os.environ.items()
           if k != "XLA_FLAGS" and not k.startswith("JAX_") or k == "JAX_ENABLE_X64"}
    env.update(JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [str(PACKAGE_HOME), env.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "jax_moe_comm.bench", "--quick", "--overlap", "64", "--configs", "v2lite",
           "--backends", "reference,padded", "--overlap-at", at, "--json", str(tmp_path / "overlap.json")]
    proc = subprocess.run(cmd, cwd=CHILD_CWD, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    record = json.loads((tmp_path / "overlap.json").read_text())
    assert record["overlap"] == 64 and record["overlap_at"] == at and "hidden_us" in proc.stdout
    assert f"between the {at}'s halves" in proc.stdout
    rows = {row["backend"]: row for row in record["rows"]}
    ref = rows["reference"]
    assert ref.get("error") is None and ref["rel_err"] < 2e-2, ref  # its round trip against the NumPy brute force
    assert ref["compute_us"] is not None and ref["overlapped_us"] is not None, ref  # timed (CPU: any sign)
    assert ref["hidden_us"] == pytest.approx(ref["total_us"] + ref["compute_us"] - ref["overlapped_us"], abs=2e-3)
    assert ref["dispatch_us"] is None and ref["combine_us"] is None, ref  # no halves
    assert "split halves" in rows["padded"]["error"] and rows["padded"]["total_us"] is None


def test_the_overlap_mode_times_every_send_stream_unless_told():
    """--overlap times the NVSHMEM rows with every MoEComm(send_stream=...) side by side (none: XLA's stream), or
    those of --send-streams, or the one of --option send_stream=...; --send-streams alone is refused."""
    assert bench.parse_args(["--overlap"]).send_streams == [None, "own", "xla_async"]
    assert bench.parse_args(["--overlap", "--send-streams", "own,none"]).send_streams == ["own", None]
    assert bench.parse_args(["--overlap", "--option", "send_stream='own'"]).send_streams == ["own"]
    assert bench.parse_args([]).send_streams == [None]
    for argv in (["--send-streams", "own"], ["--overlap", "--send-streams", "side"]):
        with pytest.raises(SystemExit):
            bench.parse_args(argv)
    text = format_table([{"config": "r1", "tokens": 8, "backend": "nvshmem", "send_stream": "own",
                                "total_us": 1.0, "overlapped_us": 2.0}])
    assert "nvshmem/own" in text


@pytest.mark.parametrize("config", ["r1", "v2lite"])
def test_a_later_steps_expert_output_is_the_first_steps_and_differentiates_as_the_stand_in(config):
    """The backward chain's later steps reuse the first step's expert_y (one buffer, no copy per step) and send
    back the rows' whole cotangent, the expert stand-in's: what a layer's expert backward gives the dispatch."""
    from jax_moe_comm.bench.chains import _expert_again

    cfg = bench.QUICK_CONFIGS[config]
    rng = bench.seeded(3)
    x, scales = bench.make_tokens(rng, cfg, 16)
    first = bench.expert_stand_in(cfg, jnp.asarray(x), None if scales is None else jnp.asarray(scales))
    rows, row_scales = bench.make_tokens(rng, cfg, 16)
    rows = jnp.asarray(rows)
    row_scales = None if row_scales is None else jnp.asarray(row_scales)
    ct = jnp.asarray(rng.standard_normal(first.shape), first.dtype)
    again = _expert_again(cfg)
    y, vjp = jax.vjp(lambda r: again(first, r, row_scales), rows)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(first))
    _, stand_in_vjp = jax.vjp(lambda r: bench.expert_stand_in(cfg, r, row_scales), rows)
    got, want = vjp(ct)[0], stand_in_vjp(ct)[0]
    assert got.dtype == rows.dtype
    np.testing.assert_array_equal(np.asarray(got.astype(jnp.float32)), np.asarray(want.astype(jnp.float32)))
    assert np.count_nonzero(np.asarray(got.astype(jnp.float32))) > got.size // 2  # every row, not one


def test_the_overlap_mode_refuses_the_backward_mode():
    with pytest.raises(SystemExit):
        bench.parse_args(["--overlap", "--backward"])
