"""How a failed round trip reaches the user (reference backend, 8 CPU devices).

A round trip that fails anywhere fails everywhere: every rank ends it with the same status, its combined output is
NaN on every rank, and with the default ``check_errors=True`` every rank raises the same message at the same call,
so that a step of many MoE layers stops with one error instead of leaving devices waiting in a later collective.

What the user sees and catches: the step raises one ``jax.errors.JaxRuntimeError`` whose text begins with our message
after XLA's code (``ABORTED: jax_moe_comm: ...``, with the CUDA extension or the status module; an install without
either checks with a host callback, whose error JAX ends with our message), printed once (no per-device log records,
nothing again at exit); ``MoECommError``, which host code raises, is a subclass of it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import oracle
import pytest
from conftest import ep_mesh, standalone_cpu_env
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import errors

WORLD, T, H, E, K = 4, 4, 8, 8, 2


def _round_trip(check_errors):
    cfg = jax_moe_comm.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)
    comm = jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors=check_errors)

    def shard(x, ids, w):
        d = comm.dispatch(x, ids)
        return d.handle.status, d.handle.row_origin, d.expert_x, comm.combine(d.expert_x, d.handle, w)

    return jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=P("ep"), out_specs=P("ep")))


def _inputs(bad_rank: int | None = 0, bad_id: int = 99):
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    if bad_rank is not None:
        ids[bad_rank * T + 1, 1] = bad_id  # token 1 of that rank
    return np.ones((WORLD * T, H), np.float32), ids, np.ones((WORLD * T, K), np.float32)


def test_without_checks_nothing_is_raised_and_the_output_is_nan_on_every_rank():
    """check_errors=False: dispatch's error word stays in the handle of the rank that found it, the round trip
    completes, and its combined output is NaN everywhere (never a number computed without the bad slot)."""
    status, _, _, y = jax.block_until_ready(_round_trip(check_errors=False)(*_inputs(bad_rank=2)))
    status = np.asarray(status).reshape(WORLD, errors.STATUS_WORDS)
    assert status[2, errors.CODE] == errors.BAD_EXPERT_ID
    assert tuple(status[2, [errors.RANK, errors.DETAIL_A, errors.DETAIL_B]]) == (2, 1, 99)
    assert not status[[0, 1, 3]].any()
    assert np.isnan(np.asarray(y)).all()


def test_the_same_call_with_checks_raises_and_the_next_valid_call_works():
    x, ids, w = _inputs()
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 0: expert id 99 of token 1 is outside"):
        jax.block_until_ready(_round_trip(check_errors=True)(x, ids, w))
    *_, y = jax.block_until_ready(_round_trip(check_errors=True)(*_inputs(bad_rank=None)))
    np.testing.assert_array_equal(np.asarray(y), np.full((WORLD * T, H), 2.0))  # weights 1 on both slots


@pytest.mark.parametrize("mode", [True, "sync"])
def test_an_error_on_one_rank_raises_on_every_rank_with_that_ranks_message(mode):
    """Rank 3's bad id: the message names rank 3 (the lowest rank with an error), whichever device raises."""
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 3: expert id 8 of token 1"):
        jax.block_until_ready(_round_trip(check_errors=mode)(*_inputs(bad_rank=3, bad_id=E)))


def test_the_default_check_runs_only_when_a_round_trip_fails(monkeypatch):
    """check_errors=True on the reference backend: a jitted chain of 4 valid round trips runs the check on no device
    (it sits in a conditional that runs only for a failed round trip), and returns what check_errors=False returns;
    with a bad id in the second round trip it runs once per device (the step stops there) and the step raises. (The
    check counted is the host callback of an install without the CUDA extension; the extension's handler sits in
    the same conditional.)"""
    monkeypatch.setattr(errors, "_raise_target_registered", lambda: ())
    calls = []
    host_check = errors._check_errors

    def counted(words, after):
        calls.append(int(np.asarray(words).reshape(-1)[errors.CODE]))
        return host_check(words, after)

    monkeypatch.setattr(errors, "_check_errors", counted)
    jax.clear_caches()  # traced again: a cached conditional holds the host function it was traced with
    cfg = jax_moe_comm.MoECommConfig(E, K, H, T, dtype=jnp.float32, out_dtype=jnp.float32)

    def chain(check_errors):
        comm = jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors=check_errors)

        def shard(x, ids, w):
            for layer in range(4):
                d = comm.dispatch(x, ids[layer])
                x = comm.combine(d.expert_x, d.handle, w)
            return x

        return jax.jit(jax.shard_map(shard, mesh=comm.mesh, in_specs=(P("ep"), P(None, "ep"), P("ep")),
                                     out_specs=P("ep")))

    x, ids, w = _inputs(bad_rank=None)
    layered = np.stack([ids] * 4)
    y = jax.block_until_ready(chain(True)(x, layered, w))
    assert calls == []
    np.testing.assert_array_equal(np.asarray(y), np.asarray(chain(False)(x, layered, w)))
    layered[1] = _inputs(bad_rank=2)[1]
    with pytest.raises(jax.errors.JaxRuntimeError, match="dispatch_send failed on rank 2: expert id 99 of token 1"):
        jax.block_until_ready(chain(True)(x, layered, w))
    assert calls == [errors.BAD_EXPERT_ID] * WORLD


def test_the_handle_status_has_the_shape_its_docstring_states():
    """CombineHandle's docstring is a contract: status is int32 [8], the words errors.py names."""
    from jax_moe_comm.types import CombineHandle

    status, *_ = _round_trip(check_errors=False)(*_inputs(bad_rank=None))
    per_shard = np.asarray(status).reshape(WORLD, -1)
    assert per_shard.shape[1] == errors.STATUS_WORDS == 8
    assert f"status:     int32 [{errors.STATUS_WORDS}]" in CombineHandle.__doc__


def test_check_errors_must_be_true_false_or_sync():
    cfg = jax_moe_comm.MoECommConfig(E, K, H, T)
    with pytest.raises(ValueError, match="check_errors must be True, False or 'sync', got 'later'"):
        jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", check_errors="later")
    with pytest.raises(ValueError, match=r"timeout_s must be a number of seconds in \(0, 86400\], got 0"):
        jax_moe_comm.MoEComm(cfg, ep_mesh(WORLD), backend="reference", timeout_s=0)


# Duplicate ids ------------------------------------------------------------------------------------------------
def test_a_repeated_id_drops_the_later_slot_like_the_oracle_and_raises():
    """One expert twice in a token's top-k: the later slot is dropped (no row, no weight), as the kernels do and
    the oracle says, and the round trip fails with the repeat named."""
    ids = np.tile(np.array([[0, 5]], np.int32), (WORLD * T, 1))
    ids[1] = [3, 3]  # token 1 of rank 0
    x = np.arange(WORLD * T * H, dtype=np.float32).reshape(WORLD * T, H)
    w = np.ones((WORLD * T, K), np.float32)
    _, row_origin, expert_x, y = jax.block_until_ready(_round_trip(check_errors=False)(x, ids, w))
    layouts = oracle.dispatch(x.reshape(WORLD, T, H), ids.reshape(WORLD, T, K), np.full(WORLD, T), world=WORLD,
                              dp_size=1, num_experts=E, align=1, capacity=T * WORLD * min(K, E // WORLD))
    capacity = layouts[0].row_origin.shape[0]
    row_origin = np.asarray(row_origin).reshape(WORLD, capacity)
    expert_x = np.asarray(expert_x).reshape(WORLD, capacity, H)
    for rank, want in enumerate(layouts):
        np.testing.assert_array_equal(row_origin[rank], want.row_origin)
        np.testing.assert_array_equal(expert_x[rank], want.expert_x)
    assert (row_origin == 1 * K + 1).sum() == 0, "the repeated slot got a row"
    assert np.isnan(np.asarray(y)).all()
    with pytest.raises(Exception, match=r"dispatch_send failed on rank 0: token 1 names expert 3 in two top-k slots"):
        jax.block_until_ready(_round_trip(check_errors=True)(x, ids, w))


# Many layers in one step -------------------------------------------------------------------------------------
CHAIN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
    os.environ["JAX_PLATFORMS"] = "cpu"
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_moe_comm as jmc
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    cfg = jmc.MoECommConfig(16, 2, 16, 4, dtype=jnp.float32, out_dtype=jnp.float32)
    shared = sys.argv[1] == "shared"
    comms = [jmc.MoEComm(cfg, mesh)] * 4 if shared else [jmc.MoEComm(cfg, mesh) for _ in range(4)]
    def step(x, ids):
        w = jnp.ones(ids.shape[1:], jnp.float32)
        for layer, comm in enumerate(comms):
            d = comm.dispatch(x, ids[layer])
            x = x + comm.combine(d.expert_x * 0.5, d.handle, w)
        return x
    fn = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P("ep"), P(None, "ep")), out_specs=P("ep")))
    ids = np.tile(np.array([[0, 9]], np.int32), (4, 32, 1))
    ids[1, 13, 0] = 16  # layer 1, token 1 of rank 3
    start = time.time()
    try:
        jax.block_until_ready(fn(np.ones((32, 16), np.float32), ids))
    except Exception as exc:
        print(f"RAISED in {time.time() - start:.1f}s:", str(exc).splitlines()[-1])
    else:
        print("NO ERROR")
""")


@pytest.mark.parametrize("comms", ["one per layer", "shared"])
def test_a_bad_id_in_one_layer_of_a_many_layer_step_raises_one_error_quickly(tmp_path, comms):
    """Four MoE layers in one jitted step, a bad id in layer 1 on one rank: one error with its message, at once,
    instead of the other devices waiting in a later layer's collective until XLA aborts the process (run in a
    subprocess: an abort or a hang must not take the test session down)."""
    script = tmp_path / "chain.py"
    script.write_text(CHAIN_SCRIPT)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    env.pop("XLA_FLAGS", None)
    try:
        done = subprocess.run([sys.executable, str(script), "shared" if comms == "shared" else "per layer"],
                              capture_output=True, text=True, timeout=60, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail("the step hung instead of raising")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "RAISED in" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "dispatch_send failed on rank 3: expert id 16 of token 1 is outside [-1, num_experts)" in done.stdout
    seconds = float(done.stdout.split("RAISED in ")[1].split("s:")[0])
    assert seconds < 10, f"the error took {seconds}s"


# What the user catches, and what is printed ------------------------------------------------------------------
CHILD = Path(__file__).resolve().parent / "errors_child.py"
CHILD_MESSAGE = ("jax_moe_comm: dispatch_send failed on rank {rank}: expert id 16 of token 1 is outside "
                 "[-1, num_experts)")


# The three checks: the CUDA extension's FFI handler and the status module's (the error's text is XLA's code, then our
# message) and, without either, a host callback (JAX writes the callback's stack first; our message is the last line).
CHECKS = [pytest.param("handler", marks=pytest.mark.skipif(not jax_moe_comm.build_info()["cuda"],
                                                           reason="an install without the CUDA extension")),
          pytest.param("status_module", marks=pytest.mark.skipif(jax_moe_comm._native.status_ext is None,
                                                                 reason="a build without the status module")),
          "callback"]


def _our_line(check: str, message: str) -> str:
    """The child's line that carries our message: the error's first line (handlers) or its last (callback)."""
    return f"LAST LINE: MoECommError: {message}" if check == "callback" else f"FIRST LINE: ABORTED: {message}"


def _run_child(view: str, outcome: str, devices: int, layers: int = 3,
               check: str = "handler") -> tuple[subprocess.CompletedProcess, str]:
    """tests/errors_child.py on `devices` CPU devices: (the finished process, its stdout + stderr)."""
    env = standalone_cpu_env()
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    try:
        done = subprocess.run([sys.executable, str(CHILD), view, outcome, str(layers), check], capture_output=True,
                              text=True, timeout=120, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {view} step hung instead of raising")
    return done, done.stdout + done.stderr


def test_a_moe_comm_error_is_a_jax_runtime_error():
    """One ``except jax.errors.JaxRuntimeError`` catches what a jitted step raises and what host code raises;
    ``except MoECommError`` (still a RuntimeError) catches the latter."""
    assert isinstance(jax_moe_comm.MoECommError("x"), jax.errors.JaxRuntimeError)
    assert issubclass(jax_moe_comm.MoECommError, RuntimeError)
    assert jax_moe_comm.MoECommError is errors.MoECommError
    words = np.array([errors.BAD_EXPERT_ID, 0, 2, 1, 99, 0, 0, 0], np.int32)
    with pytest.raises(jax.errors.JaxRuntimeError) as caught:
        errors.raise_if_failed(words)
    assert type(caught.value) is jax_moe_comm.MoECommError
    assert str(caught.value) == ("jax_moe_comm: dispatch_send failed on rank 2: expert id 99 of token 1 is outside "
                                 "[-1, num_experts)")


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize(("view", "devices"), [("shard_map", 4), ("global", 8)])
def test_a_caught_error_of_a_jitted_step_is_printed_once_and_nothing_at_exit(view, devices, check):
    """A bad id in layer 1 of a jitted 3-layer step: the process catches one jax.errors.JaxRuntimeError that leads
    with our message (after XLA's code; the last line with the host callback), and exits normally. The child prints
    the message once; nothing else prints it (no per-device log record of the callback's error, no re-raise of the
    failed step by JAX's atexit hooks)."""
    done, output = _run_child(view, "caught", devices, check=check)
    assert done.returncode == 0, output[-3000:]
    assert "CAUGHT jax.errors.JaxRuntimeError is_jax_runtime_error=True" in done.stdout, output[-3000:]
    message = CHILD_MESSAGE.format(rank=devices - 1)
    assert _our_line(check, message) in done.stdout, output[-3000:]
    assert output.count(message) == 1, output[-6000:]
    assert "Exception ignored" not in output, output[-6000:]
    assert "jax.io_callback failed" not in output, output[-6000:]
    assert done.stdout.rstrip().endswith("EXITING NORMALLY"), output[-3000:]


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("view", ["shard_map", "global"])
def test_a_later_step_of_a_multi_process_job_raises_a_jax_runtime_error(view, check):
    """Two CPU processes under the launcher: a jitted step that has run once (a training loop's later step) fails
    with the same type as its first call and as one process: jax.errors.JaxRuntimeError on every rank. (JAX's C++
    dispatch path raised a callback's failure as ValueError there; the check's conditional branch gives the step
    JAX's debug effect, which sends it through the Python path.)"""
    env = standalone_cpu_env()
    try:
        done = subprocess.run([sys.executable, "-m", "jax_moe_comm.launch", "-n", "2", "--cpu", "--", str(CHILD), view,
                               "later", "3", check], capture_output=True, text=True, timeout=180, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"the {view} step hung instead of raising")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-3000:]
    for rank in (0, 1):
        assert f"[rank {rank}] CAUGHT jax.errors.JaxRuntimeError is_jax_runtime_error=True" in done.stdout, \
            output[-3000:]
        assert f"[rank {rank}] {_our_line(check, CHILD_MESSAGE.format(rank=1))}" in done.stdout, output[-3000:]


@pytest.mark.parametrize("check", CHECKS)
def test_an_uncaught_error_prints_one_traceback_ending_with_our_message(check):
    """Left uncaught, the error ends the process with Python's one traceback, whose last line is our message (after
    the error's type and XLA's code; with the host callback, after the callback's stack), and nothing after it."""
    done, output = _run_child("shard_map", "uncaught", 8, check=check)
    assert done.returncode == 1, output[-3000:]
    message = CHILD_MESSAGE.format(rank=7)
    assert output.count(message) == 1, output[-6000:]
    last = done.stderr.rstrip().splitlines()[-1]
    if check != "callback":
        assert output.count("Traceback (most recent call last)") == 1, output[-6000:]
        assert last == f"jax.errors.JaxRuntimeError: ABORTED: {message}", output[-3000:]
    else:
        assert output.count("Traceback (most recent call last)") == 2, output[-6000:]  # Python's, and JAX's in its text
        assert "jax.errors.JaxRuntimeError: " in done.stderr, output[-3000:]
        assert last == f"MoECommError: {message}", output[-3000:]
    assert "Exception ignored" not in output, output[-6000:]
    assert "NO ERROR" not in done.stdout


def test_an_eager_step_raises_at_its_read():
    """Without jit each primitive of a shard_map runs as its own computation: the check fails only its runtime token
    unless the output depends on the check's result (errors.check_now returns it). One layer: eager calls compile
    every primitive."""
    check = "handler" if jax_moe_comm.build_info()["cuda"] else "callback"  # any: all return check_now's value
    done, output = _run_child("eager", "caught", 4, layers=1, check=check)
    assert done.returncode == 0, output[-3000:]
    assert "CAUGHT jax.errors.JaxRuntimeError is_jax_runtime_error=True" in done.stdout, output[-3000:]
    assert output.count(CHILD_MESSAGE.format(rank=3)) == 1, output[-6000:]
    assert "Exception ignored" not in output, output[-6000:]


FOREIGN_SCRIPT = textwrap.dedent("""
    import jax, numpy as np
    from jax.experimental import io_callback
    from jax.sharding import Mesh, PartitionSpec as P
    import jax_moe_comm
    def fail(x):
        raise ValueError("a failure that is not ours")
    def shard(x):  # every device raises, after a collective (as our check does)
        io_callback(fail, None, jax.lax.all_gather(x, "ep"))
        return x
    mesh = Mesh(np.array(jax.devices()), ("ep",))
    try:
        jax.block_until_ready(jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))(
            np.arange(4.0)))
    except jax.errors.JaxRuntimeError:
        print("CAUGHT")
""")


def test_other_failures_are_still_reported_by_jax_at_exit(tmp_path):
    """The exit hook drops only failed computations whose error text is ours: another callback's failure is left
    to JAX, which reports it at exit as before."""
    script = tmp_path / "foreign.py"
    script.write_text(FOREIGN_SCRIPT)
    env = dict(standalone_cpu_env(), XLA_FLAGS="--xla_force_host_platform_device_count=4")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert "CAUGHT" in done.stdout, done.stderr[-3000:]
    assert "Exception ignored in atexit callback" in done.stderr, done.stderr[-3000:]
    assert "ValueError: a failure that is not ours" in done.stderr


def test_our_texts_are_recognized_in_any_runtime_error():
    """Every text describe() makes (any code, any phase, under JAX's prefixes) is recognized as ours; others are
    not."""
    for code in (*errors.PARTS, errors.TIMEOUT | errors.REFUSED):
        for phase in range(len(errors.PHASES)):
            text = errors.describe(np.array([code, phase, 5, 3, 1, 0, 0, 0], np.int32))
            for wrapped in (text, f"INTERNAL: CpuCallback error calling callback: ...\nMoECommError: {text}",
                            f"ABORTED: {text}"):
                assert errors._OWN_TEXT.search(wrapped), wrapped
    assert not errors._OWN_TEXT.search("INTERNAL: jax_moe_comm combine: CUDA launch failed: ...")
    assert not errors._OWN_TEXT.search("ValueError: a failure that is not ours")


def test_check_now_passes_its_value_through_bit_for_bit_and_differentiably(make_mesh):
    """With no error, check_now returns `after` unchanged (signed zeros, NaN, inf) and is the identity to AD."""
    mesh = make_mesh(WORLD)
    x = np.array([[-0.0, 0.0, np.nan, np.inf, -np.inf, 1.5, -2.25, 3e-39]] * WORLD, np.float32)

    def shard(v):
        return errors.check_now(jnp.zeros((errors.STATUS_WORDS,), jnp.int32), after=v)

    fn = jax.jit(jax.shard_map(shard, mesh=mesh, in_specs=P("ep"), out_specs=P("ep")))
    np.testing.assert_array_equal(np.asarray(fn(x)).view(np.int32), x.view(np.int32))
    grad = jax.grad(lambda v: (fn(v) * 3.0).sum())(np.ones_like(x))
    np.testing.assert_array_equal(np.asarray(grad), np.full_like(x, 3.0))


@pytest.mark.skipif(jax_moe_comm._native.status_ext is None, reason="a build without the status module")
@pytest.mark.parametrize("words", [
    [1, 0, 3, 5, 99, 7, 0, 0],                     # a bad id found by rank 3's dispatch_send
    [4, 1, 1, 37, 32, 2, 0, 0],                    # overflow on rank 1: 37 rows, capacity 32
    [8, 1, 0, 1, 0, 4, 0, 0],                      # rank 0 timed out waiting for rank 1
    [1 | 2, 0, 0, 4, 9, 1, 0, 0],                  # two routing errors at once
])
def test_the_status_modules_handler_raises_the_same_text_as_python(words):
    """The status module (the CPU check of an install without the CUDA extension) formats a failure from errors.py's
    templates, after checking its constants against errors.py's: the same text as errors.describe."""
    module = jax_moe_comm._native.status_ext
    errors.give_texts_to(module)  # raises if the constants differ
    assert module.describe_failure(words) == errors.describe(words)
