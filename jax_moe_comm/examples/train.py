"""Train a small expert-parallel MoE model to fit a fixed random teacher of the same architecture.

    python -m jax_moe_comm.examples.train                          # CPU: 8 virtual devices, reference backend
    python -m jax_moe_comm.examples.train --steps 200 --dtype bfloat16 --log-json losses.json
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.train --backend nvshmem     # GPUs

The model (student and teacher alike) is ``--blocks`` residual blocks, each ``x -> x + MoE(RMSNorm(x))`` where MoE
is ``jax_moe_comm.layers.moe_layer``: router -> dispatch -> SwiGLU experts (ragged_dot) -> combine, the experts
sharded over the mesh axis "ep" (one rank per device). The teacher is drawn from another seed and kept fixed. Each
step draws fresh Gaussian inputs x [world * tokens, hidden] (sharded over "ep"), and one jitted Adam step lowers
mean((student(x) - teacher(x))**2). A fixed held-out batch measures the loss every ``--log-every`` steps; the run
exits with status 1 unless the final held-out loss is below half the initial one.

Every block of a model runs on that model's one MoEComm: the student's blocks on one, the teacher's on another.
Within a model the round trips are ordered by data (block i + 1 dispatches block i's output, and the backward pass
runs back through the blocks); the two models are computed side by side with nothing ordering one's round trips
against the other's, so they cannot share one. Gradients flow through dispatch and combine with plain JAX AD on
the reference backend and with the custom VJP of jax_moe_comm.autodiff on the NVSHMEM backend (its default there):
the backward pass is one more round trip per block, on the student's MoEComm. Compare the two backends' losses
with ``--log-json`` on each.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm import nvshmem_backend, runtime
from jax_moe_comm._cli import prepare_process
from jax_moe_comm.launch import initialize_distributed
from jax_moe_comm.layers import init_moe_params, moe_layer, param_specs

AXIS = "ep"
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
NVSHMEM_DEFAULT_HEAP = 1 << 30  # NVSHMEM's own default NVSHMEM_SYMMETRIC_SIZE
SUCCESS_RATIO = 0.5  # the final held-out loss must be below this fraction of the initial one
NO_AUTODIFF = ("gradients through the NVSHMEM backend are not available for this configuration (see "
               "jax_moe_comm.autodiff for the limits); use --backend reference to train")


class AutodiffUnsupportedError(RuntimeError):
    """Raised when the train step cannot be differentiated on the chosen backend."""


# ----------------------------------------------------------------------------------------------------------------
# The model: blocks of x -> x + MoE(RMSNorm(x))
# ----------------------------------------------------------------------------------------------------------------


def init_model(key: Array, args: argparse.Namespace) -> dict:
    """{"blocks": [{"norm": float32 [H], "moe": init_moe_params(...)}, ...]}: float32 master weights."""
    keys = jax.random.split(key, args.blocks)
    return {"blocks": [{"norm": jnp.ones((args.hidden,), jnp.float32),
                        "moe": init_moe_params(k, hidden=args.hidden, ffn=args.ffn, num_experts=args.experts,
                                               shared_ffn=args.shared_ffn)}
                       for k in keys]}


def model_specs(params: dict) -> dict:
    """PartitionSpecs: expert weights sharded over AXIS on dim 0, everything else replicated."""
    return {"blocks": [{"norm": P(), "moe": param_specs(block["moe"], AXIS)} for block in params["blocks"]]}


def rms_norm(x: Array, scale: Array, eps: float = 1e-6) -> Array:
    """x [N, H] float32 -> x / rms(x) * scale."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * scale


def forward(comm: jax_moe_comm.MoEComm, params: dict, x: Array) -> Array:
    """x [world * T, H] float32, sharded over AXIS -> float32 [world * T, H]. Every block on the model's MoEComm."""
    for block in params["blocks"]:
        x = x + moe_layer(comm, block["moe"], rms_norm(x, block["norm"])).astype(jnp.float32)
    return x


def mse(a: Array, b: Array) -> Array:
    return jnp.mean(jnp.square(a - b))


# ----------------------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.examples.train",
                                description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=50, help="Adam steps (default 50)")
    p.add_argument("--backend", choices=jax_moe_comm.comm.BACKENDS, default="auto",
                   help="auto: nvshmem when available (which cannot train yet), else reference (default auto)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="payload / expert compute dtype; weights stay float32 (default float32)")
    p.add_argument("--log-json", metavar="PATH", default=None, help="write the losses to PATH as JSON")
    p.add_argument("--log-every", type=int, default=10, help="held-out loss every N steps (default 10)")
    p.add_argument("--lr", type=float, default=2e-2, help="Adam learning rate (default 2e-2)")
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank and step, T (default 64)")
    p.add_argument("--hidden", type=int, default=16, help="hidden size, H (default 16)")
    p.add_argument("--ffn", type=int, default=32, help="SwiGLU width of each expert, F (default 32)")
    p.add_argument("--shared-ffn", type=int, default=None, help="width of a shared expert (default: none)")
    p.add_argument("--experts", type=int, default=16, help="experts, E; a multiple of the world (default 16)")
    p.add_argument("--topk", type=int, default=2, help="experts per token, K (default 2)")
    p.add_argument("--blocks", type=int, default=2, help="residual MoE blocks (default 2)")
    p.add_argument("--seed", type=int, default=0, help="student seed; the teacher uses seed + 1 (default 0)")
    args = p.parse_args(argv)
    for name in ("steps", "log_every", "tokens", "hidden", "ffn", "experts", "topk", "blocks"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def start_runtime(backend: str, cfg: jax_moe_comm.MoECommConfig, num_comms: int) -> None:
    """Joins the launcher's job (if any) and, where the NVSHMEM backend may be used, initializes NVSHMEM."""
    initialize_distributed()  # (0, 1) and nothing to do without the launcher
    one_gpu = [d.platform for d in jax.local_devices()] == ["gpu"]
    if backend == "nvshmem" or (backend == "auto" and one_gpu and jax_moe_comm.build_info()["cuda"]):
        # Before NVSHMEM starts the job's NVLink reach is unknown: size for the staging buffers too.
        need = num_comms * nvshmem_backend.symmetric_bytes(cfg, len(jax.devices()), staging=True)
        runtime.initialize(symmetric_size=max(NVSHMEM_DEFAULT_HEAP, 2 * need))  # clear error without the extension


def _is_autodiff_error(exc: BaseException) -> bool:
    text = str(exc)
    return "cannot be differentiated" in text or "Differentiation rule" in text or "not differentiable" in text


class Trainer:
    """The jitted functions of one run: init, train step, held-out loss."""

    def __init__(self, args: argparse.Namespace, mesh: Mesh, student: jax_moe_comm.MoEComm | None,
                 teacher: jax_moe_comm.MoEComm | None) -> None:
        """student, teacher: each model's MoEComm (None for a Trainer whose steps never run that model)."""
        import optax  # imported here so that `--help` works without it

        self.args, self.mesh = args, mesh
        self.opt = optax.adam(args.lr)
        self.rows = len(mesh.devices.flat) * args.tokens
        self.x_sharding = NamedSharding(mesh, P(AXIS))
        abstract = jax.eval_shape(lambda: init_model(jax.random.key(0), args))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), model_specs(abstract),
                                 is_leaf=lambda leaf: isinstance(leaf, P))
        # Built inside jit with out_shardings: works the same with one process or several (no device_put).
        self.init = jax.jit(lambda seed: init_model(jax.random.key(seed), args), static_argnums=0,
                            out_shardings=shardings)
        self.init_opt = jax.jit(self.opt.init)

        def batch(seed: int, step: Array) -> Array:
            key = jax.random.fold_in(jax.random.key(seed), step)
            x = jax.random.normal(key, (self.rows, args.hidden), jnp.float32)
            return jax.lax.with_sharding_constraint(x, self.x_sharding)

        def loss_fn(params, teacher_params, x):
            return mse(forward(student, params, x), jax.lax.stop_gradient(forward(teacher, teacher_params, x)))

        def train_step(params, opt_state, teacher_params, step):
            x = batch(args.seed + 1000, step)
            loss, grads = jax.value_and_grad(loss_fn)(params, teacher_params, x)
            updates, opt_state = self.opt.update(grads, opt_state, params)
            return optax.apply_updates(params, updates), opt_state, loss

        def eval_loss(params, teacher_params):
            return loss_fn(params, teacher_params, batch(args.seed + 999, jnp.int32(0)))  # fixed held-out batch

        self.train_step = jax.jit(train_step, donate_argnums=(0, 1))
        self.eval_loss = jax.jit(eval_loss)

    def compile_step(self, params, opt_state, teacher_params, backend: str):
        """The compiled train step; AutodiffUnsupportedError when the backend's custom calls have no gradient."""
        try:
            return self.train_step.lower(params, opt_state, teacher_params, jnp.int32(0)).compile()
        except Exception as exc:
            if backend == "nvshmem" and (_is_autodiff_error(exc) or isinstance(exc, NotImplementedError)):
                raise AutodiffUnsupportedError(f"{NO_AUTODIFF}. (JAX said: {type(exc).__name__}: {exc})") from exc
            raise


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()
    args = parse_args(argv)
    from tqdm.auto import tqdm

    start = time.perf_counter()
    dtype = DTYPES[args.dtype]
    cfg = jax_moe_comm.MoECommConfig(num_experts=args.experts, experts_per_token=args.topk, hidden=args.hidden,
                                     max_tokens=args.tokens, dtype=dtype, out_dtype=dtype)
    try:
        start_runtime(args.backend, cfg, num_comms=2)
        mesh = Mesh(np.array(jax.devices()), (AXIS,))
        # One MoEComm per model: a MoEComm carries one round trip at a time. A model's own blocks are ordered by
        # data, but nothing orders the student's round trips against the teacher's.
        student = jax_moe_comm.MoEComm(cfg, mesh, AXIS, backend=args.backend)
        teacher = jax_moe_comm.MoEComm(cfg, mesh, AXIS, backend=args.backend)
    except (RuntimeError, ValueError) as exc:  # e.g. backend="nvshmem" without GPUs / extension, E % world != 0
        print(f"jax_moe_comm.examples.train: error: {exc}", file=sys.stderr)
        return 2
    backend, world, leader = student.backend, student.world, jax.process_index() == 0

    def say(message: str) -> None:
        if leader:
            tqdm.write(message, file=sys.stdout)
            sys.stdout.flush()

    say(f"jax_moe_comm train: {args.blocks} blocks x -> x + MoE(RMSNorm(x)), fitting a fixed random teacher")
    say(f"  backend {backend} ({mesh.devices.flat[0].platform}, {jax.process_count()} process(es)), world {world}, "
        f"{args.experts} experts (top-{args.topk}), hidden {args.hidden}, ffn {args.ffn}, {args.dtype}, "
        f"{world * args.tokens} tokens/step, Adam lr {args.lr}")

    trainer = Trainer(args, mesh, student, teacher)
    params, teacher_params = trainer.init(args.seed), trainer.init(args.seed + 1)
    opt_state = trainer.init_opt(params)
    try:
        step_fn = trainer.compile_step(params, opt_state, teacher_params, backend)
    except AutodiffUnsupportedError as exc:
        print(f"jax_moe_comm.examples.train: error: {exc}", file=sys.stderr)
        for comm in (student, teacher):
            comm.close()
        return 2

    initial = float(trainer.eval_loss(params, teacher_params))
    say(f"step {0:5d}  held-out loss {initial:.5f}")
    losses: list[float] = []
    evals: list[tuple[int, float]] = [(0, initial)]
    bar = tqdm(range(1, args.steps + 1), desc="train", file=sys.stderr, disable=not leader, dynamic_ncols=True)
    for step in bar:
        params, opt_state, loss = step_fn(params, opt_state, teacher_params, jnp.int32(step))
        losses.append(float(loss))
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if step % args.log_every == 0 or step == args.steps:
            evals.append((step, float(trainer.eval_loss(params, teacher_params))))
            say(f"step {step:5d}  train loss {losses[-1]:.5f}  held-out loss {evals[-1][1]:.5f}")
    bar.close()

    final = evals[-1][1]
    ok = final < SUCCESS_RATIO * initial
    seconds = time.perf_counter() - start
    say(f"held-out loss {initial:.5f} -> {final:.5f} ({final / initial:.1%} of initial; needs < "
        f"{SUCCESS_RATIO:.0%})  {'PASS' if ok else 'FAIL'}  ({seconds:.1f} s)")
    if leader and args.log_json:
        record = {"backend": backend, "dtype": args.dtype, "world": world, "steps": args.steps,
                  "train_loss": losses, "eval_loss": [{"step": s, "loss": v} for s, v in evals],
                  "initial_loss": initial, "final_loss": final, "passed": ok, "seconds": seconds,
                  "config": {k: v for k, v in vars(args).items() if k != "log_json"}}
        with open(args.log_json, "w") as f:
            json.dump(record, f, indent=1)
    for comm in (student, teacher):
        comm.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
