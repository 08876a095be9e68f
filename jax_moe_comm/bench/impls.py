"""The backends the bench times, behind one per-shard interface (Impl): this library's MoEComm, the XLA-collective
baselines and the floor probes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

import jax_moe_comm

from . import baselines, probes
from .configs import AXIS, BenchConfig

ALL_BACKENDS = ("nvshmem", "nvshmem_unchecked", "nvshmem_quantize", "reference", "ragged", "padded", "floor",
                "floor_flagged")
UNCHECKED = "nvshmem_unchecked"  # MoEComm(backend="nvshmem", check_errors=False): the price of the default check
QUANTIZE = "nvshmem_quantize"  # fp8 configs: bf16 tokens, quantized by the dispatch kernels (dispatch(quantize=...))
PROBES = ("floor", "floor_flagged")  # not round trips: run only when named, their results not checked


class Impl:
    """One backend for one (config, tokens): per-shard halves with a common shape."""

    name = ""
    halves = True  # whether dispatch and combine may run (and be timed) on their own
    split = False  # whether the dispatch has split halves (dispatch_send, dispatch_recv) to place compute between

    def inputs(self, x, scales):
        """The chain's (x, scales) from the config's tokens, made once outside the timed chain."""
        return x, scales

    def dispatch(self, x, scales, ids, w):
        raise NotImplementedError

    def dispatch_send(self, x, scales, ids, w):
        """Starts the dispatch (split backends only); its result goes to dispatch_recv."""
        raise NotImplementedError

    def dispatch_recv(self, pending):
        """(rows, row_scales, aux), as dispatch returns them."""
        raise NotImplementedError

    def combine(self, expert_y, aux, w):
        raise NotImplementedError

    def combine_send(self, expert_y, aux, w):
        """Starts the combine (split backends only); its result goes to combine_recv."""
        raise NotImplementedError

    def combine_recv(self, pending):
        """y, as combine returns it."""
        raise NotImplementedError

    def between(self, pending, compute, *args):
        """(compute(*args), pending), the compute placed between a send half and its receive (split backends)."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class CommImpl(Impl):
    """MoEComm, backend "nvshmem" or "reference"; "nvshmem_unchecked": nvshmem with check_errors=False;
    "nvshmem_quantize": nvshmem fed bf16 tokens (the config's fp8 ones dequantized) that its dispatch quantizes."""

    def __init__(self, name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, check_errors: bool,
                 weights_to: str = "combine", options: dict | None = None, backward: bool = False) -> None:
        self.name = name
        backend = "nvshmem" if name in (UNCHECKED, QUANTIZE) else name
        self.halves = backend != "nvshmem"
        self.weights_to = weights_to  # "dispatch": the weights go with dispatch, combine takes none
        moe = cfg.moe_config(tokens)
        if name == QUANTIZE and not moe.is_fp8:
            raise ValueError(f"{QUANTIZE} needs an fp8 config; {cfg.name} is {moe.dtype.name}")
        self.quantize = moe.dtype if name == QUANTIZE else None
        self.block = moe.scale_block
        options = dict(options or {})
        if backward and moe.is_fp8:  # an fp8 layer's gradients travel in bfloat16
            options.setdefault("grad_dtype", jnp.bfloat16)
        self.comm = jax_moe_comm.MoEComm(moe, mesh, AXIS, backend=backend,
                                         check_errors=check_errors and name != UNCHECKED, **options)

    def inputs(self, x, scales):
        if self.quantize is None:
            return x, scales
        rows = x.astype(jnp.float32) * jnp.repeat(scales, self.block, axis=1)
        return jax.jit(lambda r: r.astype(jnp.bfloat16))(rows), None

    split = True

    def dispatch(self, x, scales, ids, w):
        d = self.comm.dispatch(x, ids, scales, topk_weights=w if self.weights_to == "dispatch" else None,
                               quantize=self.quantize)
        return d.expert_x, d.expert_scales, (d.group_sizes, d.handle)

    def dispatch_send(self, x, scales, ids, w):
        return self.comm.dispatch_send(x, ids, scales, topk_weights=w if self.weights_to == "dispatch" else None,
                                       quantize=self.quantize)

    def dispatch_recv(self, pending):
        d = self.comm.dispatch_recv(pending)
        return d.expert_x, d.expert_scales, (d.group_sizes, d.handle)

    def combine(self, expert_y, aux, w):
        return self.comm.combine(expert_y, aux[1], None if self.weights_to == "dispatch" else w)

    def combine_send(self, expert_y, aux, w):  # weights here, as the fused combine takes them: pre-reduced
        return self.comm.combine_send(expert_y, aux[1], None if self.weights_to == "dispatch" else w)

    def combine_recv(self, pending):
        return self.comm.combine_recv(pending)

    def between(self, pending, compute, *args):
        return self.comm.between(pending, compute, *args)

    def close(self) -> None:
        self.comm.close()


class BaselineImpl(Impl):
    """baselines.ragged_* or baselines.padded_*."""

    def __init__(self, name: str, cfg: BenchConfig) -> None:
        self.name = name
        self.cfg = cfg
        self._dispatch = getattr(baselines, f"{name}_dispatch")
        self._combine = getattr(baselines, f"{name}_combine")

    def dispatch(self, x, scales, ids, w):
        d = self._dispatch(x, ids, num_experts=self.cfg.experts, axis_name=AXIS, scales=scales)
        return d.expert_x, d.expert_scales, d

    def combine(self, expert_y, aux, w):
        return self._combine(expert_y, aux, w, axis_name=AXIS, out_dtype=self.cfg.combine_dtype)


class FloorImpl(Impl):
    """The protocol's floor on this machine (ffi/probe.cu): each direction one kernel that stores the T rows (x,
    then the expert outputs) into the peer, fences, signals and waits, and copies what landed into its result, with
    no routing and no layout. The chain and its glue are the other backends'; its result is no round trip's (not
    checked). Only with the NVSHMEM backend (NVLink). flagged: the bytes in words that carry their own validity, no
    fence and no signal ("floor_flagged")."""

    halves = False

    def __init__(self, cfg: BenchConfig, tokens: int, mesh: Mesh, flagged: bool = False) -> None:
        self.name = "floor_flagged" if flagged else "floor"
        self.comm = jax_moe_comm.MoEComm(cfg.moe_config(tokens), mesh, AXIS, backend="nvshmem", check_errors=False)
        plan = self.comm._phases.plan
        if not plan.p2p:
            self.comm.close()
            raise RuntimeError("the floor probe needs NVLink stores to every peer")
        self._probe = lambda a: probes.probe_exchange(plan, a, flagged)  # per shard, as every Impl's

    def dispatch(self, x, scales, ids, w):
        return self._probe(x), scales, None

    def combine(self, expert_y, aux, w):
        return self._probe(expert_y)

    def close(self) -> None:
        self.comm.close()


def make_impl(name: str, cfg: BenchConfig, tokens: int, mesh: Mesh, check_errors: bool = True,
              weights_to: str = "combine", options: dict | None = None, backward: bool = False) -> Impl:
    """`options`: MoEComm keyword options (staged, timeout_s, the thresholds) of the MoEComm backends. `backward`:
    for timing forward and backward round trips (an fp8 MoEComm then gets grad_dtype bfloat16)."""
    if name in PROBES:
        if backward:
            raise ValueError(f"{name} is a probe of one direction's transfer: it has no backward")
        return FloorImpl(cfg, tokens, mesh, flagged=name == "floor_flagged")
    if name in ("nvshmem", UNCHECKED, QUANTIZE, "reference"):
        return CommImpl(name, cfg, tokens, mesh, check_errors, weights_to, options, backward)
    return BaselineImpl(name, cfg)
