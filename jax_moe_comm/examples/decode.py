"""Greedy decoding with a small expert-parallel MoE language model, one jitted step for every batch size.

    python -m jax_moe_comm.examples.decode                          # CPU: 8 virtual devices, reference backend
    python -m jax_moe_comm.examples.decode --batch 32 5 --steps 16 --dtype bfloat16
    python -m jax_moe_comm.launch -n 2 -- -m jax_moe_comm.examples.decode     # GPUs: NVSHMEM, one process per GPU

The model: token embedding, ``--layers`` blocks of ``x + Attn(RMSNorm(x))`` (causal, ``--heads`` heads, rotary
positions, a KV cache) then ``x + MoE(RMSNorm(x))``, a final RMSNorm and a projection to the vocabulary. The MoE is
``jax_moe_comm.layers.moe_layer_shard`` (router -> dispatch -> SwiGLU experts -> combine) with its experts sharded
over the mesh axis "ep", every layer on one MoEComm (layer i + 1 dispatches what layer i's combine returned, so the
round trips follow each other). The whole decode step runs per rank inside one ``shard_map``: each rank attends
over its own sequences and its own KV cache; only the MoE layers exchange rows.

What it shows:

- **One compilation for every batch size.** Each rank holds ``--max-tokens`` sequence slots (the MoEComm's
  ``cfg.max_tokens``); a batch of B sequences is spread over the ranks (rank r decodes B // world of them, one more
  if r < B % world) and padded to that shape, and each rank's count goes to the MoE layer as the traced
  ``num_tokens``. The step is traced and compiled once, then serves every ``--batch`` (and every position: the
  position is traced too). The run counts the step's traces and XLA compilations and requires one.
- **Prefill then greedy decode.** The prompt (``--prompt`` random tokens per sequence) goes through the same step one
  token at a time, filling the KV cache; then ``--steps`` greedy steps each feed the previous argmax back. Tokens/s
  counts the live sequences of the decode steps only, after the prefill has compiled and warmed up the step.
- **The same tokens as a dense model.** The same weights on one device without jax_moe_comm (every token through
  every expert, weighted by its routing weights; zero for the experts it did not pick) read the same prompts, then
  the tokens the EP model generated. Its argmax must be the EP model's token at every step (so its own greedy
  decode generates the same ids) and its logits close at every step (see TOLERANCES); the run prints PASS or FAIL
  and exits 1 on a mismatch (2 on a bad configuration).

Where a token's router scores (its K-th and K+1-th expert) or its top two logits are tied within rounding, the two
models may break the tie differently. In float32 the models differ by ~1e-6, so that is rare. In bfloat16 it is
not at scale: at the defaults every token matches, but on an H200 with hidden 1024, 64 experts (top-8) and a
vocabulary of 4096, up to 14 of 4160 tokens differed (the first ones at dense top-2 gaps of 4e-5 to 2e-3) and the
logits by up to 0.28, past the tolerance. On a mismatch the run names the first token that differs and the dense
model's top-2 gap there.

On GPUs, under the launcher, backend "auto" is NVSHMEM and the world is the number of processes (one GPU each).
Attention, norms and logits are float32; ``--dtype`` is the MoE layers' payload and expert compute dtype.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import jax_moe_comm
from jax_moe_comm._cli import prepare_process
from jax_moe_comm.examples.train import AXIS, DTYPES, rms_norm, start_runtime
from jax_moe_comm.launch import host_gather
from jax_moe_comm.layers import moe_layer_shard, param_specs

BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"  # jax.monitoring's event: one XLA compilation
HI = jax.lax.Precision.HIGHEST  # full float32 matmuls everywhere (no TF32 on GPU): the comparison stays tight
# Logits must agree within ATOL + RTOL * |dense logit|, at every step (the dense model reads the same history).
# float32: both models run the same float32 ops; only the summation order inside the MoE differs (ragged_dot per
# expert and K weighted rows vs einsum over all E experts), about 1e-7 relative per op: seen up to 3e-6 on CPU and
# on an H200, so 1e-4 leaves ample room. bfloat16: both models round the experts' inputs, hidden activations and
# outputs to bfloat16, but each platform's XLA may round intermediates of its own (2**-8 relative a step), and
# the difference travels through the later layers: seen 0 on CPU and up to 1.4e-2 on an H200 at the defaults.
TOLERANCES = {"float32": (1e-4, 1e-4), "bfloat16": (5e-2, 2e-2)}

MoEFn = Callable[[int, dict, Array], Array]  # (layer index, MoE params, x [T, H] float32) -> y [T, H]


# ----------------------------------------------------------------------------------------------------------------
# The model, shared by the expert-parallel and the dense decoder (they differ only in the MoE function)
# ----------------------------------------------------------------------------------------------------------------


def init_model(args: argparse.Namespace) -> dict:
    """Float32 weights as NumPy arrays, the same on every process: {"embed" [V, H], "blocks": [{"attn_norm",
    "attn": {wq, wk, wv, wo}, "moe_norm", "moe"}], "norm" [H], "unembed" [H, V]}. "moe" is the pytree of
    ``layers.init_moe_params`` (router [H, E], gate / up [E, H, F], down [E, F, H]). Matrices N(0, 1 / fan_in),
    the embedding N(0, 1). Drawn on the host: jitting random initializers costs seconds of CPU compile time."""
    H, V, E, F = args.hidden, args.vocab, args.experts, args.ffn
    rng = np.random.default_rng([args.seed, 0])

    def normal(shape: tuple[int, ...], fan_in: int) -> np.ndarray:
        return (rng.standard_normal(shape) / np.sqrt(fan_in)).astype(np.float32)

    def block() -> dict:
        return {"attn_norm": np.ones(H, np.float32), "attn": {w: normal((H, H), H) for w in ("wq", "wk", "wv", "wo")},
                "moe_norm": np.ones(H, np.float32),
                "moe": {"router": normal((H, E), H), "gate": normal((E, H, F), H), "up": normal((E, H, F), H),
                        "down": normal((E, F, H), F)}}

    return {"embed": normal((V, H), 1), "blocks": [block() for _ in range(args.layers)],
            "norm": np.ones(H, np.float32), "unembed": normal((H, V), H)}


def model_specs(params: dict) -> dict:
    """PartitionSpecs: the experts' weights sharded over AXIS on dim 0, everything else replicated."""
    specs = jax.tree.map(lambda _: P(), params)
    for block, spec in zip(params["blocks"], specs["blocks"], strict=True):
        spec["moe"] = param_specs(block["moe"], AXIS)
    return specs


def init_cache(rows: int, args: argparse.Namespace) -> list[dict]:
    """Per layer {"k", "v"}: float32 [rows, prompt + steps, heads, head_dim], zeros."""
    shape = (rows, args.prompt + args.steps, args.heads, args.hidden // args.heads)
    return [{"k": jnp.zeros(shape, jnp.float32), "v": jnp.zeros(shape, jnp.float32)} for _ in range(args.layers)]


def rope(x: Array, pos: Array) -> Array:
    """Rotary position embedding of x [T, heads, head_dim] at position pos (every row is at the same one)."""
    half = x.shape[-1] // 2
    angle = pos.astype(jnp.float32) / 10000.0 ** (jnp.arange(half, dtype=jnp.float32) / half)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def attention(w: dict, h: Array, cache: dict, pos: Array) -> tuple[Array, dict]:
    """Causal self-attention of one new token per row: h [T, H] at position pos; writes its K and V into the cache
    at pos and attends over positions 0..pos. Rows are independent (each is one sequence)."""
    T, H = h.shape
    heads, head_dim = cache["k"].shape[2:]
    q, k, v = (jnp.dot(h, w[name], precision=HI).reshape(T, heads, head_dim) for name in ("wq", "wk", "wv"))
    q, k = rope(q, pos), rope(k, pos)
    keys = jax.lax.dynamic_update_slice_in_dim(cache["k"], k[:, None], pos, axis=1)
    values = jax.lax.dynamic_update_slice_in_dim(cache["v"], v[:, None], pos, axis=1)
    scores = jnp.einsum("tnd,tsnd->tns", q, keys, precision=HI) / np.sqrt(head_dim)
    scores = jnp.where(jnp.arange(keys.shape[1]) <= pos, scores, -jnp.inf)  # the cache past pos is not written yet
    out = jnp.einsum("tns,tsnd->tnd", jax.nn.softmax(scores, axis=-1), values, precision=HI)
    return jnp.dot(out.reshape(T, H), w["wo"], precision=HI), {"k": keys, "v": values}


def decoder_step(params: dict, caches: list[dict], tokens: Array, pos: Array,
                 moe: MoEFn) -> tuple[Array, Array, list[dict]]:
    """One token per row: tokens int32 [T] at position pos -> (logits float32 [T, V], argmax int32 [T], caches)."""
    x = params["embed"][tokens]
    new_caches = []
    for i, (block, cache) in enumerate(zip(params["blocks"], caches, strict=True)):
        a, cache = attention(block["attn"], rms_norm(x, block["attn_norm"]), cache, pos)
        x = x + a
        x = x + moe(i, block["moe"], rms_norm(x, block["moe_norm"])).astype(jnp.float32)
        new_caches.append(cache)
    logits = jnp.dot(rms_norm(x, params["norm"]), params["unembed"], precision=HI)
    return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), new_caches


def dense_moe(params: dict, x: Array, k: int, dtype, out_dtype) -> Array:
    """The MoE layer without jax_moe_comm: x [T, H] float32 through all E experts, weighted by a [T, E] matrix of
    the renormalized top-k router probabilities (zero for the experts not picked). Rounds to ``dtype`` and
    ``out_dtype`` where the layer does, so bfloat16 runs stay comparable."""
    probs = jax.nn.softmax(jnp.dot(x, params["router"], precision=HI), axis=-1)
    top, ids = jax.lax.top_k(probs, k)
    gates = jnp.zeros_like(probs).at[jnp.arange(x.shape[0])[:, None], ids].set(top / top.sum(-1, keepdims=True))
    # Operands rounded to dtype, then multiplied in float32: the products of two bfloat16 numbers are exact in
    # float32, so this is a bfloat16 matmul with float32 accumulation (which not every XLA CPU dot supports).
    rounded = lambda a: a.astype(dtype).astype(jnp.float32)  # noqa: E731
    xc = rounded(x)
    g = jnp.einsum("th,ehf->tef", xc, rounded(params["gate"]), precision=HI)
    u = jnp.einsum("th,ehf->tef", xc, rounded(params["up"]), precision=HI)
    h = rounded(jax.nn.silu(g) * u)
    out = jnp.einsum("tef,efh->teh", h, rounded(params["down"]), precision=HI).astype(out_dtype)
    return jnp.einsum("te,teh->th", gates, out.astype(jnp.float32), precision=HI).astype(out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# The two decoders
# ----------------------------------------------------------------------------------------------------------------


class EPDecoder:
    """The expert-parallel model: one jitted shard_map step over the mesh, ``max_tokens`` rows per rank."""

    def __init__(self, comm: jax_moe_comm.MoEComm, mesh: Mesh, args: argparse.Namespace, weights: dict) -> None:
        self.mesh, self.max_tokens = mesh, comm.cfg.max_tokens
        self.rows = comm.world * self.max_tokens
        self.traces = self.compiles = 0  # of the decode step; see step()
        self._stepping = False
        specs = model_specs(weights)
        # Host weights (the same on every process) as global arrays: each device takes its part of the experts.
        self.params = jax.tree.map(lambda a, s: jax.make_array_from_callback(
            a.shape, NamedSharding(mesh, s), lambda index: a[index]), weights, specs,
            is_leaf=lambda leaf: isinstance(leaf, P))
        cache_specs = [{"k": P(AXIS), "v": P(AXIS)} for _ in range(args.layers)]
        self.row_sharding = NamedSharding(mesh, P(AXIS))
        shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs,
                                 is_leaf=lambda leaf: isinstance(leaf, P))
        # Built inside jit with out_shardings: the same with one process or several (no device_put).
        self.init_cache = jax.jit(lambda: init_cache(self.rows, args), out_shardings=shardings)

        def shard_step(params, caches, tokens, pos, num_tokens):
            self.traces += 1  # Python runs this body only when jit traces the step
            n = num_tokens.reshape(())  # this rank's live sequences: a traced int32, not a shape

            def moe(i: int, p: dict, x: Array) -> Array:  # every layer's round trip on the one MoEComm
                return moe_layer_shard(comm, p, x, n)  # rows >= n are padding; they come back zero

            return decoder_step(params, caches, tokens, pos, moe)

        step = jax.shard_map(shard_step, mesh=mesh, in_specs=(specs, cache_specs, P(AXIS), P(), P(AXIS)),
                             out_specs=(P(AXIS), P(AXIS), cache_specs))
        self._step = jax.jit(step, donate_argnums=1)  # the KV cache is updated in place
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _on_event(self, event: str, duration: float, **kwargs) -> None:
        if event == BACKEND_COMPILE and self._stepping:
            self.compiles += 1

    def step(self, params: dict, caches: list[dict], tokens: Array, pos: np.int32,
             num_tokens: Array) -> tuple[Array, Array, list[dict]]:
        """The jitted step; counts the XLA compilations it triggers (a compile can happen without a new trace,
        e.g. for arguments placed differently, so the trace count alone could miss one)."""
        self._stepping = True
        try:
            return self._step(params, caches, tokens, pos, num_tokens)
        finally:
            self._stepping = False

    def close(self) -> None:
        jax.monitoring.unregister_event_duration_listener(self._on_event)

    def global_rows(self, host: np.ndarray) -> Array:
        """A host array [rows, ...] (the same on every process) as a global array sharded over AXIS."""
        return jax.make_array_from_callback(host.shape, self.row_sharding, lambda index: host[index])

    def compilations(self) -> int:
        """How often the step was compiled: XLA compilations during its calls, or traces if more."""
        return max(self.traces, self.compiles)


class DenseDecoder:
    """The reference: the same model and weights on one local device, no jax_moe_comm, B rows (no padding)."""

    def __init__(self, args: argparse.Namespace, weights: dict) -> None:
        device = jax.local_devices()[0]
        dtype, k = DTYPES[args.dtype], args.top_k
        # Everything committed to one device, so that prompt tokens and fed-back tokens share one executable.
        self.put = lambda host: jax.device_put(host, device)
        self.params = self.put(weights)
        self.init_cache = lambda rows: self.put(init_cache(rows, args))
        self.step = jax.jit(lambda params, caches, tokens, pos: decoder_step(
            params, caches, tokens, pos, lambda i, p, x: dense_moe(p, x, k, dtype, dtype)), donate_argnums=1)


# ----------------------------------------------------------------------------------------------------------------
# Decoding and checking
# ----------------------------------------------------------------------------------------------------------------


@dataclasses.dataclass
class BatchResult:
    """One batch size's run: tokens [B, steps + 1] of both models, the logits' agreement, the decode speed."""

    batch: int
    num_tokens: list[int]
    tokens: np.ndarray
    dense_tokens: np.ndarray
    logits_err: float  # max |ep - dense| over every step, live row and vocab entry
    logits_bound: float  # max of (|ep - dense| / (atol + rtol |dense|)); <= 1 passes
    min_margin: float  # the dense model's smallest top-1 - top-2 logit gap over the greedy tokens
    mismatch: str  # the first token that differs, or ""
    tokens_per_s: float
    ms_per_step: float

    @property
    def tokens_match(self) -> bool:
        return self.tokens.shape == self.dense_tokens.shape and bool(np.array_equal(self.tokens, self.dense_tokens))

    @property
    def ok(self) -> bool:
        return self.tokens_match and self.logits_bound <= 1.0


def placement(batch: int, world: int, max_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """(global row of each of the batch's sequences [B], num_tokens per rank [world]): sequence i is slot
    i // world of rank i % world, so every rank gets B // world sequences or one more."""
    seq = np.arange(batch)
    num_tokens = np.bincount(seq % world, minlength=world).astype(np.int32)
    assert num_tokens.max() <= max_tokens
    return ((seq % world) * max_tokens + seq // world).astype(np.int32), num_tokens


def compare(ep_logits: np.ndarray, dense_logits: np.ndarray, tokens: np.ndarray, dense_tokens: np.ndarray,
            dtype: str) -> tuple[float, float, float, str]:
    """Logits [steps, B, V]; tokens [B, n], the argmax of the last n steps. Returns (max |ep - dense|, max of
    |ep - dense| / (atol + rtol |dense|), the dense model's smallest top-1 - top-2 gap at those n steps, and the
    first token that differs, described, or "")."""
    atol, rtol = TOLERANCES[dtype]
    diff = np.abs(ep_logits - dense_logits)
    last = dense_logits[-tokens.shape[1]:]  # [n, B, V]
    top2 = np.sort(last, axis=-1)[..., -2:]
    gap = top2[..., 1] - top2[..., 0]  # [n, B]
    mismatch = ""
    if tokens.shape != dense_tokens.shape:
        mismatch = f"token arrays of shapes {tokens.shape} and {dense_tokens.shape}"
    elif (tokens != dense_tokens).any():
        where = np.argwhere(tokens != dense_tokens)  # [m, 2]: (sequence, token)
        b, t = map(int, where[np.argmin(where[:, 1])])  # the earliest token that differs
        # A gap below the logits' tolerance is a tie at rounding level: the two models may break it either way.
        mismatch = (f"sequence {b}, token {t}: {tokens[b, t]} vs dense {dense_tokens[b, t]}, dense top-2 gap there "
                    f"{gap[t, b]:.1e}")
    return float(diff.max()), float((diff / (atol + rtol * np.abs(dense_logits))).max()), float(gap.min()), mismatch


def gather(arrays: Sequence[Array]) -> np.ndarray:
    """Global arrays sharded over AXIS (parts of them on other processes) -> one host array [len(arrays), ...]."""
    return np.stack(host_gather(list(arrays)))


def decode_batch(ep: EPDecoder, dense: DenseDecoder, prompts: np.ndarray, args: argparse.Namespace) -> BatchResult:
    """Prefill ``prompts`` [B, prompt] one token per step, then ``args.steps`` greedy steps, on both decoders."""
    batch = prompts.shape[0]
    world = ep.rows // ep.max_tokens
    rows, num_tokens = placement(batch, world, ep.max_tokens)
    padded = np.zeros((ep.rows, args.prompt), np.int32)  # padding rows decode token 0; their MoE rows are ignored
    padded[rows] = prompts
    columns = [ep.global_rows(np.ascontiguousarray(padded[:, p])) for p in range(args.prompt)]
    n = ep.global_rows(num_tokens)

    caches, logits = ep.init_cache(), []
    for p in range(args.prompt):  # prefill: the prompt's tokens, teacher-forced; the last gives the first token
        out, nxt, caches = ep.step(ep.params, caches, columns[p], np.int32(p), n)
        logits.append(out)
    jax.block_until_ready(nxt)
    start = time.perf_counter()
    generated = [nxt]
    for s in range(args.steps):
        out, nxt, caches = ep.step(ep.params, caches, nxt, np.int32(args.prompt + s), n)
        logits.append(out)
        generated.append(nxt)
    jax.block_until_ready(nxt)
    seconds = time.perf_counter() - start

    ep_logits, ep_tokens = gather(logits)[:, rows], gather(generated)[:, rows].T  # live rows only

    # The dense model reads the same inputs as the EP model: the prompt, then the EP model's own tokens. Its
    # argmax must be the EP token at every step; by induction its free-running greedy decode would then produce
    # exactly these tokens. Feeding it the same history keeps each step's logits comparable after a mismatch too.
    inputs = np.concatenate([prompts, ep_tokens[:, :-1]], axis=1)  # [B, prompt + steps]
    dcaches, dlogits, dtokens = dense.init_cache(batch), [], []
    for p in range(args.prompt + args.steps):
        out, nxt, dcaches = dense.step(dense.params, dcaches, dense.put(inputs[:, p]), np.int32(p))
        dlogits.append(out)
        dtokens.append(nxt)
    dense_logits, dense_tokens = np.stack(dlogits), np.stack(dtokens)[args.prompt - 1:].T

    err, bound, margin, mismatch = compare(ep_logits, dense_logits, ep_tokens, dense_tokens, args.dtype)
    return BatchResult(batch=batch, num_tokens=num_tokens.tolist(), tokens=ep_tokens, dense_tokens=dense_tokens,
                       logits_err=err, logits_bound=bound, min_margin=margin, mismatch=mismatch,
                       tokens_per_s=batch * args.steps / seconds, ms_per_step=1e3 * seconds / args.steps)


# ----------------------------------------------------------------------------------------------------------------
# Command line
# ----------------------------------------------------------------------------------------------------------------


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jax_moe_comm.examples.decode", description=__doc__.split("\n")[0])
    p.add_argument("--batch", type=int, nargs="+", default=None, metavar="B",
                   help="sequences decoded at once over all ranks, one run per value, each <= world * max_tokens "
                        "(default: world * max_tokens, then world // 2 + 1)")
    p.add_argument("--max-tokens", type=int, default=4, help="sequence slots per rank: the MoEComm's max_tokens "
                                                             "(default 4)")
    p.add_argument("--prompt", type=int, default=4, help="prompt tokens per sequence, random (default 4)")
    p.add_argument("--steps", type=int, default=8, help="greedy decode steps after the prompt (default 8)")
    p.add_argument("--backend", choices=jax_moe_comm.comm.BACKENDS, default="auto",
                   help="auto: nvshmem when available, else reference (default auto)")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32",
                   help="MoE payload / expert compute dtype; weights, attention and logits stay float32 "
                        "(default float32)")
    p.add_argument("--layers", type=int, default=2, help="transformer blocks (default 2)")
    p.add_argument("--hidden", type=int, default=32, help="hidden size, H (default 32)")
    p.add_argument("--heads", type=int, default=2, help="attention heads; H / heads must be even (default 2)")
    p.add_argument("--ffn", type=int, default=64, help="SwiGLU width of each expert, F (default 64)")
    p.add_argument("--experts", type=int, default=16, help="experts, E; a multiple of the world (default 16)")
    p.add_argument("--top-k", "--topk", dest="top_k", type=int, default=2, help="experts per token, K (default 2)")
    p.add_argument("--vocab", type=int, default=128, help="vocabulary size (default 128)")
    p.add_argument("--seed", type=int, default=0, help="weights and prompts (default 0)")
    args = p.parse_args(argv)
    for name in ("max_tokens", "prompt", "steps", "layers", "hidden", "heads", "ffn", "experts", "top_k", "vocab"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.hidden % args.heads or (args.hidden // args.heads) % 2:
        p.error("--hidden must be a multiple of --heads with an even head size (rotary embedding)")
    if args.batch is not None and min(args.batch) < 1:
        p.error("--batch must be >= 1")
    return args


def start(args: argparse.Namespace) -> tuple[Mesh, jax_moe_comm.MoEComm, list[int]]:
    """Joins the launcher's job (if any), builds the mesh, the model's MoEComm and the batch sizes. Raises
    RuntimeError / ValueError for what the backend or the mesh cannot take."""
    dtype = DTYPES[args.dtype]
    cfg = jax_moe_comm.MoECommConfig(num_experts=args.experts, experts_per_token=args.top_k, hidden=args.hidden,
                                     max_tokens=args.max_tokens, dtype=dtype, out_dtype=dtype)
    start_runtime(args.backend, cfg, num_comms=1)
    mesh = Mesh(np.array(jax.devices()), (AXIS,))
    world = int(mesh.shape[AXIS])
    batches = args.batch or [world * args.max_tokens, world // 2 + 1]
    if max(batches) > world * args.max_tokens:
        raise ValueError(f"--batch {max(batches)} is more than world * max_tokens = {world} * {args.max_tokens}; "
                         "raise --max-tokens")
    # One MoEComm for every layer: a MoEComm carries one round trip at a time, and each layer's dispatch takes the
    # previous layer's output, so the layers' round trips never overlap.
    return mesh, jax_moe_comm.MoEComm(cfg, mesh, AXIS, backend=args.backend), batches


def run(args: argparse.Namespace, mesh: Mesh, comm: jax_moe_comm.MoEComm, batches: Sequence[int],
        say: Callable[[str], None] = print) -> tuple[list[BatchResult], int]:
    """Decodes every batch size on both models: (one BatchResult per batch size, compilations of the EP step)."""
    say(f"jax_moe_comm decode: {args.layers} blocks of {args.heads}-head causal attention (KV cache) + MoE, "
        f"vocab {args.vocab}, greedy")
    say(f"  backend {comm.backend} ({mesh.devices.flat[0].platform}, {jax.process_count()} process(es)), "
        f"world {comm.world}, {args.experts} experts (top-{args.top_k}), hidden {args.hidden}, ffn {args.ffn}, "
        f"{args.dtype}, max_tokens {args.max_tokens} per rank, prompt {args.prompt} + {args.steps} steps")
    weights = init_model(args)
    ep, dense = EPDecoder(comm, mesh, args, weights), DenseDecoder(args, weights)
    prompts = np.random.default_rng([args.seed, 1]).integers(0, args.vocab, (max(batches), args.prompt), np.int32)
    results = []
    try:
        for batch in batches:
            r = decode_batch(ep, dense, prompts[:batch], args)
            results.append(r)
            agree = int((r.tokens == r.dense_tokens).sum()) if r.tokens.shape == r.dense_tokens.shape else 0
            say(f"batch {batch:4d} (num_tokens per rank {' '.join(map(str, r.num_tokens))}): "
                f"{r.tokens_per_s:9.1f} tokens/s ({r.ms_per_step:.2f} ms/step); tokens vs dense "
                f"{agree}/{r.dense_tokens.size} identical; logits max |diff| {r.logits_err:.1e} "
                f"({r.logits_bound:.2f} of the tolerance), smallest top-2 gap {r.min_margin:.1e}  "
                f"{'PASS' if r.ok else 'FAIL'}")
            if r.mismatch:
                say(f"  first mismatch: {r.mismatch}")
        return results, ep.compilations()
    finally:
        ep.close()


def main(argv: Sequence[str] | None = None) -> int:
    prepare_process()  # standalone on CPU: 8 virtual devices, like the other tools
    args = parse_args(argv)

    def say(message: str) -> None:  # first called once the job is up (asking earlier would start JAX too soon)
        if jax.process_index() == 0:
            print(message, flush=True)

    try:
        mesh, comm, batches = start(args)
    except (RuntimeError, ValueError) as exc:  # e.g. backend="nvshmem" without GPUs / extension, E % world != 0
        print(f"jax_moe_comm.examples.decode: error: {exc}", file=sys.stderr)
        return 2
    try:
        results, compilations = run(args, mesh, comm, batches, say)
    finally:
        comm.close()
    one_compile = compilations == 1
    say(f"decode step compiled {compilations} time(s) for batch sizes {', '.join(str(r.batch) for r in results)} "
        f"(traced num_tokens and position)  {'PASS' if one_compile else 'FAIL'}")
    first = results[0]
    say(f"sequence 0 generated {first.tokens[0].tolist()} (dense: {first.dense_tokens[0].tolist()})")
    ok = one_compile and all(r.ok for r in results)
    atol, rtol = TOLERANCES[args.dtype]
    say(f"{'PASS' if ok else 'FAIL'}: needs tokens identical to the dense single-device model, logits within "
        f"{atol:g} + {rtol:g} |logit| ({args.dtype}) and one compilation")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
