"""``python -m jax_moe_comm.examples.decode``: greedy decoding through the MoE layers gives the dense model's tokens,
with one compilation of the decode step for every batch size.

The subprocess runs get an environment without conftest's XLA_FLAGS (the example forces its own 8 host devices, or
keeps a device count it is given); the in-process runs use conftest's 8 CPU devices.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import CHILD_CWD, standalone_cpu_env

from jax_moe_comm.examples import decode

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
SMALL = ["--layers", "1", "--steps", "3", "--prompt", "2"]  # the in-process runs: less to compile


def _run(*args: str, devices: int | None = None) -> subprocess.CompletedProcess[str]:
    env = standalone_cpu_env()
    if devices is not None:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    return subprocess.run([sys.executable, "-m", "jax_moe_comm.examples.decode", *args], env=env, cwd=CHILD_CWD,
                          capture_output=True, text=True, timeout=TIMEOUT_S)


def _batch_lines(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): line for line in stdout.splitlines() if (m := re.match(r"batch +(\d+) ", line))}


def test_two_batch_sizes_on_8_cpu_devices_one_compilation_dense_tokens() -> None:
    r = _run("--batch", "32", "5")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "backend reference" in r.stdout and "world 8" in r.stdout, r.stdout
    lines = _batch_lines(r.stdout)
    assert sorted(lines) == [5, 32], r.stdout
    # 32 = every slot of 8 ranks x 4; 5 leaves three ranks with nothing to decode (num_tokens 0).
    assert "num_tokens per rank 4 4 4 4 4 4 4 4" in lines[32] and "num_tokens per rank 1 1 1 1 1 0 0 0" in lines[5]
    steps = 8 + 1  # the default --steps greedy steps, plus the token the prefill's last step picks
    for batch, line in lines.items():
        assert f"tokens vs dense {batch * steps}/{batch * steps} identical" in line and line.endswith("PASS"), line
        assert float(re.search(r"([\d.]+) tokens/s", line).group(1)) > 0, line
    assert "decode step compiled 1 time(s) for batch sizes 32, 5" in r.stdout, r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS"), r.stdout
    assert "FAIL" not in r.stdout, r.stdout


def test_single_cpu_device_world_1_bfloat16() -> None:
    r = _run(*SMALL, "--batch", "4", "1", "--dtype", "bfloat16", devices=1)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "world 1" in r.stdout and "bfloat16" in r.stdout, r.stdout
    assert "decode step compiled 1 time(s) for batch sizes 4, 1" in r.stdout, r.stdout
    assert r.stdout.rstrip().splitlines()[-1].startswith("PASS"), r.stdout


@pytest.fixture(scope="module")
def small():
    """(args, EP decoder, dense decoder, prompts) of a small config on conftest's 8 devices, compiled once."""
    args = decode.parse_args([*SMALL, "--batch", "3", "32"])
    mesh, comm, batches = decode.start(args)
    weights = decode.init_model(args)
    ep, dense = decode.EPDecoder(comm, mesh, args, weights), decode.DenseDecoder(args, weights)
    prompts = np.random.default_rng(0).integers(0, args.vocab, (max(batches), args.prompt), np.int32)
    yield args, ep, dense, prompts
    ep.close()
    comm.close()


def test_in_process_tokens_equal_dense_and_the_counter_sees_a_recompile(small) -> None:
    """The generated ids themselves, one compilation for two batch sizes, and a second compilation counted when
    the step does get a new shape (a longer KV cache), so the count of one is not vacuous."""
    args, ep, dense, prompts = small
    for batch in args.batch:
        result = decode.decode_batch(ep, dense, prompts[:batch], args)
        assert result.tokens.shape == (batch, args.steps + 1)
        np.testing.assert_array_equal(result.tokens, result.dense_tokens)
        assert result.logits_bound <= 1.0 and result.ok, result
        assert sum(result.num_tokens) == batch and max(result.num_tokens) - min(result.num_tokens) <= 1
    assert (ep.traces, ep.compiles, ep.compilations()) == (1, 1, 1)

    longer = argparse.Namespace(**dict(vars(args), steps=args.steps + 1))  # a new shape: a new executable
    caches = jax.device_put(decode.init_cache(ep.rows, longer), ep.row_sharding)
    tokens = ep.global_rows(np.zeros(ep.rows, np.int32))
    ep.step(ep.params, caches, tokens, np.int32(0), ep.global_rows(np.ones(ep.rows // ep.max_tokens, np.int32)))
    assert (ep.traces, ep.compiles, ep.compilations()) == (2, 2, 2)


def test_a_wrong_dense_model_fails(small, monkeypatch) -> None:
    """The check can fail: a dense model that keeps only each token's first expert gives other tokens."""
    args, ep, _, prompts = small
    original = decode.dense_moe
    monkeypatch.setattr(decode, "dense_moe", lambda params, x, k, dtype, out_dtype: original(
        params, x, 1, dtype, out_dtype))
    result = decode.decode_batch(ep, decode.DenseDecoder(args, decode.init_model(args)), prompts[:8], args)
    assert not result.tokens_match and result.logits_bound > 1 and not result.ok, result
    assert result.mismatch.startswith("sequence "), result.mismatch


def test_main_exits_1_and_prints_fail_on_a_mismatch(monkeypatch, capsys) -> None:
    tokens = np.zeros((2, 3), np.int32)
    bad = decode.BatchResult(2, [1, 1], tokens, tokens + 1, 0.5, 9.0, 0.1, "sequence 0, token 0: ...",
                             tokens_per_s=1.0, ms_per_step=1.0)
    closed = []
    comm = type("Comm", (), {"close": lambda self: closed.append(True)})()
    monkeypatch.setattr(decode, "start", lambda args: (None, comm, [2]))
    monkeypatch.setattr(decode, "run", lambda args, mesh, comm, batches, say: ([bad], 1))
    assert decode.main([]) == 1
    assert capsys.readouterr().out.splitlines()[-1].startswith("FAIL") and closed == [True]


def test_compare_flags_a_flipped_token_and_a_logit_off_tolerance() -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 3, 16)).astype(np.float32)
    tokens = logits[-4:].argmax(-1).T
    ok = decode.BatchResult(3, [3], tokens, tokens.copy(), *decode.compare(logits, logits, tokens, tokens, "float32"),
                            tokens_per_s=1.0, ms_per_step=1.0)
    assert ok.ok and ok.logits_err == 0 and ok.min_margin > 0 and ok.mismatch == ""
    flipped = tokens.copy()
    flipped[1, 2] += 1
    flipped[2, 3] += 1
    *_, mismatch = decode.compare(logits, logits, flipped, tokens, "float32")
    assert mismatch.startswith(f"sequence 1, token 2: {flipped[1, 2]} vs dense {tokens[1, 2]}"), mismatch
    assert not dataclasses.replace(ok, tokens=flipped).ok
    atol, rtol = decode.TOLERANCES["float32"]
    off = logits.copy()
    off[2, 1, 5] += 2 * (atol + rtol * abs(off[2, 1, 5]))
    err, bound, _, _ = decode.compare(off, logits, tokens, tokens, "float32")
    assert bound > 1 and not dataclasses.replace(ok, logits_err=err, logits_bound=bound).ok


@pytest.mark.parametrize("argv, message", [(["--batch", "33"], "more than world * max_tokens"),
                                           (["--experts", "12"], "multiple of the size of mesh axis")])
def test_bad_configuration_is_a_clear_error(argv, message, capsys) -> None:
    assert decode.main(argv) == 2
    assert message in capsys.readouterr().err


def test_dense_moe_rounds_like_the_layer() -> None:
    """float32 and bfloat16 dense layers differ (the bfloat16 one rounds), and the bfloat16 output is bfloat16."""
    args = decode.parse_args([])
    moe = decode.init_model(args)["blocks"][0]["moe"]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((4, args.hidden)), jnp.float32)
    y32 = jax.jit(decode.dense_moe, static_argnums=(2, 3, 4))(moe, x, 2, jnp.float32, jnp.float32)
    y16 = jax.jit(decode.dense_moe, static_argnums=(2, 3, 4))(moe, x, 2, jnp.bfloat16, jnp.bfloat16)
    assert y16.dtype == jnp.bfloat16 and y32.dtype == jnp.float32
    assert 0 < float(jnp.max(jnp.abs(y16.astype(jnp.float32) - y32))) < 0.1
