"""``python -m jax_moe_comm.examples.train``: a short CPU run learns, and backends without autodiff fail clearly.

The example forces its own 8 host devices when started without the launcher, so the subprocess gets an environment
without conftest's XLA_FLAGS and without any outer launcher's JAX_* wiring.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from conftest import CHILD_CWD, ep_mesh, standalone_cpu_env

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120
STEPS = 30




def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "jax_moe_comm.examples.train", *args], env=standalone_cpu_env(),
                          cwd=CHILD_CWD, capture_output=True, text=True, timeout=TIMEOUT_S)


def test_training_on_8_cpu_devices_lowers_the_loss(tmp_path: Path) -> None:
    pytest.importorskip("optax")
    pytest.importorskip("tqdm")
    log = tmp_path / "losses.json"
    r = _run("--steps", str(STEPS), "--log-json", str(log), "--log-every", "10")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "PASS" in r.stdout and "backend reference" in r.stdout and "world 8" in r.stdout, r.stdout
    assert "train:" in r.stderr  # the tqdm bar goes to stderr

    record = json.loads(log.read_text())
    assert record["backend"] == "reference" and record["world"] == 8 and record["passed"]
    assert len(record["train_loss"]) == STEPS
    assert [e["step"] for e in record["eval_loss"]] == [0, 10, 20, 30]
    initial, final = record["initial_loss"], record["final_loss"]
    assert final < 0.5 * initial, record["eval_loss"]
    train = record["train_loss"]
    assert sum(train[-5:]) / 5 < sum(train[:5]) / 5, train


def test_nvshmem_backend_unavailable_is_a_clear_error() -> None:
    r = _run("--steps", "1", "--backend", "nvshmem")
    assert r.returncode == 2, r.stdout + r.stderr
    # Either NVSHMEM is not up (extension built) or the extension is missing (CPU-only install): both name it.
    assert "jax_moe_comm.examples.train: error:" in r.stderr and "nvshmem" in r.stderr.lower(), r.stderr
    assert "Traceback" not in r.stderr, r.stderr


def test_autodiff_error_of_a_custom_call_is_explained() -> None:
    """What JAX raises when the train step differentiates an FFI custom call (as the NVSHMEM backend's phases
    are) becomes a message that names the backend and the way out."""
    pytest.importorskip("optax")
    from jax_moe_comm.examples import train

    trainer = train.Trainer(train.parse_args([]), ep_mesh(8), student=None, teacher=None)

    def step_through_ffi(params, opt_state, teacher_params, step):
        call = jax.ffi.ffi_call("jmc_not_registered", jax.ShapeDtypeStruct((), jnp.float32), has_side_effect=True)
        return jax.grad(lambda v: call(v))(step.astype(jnp.float32))

    trainer.train_step = jax.jit(step_through_ffi)
    with pytest.raises(train.AutodiffUnsupportedError,
                       match=r"gradients through the NVSHMEM backend are not available.*--backend reference"):
        trainer.compile_step({}, {}, {}, backend="nvshmem")
    with pytest.raises(ValueError, match="cannot be differentiated"):  # other backends: JAX's own error
        trainer.compile_step({}, {}, {}, backend="reference")
