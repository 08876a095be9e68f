"""The NVSHMEM backend: the four phases as XLA FFI custom calls on the CUDA kernels in ``ffi/``.

Same signatures, layout and handle as ``reference``; the fused ``dispatch`` and ``combine`` are one custom call
each on the NVLink path (one kernel: send, then receive). Each phase is an XLA FFI custom call with a side effect, so
XLA never drops or merges it, made by ``kernel_call`` (a JAX primitive like ``jax.ffi.ffi_call``'s, whose effect
``jax.checkpoint`` may recompute). The order comes from data: dispatch_send's status feeds dispatch_recv, whose
row_origin feeds combine_send, whose status feeds combine_recv. A MoEComm's calls must form one protocol at a time
(see MoEComm).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from . import _native, errors, runtime
from .config import Geometry, MoECommConfig, Options
from .kernel_call import kernel_call, varying_axes, varying_over
from .types import CombineHandle, Dispatched, pytree_dataclass

MAX_EXPERTS_PER_TOKEN = 32  # combine_recv keeps a token's live slots in one 32-bit mask
CHECK_LAG = 2  # round trips between a failure and the check that raises it (ffi/handlers.cu, Check)
_registered = False
# The split halves, registered a second time for send_stream="own" (see _register_targets).
_OWN_STREAM_PHASES = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")


def _register_targets() -> None:
    """Registers the handlers with XLA (once per process). The kernels' handlers are declared command-buffer
    compatible, so XLA may capture them into CUDA graphs with the surrounding work (fewer launches; see
    benchmarks/NOTES.md). The check handler is not: it must run on the host at every execution. Nor are the split
    halves' "_own" targets (send_stream="own"): a send forked onto the library's stream and joined by its receive
    cannot be captured (ffi/handlers.cu, forked), so XLA runs them outside command buffers."""
    global _registered
    if not _registered:
        from jax._src.lib import xla_client

        compatible = {"traits": xla_client.CustomCallTargetTraits.COMMAND_BUFFER_COMPATIBLE}
        for name, capsule in _native.ext.handlers().items():
            jax.ffi.register_ffi_target(f"jmc_{name}", capsule, platform="CUDA",
                                        **({} if name == "check" else compatible))
            if name in _OWN_STREAM_PHASES:  # send_stream="own": the same handlers, never in a command buffer
                jax.ffi.register_ffi_target(f"jmc_{name}_own", capsule, platform="CUDA")
        errors.give_texts_to(_native.ext)
        _registered = True


@functools.cache
def _constants() -> dict:
    return dict(_native.ext.constants())


def row_type(dtype) -> int:
    """The kernels' code (RowType, ffi/context.h) of a combine row dtype: bfloat16, float16 or float32."""
    return int(_constants()[np.dtype(dtype).name])


def _round16(n: int) -> int:
    return -(-n // 16) * 16


def kernel_sizes(cfg: MoECommConfig, world: int, rank: int, sm_count: int = 132, timeout_s: float = 30.0,
                 window_slots: int | None = None, max_sms: int | None = None) -> dict[str, int]:
    """The ``Sizes`` struct of ffi/context.h for one rank. window_slots: the slots per source of a round (see
    window_slots_for); None: every slot, no window. max_sms: MoEComm's SM budget, each kernel's grid at most that
    many blocks (None: no bound)."""
    geo = Geometry(cfg, world, ())
    payload = cfg.hidden * np.dtype(cfg.dtype).itemsize
    slots = -(-cfg.max_tokens // cfg.dp_size)
    return dict(
        rank=rank, world=world, dp_size=cfg.dp_size, num_dp=geo.num_dp, max_tokens=cfg.max_tokens,
        experts_per_token=cfg.experts_per_token, hidden=cfg.hidden, num_experts=cfg.num_experts,
        local_experts=geo.L, capacity=geo.capacity, align=cfg.align, payload_bytes=payload,
        scale_cols=cfg.scale_cols,
        token_stride=_round16(payload + 4 * cfg.scale_cols + 4 * (1 + cfg.experts_per_token)),
        slots_per_source=slots,
        window_slots=slots if window_slots is None else min(window_slots, slots),
        combine_stride=_round16(cfg.hidden * np.dtype(cfg.out_dtype).itemsize),
        timeout_ns=int(timeout_s * 1e9),
        sm_count=sm_count,
        max_blocks=0 if max_sms is None else max_sms,
        drop_overflow=int(cfg.overflow == "drop"),
        expert_capacity=geo.expert_capacity or 0,
    )


def takes_flagged_path(cfg: MoECommConfig, low_latency_max_tokens: int, staging: bool) -> bool:
    """Whether a config suits the low-latency path (``Context::flagged``: words that carry their own epoch, no
    fence, count or signal between a row and its reader): up to ``low_latency_max_tokens`` tokens per rank, every
    peer on NVLink (no staging), rows of whole 8-byte pairs and combine chunks of 8 columns. window_and_path adds
    the heap bound; the extension decides the same from the layout, which holds the path's buffers only then."""
    return (not staging and cfg.max_tokens <= low_latency_max_tokens and cfg.hidden % 8 == 0
            and cfg.scale_cols % 2 == 0)


def _buffer_sizes(cfg: MoECommConfig, world: int, measurement: bool, staging: bool,
                  window_slots: int | None, flagged: bool = False) -> list[tuple[str, int]]:
    """(name, bytes) of every buffer one config needs, in allocation order (ffi/context.h says what each holds).
    ``flagged``: with the low-latency path's buffers (takes_flagged_path)."""
    s = kernel_sizes(cfg, world, 0, window_slots=window_slots)
    slots, T, K = world * s["slots_per_source"], s["max_tokens"], s["experts_per_token"]
    # The rows of a round: every source's window of slots, and the tokens they hold (all of them, unwindowed).
    window, window_tokens = world * s["window_slots"], min(T, s["window_slots"] * cfg.dp_size)
    words = _round16(world * 8)  # one u64 per rank
    status = 4 * errors.STATUS_WORDS
    return [
        # Staged: every token's row once per rank off NVLink it is bound for (one run per rank, puts' source), then
        # each token's quantized row (dispatch(quantize=...): quantized once, copied from there).
        *([("dispatch_staging", T * (min(K, world) + 1) * s["token_stride"])] if staging else []),
        ("dispatch_slots", window * s["token_stride"]),
        ("dispatch_ids", slots * K * 4),
        ("dispatch_ready", words),
        *([("dispatch_routes", slots * K * 4),  # staged: where each token's row went on each of its ranks
           ("dispatch_counts", world * world * 4),  # staged: rows each source sent each rank
           ("dest_rows", world * 4),  # local: the staged send's running rows per rank
           ("group_routes", cfg.dp_size * s["slots_per_source"] * K * 4),  # local: the DP group's routes and
           ("group_counts", cfg.dp_size * world * 4)] if staging else []),  # counts, for the staged combine_recv
        # Staged: this rank's expert rows per slot (capacity), or its pre-reduced rows: one per (source, token) with
        # a live slot here, at most every source's every token.
        *([("combine_staging", max(s["capacity"], slots) * s["combine_stride"])] if staging else []),
        # A combine sends rows per slot ([T][K]) or pre-reduced rows, one per distinct expert rank of a token (at
        # most K: [T][K] too), never both: the two layouts share these bytes. Windowed: a round's tokens.
        ("combine_rows", window_tokens * K * s["combine_stride"]),
        ("combine_flags", T * K * 8),
        ("sync_flags", words),
        ("combine_weights", slots * K * 4),
        ("weights_ready", words),
        ("partials_ready", words),
        ("window_ready", words),
        ("dispatch_window_free", words),
        ("combine_window_free", words),
        *([("probe_ready", words)] if measurement else []),  # the bench's floor probe (ffi/probe.cu)
        ("round_failures", 2 * world * status),
        ("fatal_failures", world * status),
        ("abort_word", 8),
        ("row_of", s["num_dp"] * T * K * 4),  # local: the pre-reduced combine_send's inverse of row_origin
        ("expert_tally", cfg.num_experts * 4),  # local: dispatch_recv's sums of other ranks' experts' slots
        # The low-latency path: rows, ids and combine rows in 8-byte words of 4 data bytes and the epoch.
        *([("flagged_rows", slots * 2 * (s["payload_bytes"] + 4 * s["scale_cols"])),
           ("flagged_ids", slots * K * 8),
           ("flagged_combine", T * K * 2 * s["combine_stride"])] if flagged else []),
    ]


def symmetric_layout(cfg: MoECommConfig, world: int, measurement: bool = False, staging: bool = False,
                     shared_with: tuple[MoECommConfig, ...] = (), window_slots: int | None = None,
                     flagged: bool = False) -> dict[str, tuple[int, int]]:
    """The symmetric allocation of one MoEComm on each rank: buffer name -> (offset, bytes), each 16-byte aligned.
    The only definition: the extension carves its buffers by these names (ffi/context.h says what each holds).
    ``measurement``: with the measurement build's probe word. ``staging``: with the staging buffers of the path to
    peers off NVLink (``staged=True``, or a job whose peers are not all reachable by NVLink stores); a job whose
    peers all are never touches them, and they are the largest buffer of a worst-case capacity. ``shared_with``:
    configs whose round trips run in turn on the same buffers (an fp8 layer's backward in its gradient dtype): each
    buffer holds the largest of them. ``window_slots``: the rows of a round (window_slots_for); None: all.
    ``flagged``: with the low-latency path's buffers (takes_flagged_path)."""
    sizes: dict[str, int] = {}
    for c in (cfg, *shared_with):
        for name, size in _buffer_sizes(c, world, measurement, staging, window_slots, flagged):
            sizes[name] = max(sizes.get(name, 0), size)
    layout, offset = {}, 0
    for name, size in sizes.items():
        layout[name] = (offset, _round16(size))
        offset += _round16(size)
    return layout


def _layout_bytes(layout: dict[str, tuple[int, int]]) -> int:
    return sum(size for _, size in layout.values())


def window_slots_for(cfg: MoECommConfig, world: int, max_bytes: int | None, staging: bool = False,
                     shared_with: tuple[MoECommConfig, ...] = (), measurement: bool | None = None) -> int | None:
    """The slots per source of one round of a windowed round trip: None (no window) when the heap of every slot fits
    ``max_bytes`` (or there is no bound), else the fewest rounds whose window fits, the slots split evenly among them.
    Rows then travel in rounds of that many slots per source (``window_slots * dp_size`` tokens of each DP group),
    through buffers of one round. ValueError when not even one slot per source fits, or when a window would be needed
    on the staged path (peers off NVLink, or ``staged=True``), which has none."""
    if max_bytes is None:
        return None
    measurement = _native.measurement_build() if measurement is None else measurement
    heap = lambda w: _layout_bytes(symmetric_layout(cfg, world, measurement, staging, shared_with, w))  # noqa: E731
    slots = kernel_sizes(cfg, world, 0)["slots_per_source"]

    if heap(slots) <= max_bytes:
        return None
    if staging:
        raise ValueError(f"max_symmetric_bytes={max_bytes} needs a windowed round trip ({heap(slots)} bytes "
                         "unwindowed), which runs on NVLink peers only: not with staged=True or peers off NVLink")
    if heap(1) > max_bytes:
        raise ValueError(f"max_symmetric_bytes={max_bytes} is below the smallest windowed heap of this config "
                         f"({heap(1)} bytes, one slot per source a round); raise it or lower max_tokens")
    low, high = 1, slots - 1  # heap(low) fits, heap(slots) does not
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if heap(mid) <= max_bytes else (low, mid - 1)
    rounds = -(-slots // low)
    return -(-slots // rounds)  # as many rounds as the largest window that fits needs, no fuller than it


def window_and_path(cfg: MoECommConfig, world: int, max_bytes: int | None, staging: bool = False,
                    shared_with: tuple[MoECommConfig, ...] = (), measurement: bool | None = None,
                    low_latency_max_tokens: int = Options.low_latency_max_tokens) -> tuple[int | None, bool]:
    """(window_slots_for's window, whether the low-latency path is taken): the path where takes_flagged_path says
    so and the unwindowed heap with its buffers fits ``max_bytes``; else the window of the heap without them."""
    if takes_flagged_path(cfg, low_latency_max_tokens, staging):
        measurement = _native.measurement_build() if measurement is None else measurement
        heap = _layout_bytes(symmetric_layout(cfg, world, measurement, staging, shared_with, None, True))
        if max_bytes is None or heap <= max_bytes:
            return None, True
    return window_slots_for(cfg, world, max_bytes, staging, shared_with, measurement), False


def symmetric_bytes(cfg: MoECommConfig, world: int, staging: bool = False,
                    shared_with: tuple[MoECommConfig, ...] = (), max_bytes: int | None = None,
                    low_latency_max_tokens: int = Options.low_latency_max_tokens) -> int:
    """Bytes of NVSHMEM symmetric heap one MoEComm takes on each rank (``staging``, ``shared_with``: see
    symmetric_layout; ``max_bytes``: MoEComm's max_symmetric_bytes, see window_slots_for;
    ``low_latency_max_tokens``: MoEComm's, see takes_flagged_path)."""
    window, flagged = window_and_path(cfg, world, max_bytes, staging, shared_with, None, low_latency_max_tokens)
    return _layout_bytes(symmetric_layout(cfg, world, _native.measurement_build(), staging, shared_with, window,
                                          flagged))


@dataclasses.dataclass(frozen=True)
class Plan:
    """A Geometry plus this rank's NVSHMEM context (its id: the handlers' attribute `context`)."""

    geo: Geometry
    ctx: int
    p2p: bool  # stores reach every peer (NVLink): the fused calls run one kernel each, combine_send pre-reduces
    rank: int  # this process's rank in its EP group
    # The symmetric allocation, this plan's own or (shared) its owner's; the slots per source of a round (None: no
    # window); and the plan whose buffers and protocol state this one shares (share_plan). Not compared: a plan is
    # named by its context.
    layout: dict[str, tuple[int, int]] = dataclasses.field(compare=False)
    window_slots: int | None = dataclasses.field(compare=False)
    # The fused calls take the low-latency path (takes_flagged_path): no weights travel with its dispatch.
    flagged: bool = dataclasses.field(default=False, compare=False)
    owner: Plan | None = dataclasses.field(default=None, compare=False)
    # How this rank reaches each rank of its EP group: "nvlink" (stores into its buffers) or "put" (NVSHMEM puts
    # from symmetric staging: another node, or staged=True).
    transports: tuple[str, ...] = dataclasses.field(default=(), compare=False)

    def __post_init__(self) -> None:
        if self.window_slots is not None and not self.p2p:  # the staged path has no rounds (window_slots_for)
            raise ValueError("a windowed plan needs every peer on NVLink")

    @property
    def windowed(self) -> bool:
        """Rows travel in rounds: the split halves then defer to the fused calls (a round's send waits for the
        previous round's receive, so one kernel must do both)."""
        return self.window_slots is not None


def ep_group(mesh, ep_axes: tuple[str, ...], device) -> tuple[int, list]:
    """(the EP rank of `device`, its EP group's devices by rank): the devices that share `device`'s coordinates on
    every other axis of `mesh`, ordered row-major over `ep_axes` (as ``jax.lax.axis_index(ep_axes)`` numbers them)."""
    names = list(mesh.axis_names)
    found = np.argwhere(mesh.devices == device)
    if len(found) != 1:
        raise ValueError(f"device {device} is not in the mesh once")
    where = tuple(int(i) for i in found[0])
    index = tuple(slice(None) if name in ep_axes else where[i] for i, name in enumerate(names))
    kept = [name for name in names if name in ep_axes]  # the group's axes, in mesh order
    group = np.transpose(mesh.devices[index], [kept.index(name) for name in ep_axes]).reshape(-1)
    devices = list(group)
    return devices.index(device), devices


# Tests: PEs per simulated node (simulated_nodes), None for none.
_ranks_per_node: int | None = None


@contextlib.contextmanager
def simulated_nodes(ranks_per_node: int):
    """Tests: the MoEComms created inside count PEs pe // ranks_per_node as nodes, and reach the PEs of other nodes by
    NVSHMEM puts as if off NVLink (those of their own node by stores), so that one machine runs the mixed transports
    of a multi-node job. Every process must enter it alike (the path decides the symmetric layout)."""
    global _ranks_per_node
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    before, _ranks_per_node = _ranks_per_node, ranks_per_node
    try:
        yield
    finally:
        _ranks_per_node = before


def create_plan(geo: Geometry, mesh, shared_with: tuple[MoECommConfig, ...] = ()) -> Plan:
    """Collective (every process, same order): allocates one MoEComm's symmetric buffers. Each EP group of the mesh
    (one per coordinate of its other axes) exchanges among its own PEs; one symmetric allocation per process.
    ``shared_with``: configs that will share these buffers (share_plan), each buffer sized for the largest."""
    rt = runtime.current()
    if rt is None:
        raise RuntimeError("backend='nvshmem' needs jax_moe_comm.initialize() first (after jax.distributed)")
    cfg = geo.cfg
    if cfg.experts_per_token > MAX_EXPERTS_PER_TOKEN:
        raise ValueError(f"experts_per_token must be <= {MAX_EXPERTS_PER_TOKEN} on the NVSHMEM backend")
    if mesh.devices.size != rt.world:
        raise ValueError(f"the mesh has {mesh.devices.size} devices but NVSHMEM has {rt.world} processes; the mesh "
                         "must hold every process's GPU (one GPU per process)")
    rank, devices = ep_group(mesh, geo.axis_name, rt.device)
    pes = [int(d.process_index) for d in devices]
    if len(set(pes)) != len(pes):
        raise ValueError("the NVSHMEM backend needs one GPU per process: an EP group holds two devices of process "
                         f"{max(pes, key=pes.count)}")
    _register_targets()
    ctx, layout, window = create_context(cfg, geo.world, rank, geo.options, pes, shared_with)
    ext = _native.ext
    transports = tuple("nvlink" if direct else "put" for direct in ext.context_direct(ctx))
    return Plan(geo, ctx, bool(ext.context_p2p(ctx)), rank, layout, window, bool(ext.context_flagged(ctx)),
                transports=transports)


def share_plan(owner: Plan, geo: Geometry) -> Plan:
    """A plan of another config (``geo``: created with ``shared_with`` holding its config) on `owner`'s buffers and
    protocol state: their round trips form one sequence (one epoch count, one phase order, one failure state), so a
    round trip of one that overlaps one of the other fails with an "expected <phase>" error instead of mixing rows.
    Not collective; close it before its owner."""
    sizes = kernel_sizes(geo.cfg, geo.world, owner.rank, _native.ext.sm_count(), geo.options.timeout_s,
                         owner.window_slots, geo.options.max_sms)
    ctx = _native.ext.share_context(owner.ctx, sizes, owner.layout, geo.options.ids_first_min_tokens)
    return Plan(geo, ctx, owner.p2p, owner.rank, owner.layout, owner.window_slots,
                bool(_native.ext.context_flagged(ctx)), owner, owner.transports)


def create_context(cfg: MoECommConfig, world: int, rank: int, options: Options, pe_of_rank: list[int] | None = None,
                   shared_with: tuple[MoECommConfig, ...] = ()) -> tuple[int, dict[str, tuple[int, int]], int | None]:
    """Collective: the extension's context of one MoEComm on this rank (its id), its symmetric layout and the slots
    per source of a round (None: no window; see window_slots_for). pe_of_rank: the NVSHMEM PE of each rank of the
    EP group (default: rank r is PE r, the group of every PE). The staging buffers are allocated when some process
    of the job needs them (an allocation has one size on every process)."""
    pes = list(range(world)) if pe_of_rank is None else list(pe_of_rank)
    nodes = [] if _ranks_per_node is None else [pe // _ranks_per_node for pe in pes]
    staging = options.staged or len(set(nodes)) > 1 or not _native.ext.job_on_nvlink(pes)
    window, flagged = window_and_path(cfg, world, options.max_symmetric_bytes, staging, shared_with, None,
                                      options.low_latency_max_tokens)
    sizes = kernel_sizes(cfg, world, rank, _native.ext.sm_count(), options.timeout_s, window, options.max_sms)
    layout = symmetric_layout(cfg, world, _native.measurement_build(), staging, shared_with, window, flagged)
    ctx = _native.ext.create_context(sizes, layout, pes, staged=options.staged,
                                     ids_first_min_tokens=options.ids_first_min_tokens, node_of_rank=nodes)
    return ctx, layout, window


def plan_bytes(plan: Plan) -> int:
    """Bytes of symmetric heap the plan's context allocated on this rank."""
    return int(_native.ext.context_bytes(plan.ctx))


def destroy_plan(plan: Plan) -> None:
    _native.ext.destroy_context(plan.ctx)


def reset_plan(plan: Plan) -> None:
    """Collective: the buffers as created, after a failure (every rank's kernels must have ended)."""
    _native.ext.reset_context(plan.ctx)


def raise_pending(plan: Plan) -> None:
    """Raises MoECommError for a failure the device has told the host of and the check has not raised yet (no
    synchronization: what the device has written so far). A routing error is raised once; a protocol failure until
    reset."""
    words = _native.ext.host_failure(plan.ctx)
    if words[errors.CODE] == 0:
        return
    _native.ext.failure_raised(plan.ctx)
    errors.raise_if_failed(words)


def take_unraised(plan: Plan) -> str | None:
    """The text of a failure no check has raised yet, once this device has finished its queued work (it waits), now
    counted as raised; None if there is none. For close() and interpreter exit: a failed step whose outputs nobody
    read, and after which no check ran, is reported there."""
    words = _native.ext.unraised_failure(plan.ctx)
    if words[errors.CODE] == 0:
        return None
    _native.ext.failure_raised(plan.ctx)
    return errors.describe(words)


@pytree_dataclass
class PendingDispatch:
    """dispatch_send's status (its arrival orders dispatch_recv after it) and what combine will need."""

    status: Array
    topk_ids: Array
    num_tokens: Array
    topk_weights: Array | None = None  # given to dispatch_send: into the handle
    deferred: tuple | None = None  # windowed plans: (x, scales, after), for the fused dispatch that dispatch_recv runs
    kept: tuple = ()  # send_stream="own": the send's operands, live until dispatch_recv (its operands)


@pytree_dataclass(static=("rows_type", "reduced", "weights_sent"))
class PendingCombine:
    """combine_send's status (orders combine_recv after it) and the routing."""

    status: Array
    topk_ids: Array
    num_tokens: Array
    topk_weights: Array | None  # given to combine_send (else to combine_recv)
    rows_type: int  # static: the RowType code of the rows in flight
    reduced: bool  # static: one pre-reduced row per (token, expert rank) instead of one per slot
    deferred: tuple | None = None  # windowed plans: (expert_y, row_origin), for the fused combine of combine_recv
    weights_sent: bool = False  # static, windowed plans: the dispatch stored the weights everywhere
    kept: tuple = ()  # send_stream="own": the send's operands, live until combine_recv (its operands)


_STATUS = jax.ShapeDtypeStruct((errors.STATUS_WORDS,), jnp.int32)


def _varying(outs, args, ep_axes: tuple[str, ...]):
    """Marks a custom call's per-shard results as varying over the EP axes and every axis its operands vary over,
    as shard_map's type checks expect (custom call results carry no such annotation; without it e.g. a lax.scan carry
    would change type)."""
    axes = frozenset(ep_axes).union(*(varying_axes(a) for a in jax.tree.leaves(args)))
    return jax.tree.map(lambda a: varying_over(a, axes), outs)


def _call(name: str, results, plan: Plan, *args, **attrs):
    outs = kernel_call(f"jmc_{name}", results, *args, context=np.int64(plan.ctx), **attrs)
    return _varying(outs, args, plan.geo.axis_name)


def _send_call(name: str, plan: Plan, *args, **attrs) -> tuple[Array, tuple]:
    """A send half's call: (its status, the operands its receive must keep live: none but with send_stream="own").
    Its stream is MoEComm's send_stream: XLA's compute stream (None); an XLA stream of its own by XLA's stream
    annotation, an async start/done pair ("xla_async"); or the library's stream, the handlers' `side_stream`
    ("own": targets outside command buffers, see _register_targets)."""
    mode = plan.geo.options.send_stream
    if mode == "own":
        status, kept = kernel_call(f"jmc_{name}_own", _STATUS, *args, _passthrough=True, context=np.int64(plan.ctx),
                                   side_stream=np.int64(1), **attrs)
        return _varying(status, args, plan.geo.axis_name), kept
    call = functools.partial(_call, name, _STATUS, plan, side_stream=np.int64(0), **attrs)
    return (on_xla_stream(call, *args) if mode == "xla_async" else call(*args)), ()


def on_xla_stream(f, *args, stream: int = 1):
    """f(*args) in XLA's stream annotation (``compute_on("gpu_stream:<stream>")``): XLA wraps the call into an async
    start/done pair run on that stream (XLA:GPU; elsewhere the annotation is ignored). jax 0.10 names the function
    form ``compute_on2``, jax 0.11 ``compute_on``."""
    from jax._src import core
    from jax.experimental import compute_on as module

    wrap = getattr(module, "compute_on2", None) or module.compute_on
    return wrap(f, compute_type=f"gpu_stream:{stream}", out_memory_spaces=core.MemorySpace.Device)(*args)


def _recv_target(name: str, kept: tuple) -> str:
    """A receive half's target: the "_own" one when its send was forked onto the library's stream (`kept`)."""
    return f"{name}_own" if kept else name


def dispatch_send(plan: Plan, x: Array, topk_ids: Array, scales: Array | None, num_tokens: Array,
                  topk_weights: Array | None = None, after: Array | None = None) -> PendingDispatch:
    """after: an array the call must run after (its operand, never read; see _after_arg). On a windowed plan nothing
    runs here: dispatch_recv runs the fused dispatch (see Plan.windowed)."""
    if plan.windowed:
        status = _varying(jnp.zeros((errors.STATUS_WORDS,), jnp.int32), (x, topk_ids), plan.geo.axis_name)
        return PendingDispatch(status, topk_ids, num_tokens, topk_weights, (x, scales, after))
    status, kept = _send_call("dispatch_send", plan, x, _scales_arg(plan, scales), topk_ids, num_tokens,
                              _sent_weights_arg(plan, topk_weights), _after_arg(plan, x, after))
    return PendingDispatch(status, topk_ids, num_tokens, topk_weights, kept=kept)


def _after_arg(plan: Plan, x: Array, after: Array | None) -> Array:
    """An operand that orders a dispatch after the call that produced it: XLA schedules a custom call after its
    operands, and keeps every operand (the kernel never reads it). An optimization barrier would not do: XLA removes
    barriers early, and with them any tie between values that no data joins (design.md, "FFI and ordering").

    With check_errors=True it is the token of the deferred check (ffi/handlers.cu, Check), which itself runs after
    `after` (or after x is computed: after the previous round trip): XLA runs the check on the host right before it
    launches this round trip, and it raises a failure of an earlier round trip without synchronizing."""
    if plan.geo.check_errors is True:
        return kernel_call("jmc_check", jax.ShapeDtypeStruct((1,), jnp.int32), x if after is None else after,
                           context=np.int64(plan.ctx), lag=np.int64(CHECK_LAG))
    return jnp.zeros((0,), jnp.int32) if after is None else after


def _sent_weights_arg(plan: Plan, topk_weights: Array | None) -> Array:
    """The weights the dispatch kernels store with the ids rows: only on the NVLink path (the staged path leaves
    them to the pre-reduced combine_send's own exchange), and not on the low-latency path (its combine is per slot:
    it reads the weights at home)."""
    if topk_weights is None or not plan.p2p or plan.flagged:
        return jnp.zeros((0,), jnp.float32)
    return topk_weights.astype(jnp.float32)


def _weights_of(plan: Plan, handle: CombineHandle, topk_weights: Array | None) -> tuple[Array | None, bool]:
    """(the weights a combine uses, whether its dispatch stored them on every rank): None with weights in the handle
    means the handle's, given to dispatch."""
    if topk_weights is None and handle.topk_weights is not None:
        return handle.topk_weights, plan.p2p and not plan.flagged
    return topk_weights, False


def _scales_arg(plan: Plan, scales: Array | None) -> Array:
    return jnp.zeros((plan.geo.T, 0), jnp.float32) if scales is None else scales


def _received(plan: Plan) -> tuple:
    """dispatch_recv's results: expert_x, expert_scales, group_sizes, row_origin, expert_counts (every expert's live
    slots over the EP group, counted from the ids rows every rank receives: no collective)."""
    geo, cfg = plan.geo, plan.geo.cfg
    return (jax.ShapeDtypeStruct((geo.capacity, cfg.hidden), cfg.dtype),
            jax.ShapeDtypeStruct((geo.capacity, cfg.scale_cols), jnp.float32),
            jax.ShapeDtypeStruct((geo.L,), jnp.int32),
            jax.ShapeDtypeStruct((geo.capacity,), jnp.int32),
            jax.ShapeDtypeStruct((cfg.num_experts,), jnp.int32))


def _dispatched(plan: Plan, received, topk_ids: Array, num_tokens: Array, topk_weights: Array | None,
                *statuses: Array) -> Dispatched:
    expert_x, expert_scales, group_sizes, row_origin, expert_counts = received
    handle = CombineHandle(row_origin=row_origin, topk_ids=topk_ids, num_tokens=num_tokens,
                           status=errors.first_failure(*statuses), topk_weights=topk_weights)
    return Dispatched(expert_x, expert_scales if plan.geo.cfg.is_fp8 else None, group_sizes, handle, expert_counts)


def dispatch_recv(plan: Plan, p: PendingDispatch) -> Dispatched:
    if p.deferred is not None:
        return dispatch(plan, p.deferred[0], p.topk_ids, p.deferred[1], p.num_tokens, p.topk_weights, p.deferred[2])
    *received, status = _call(_recv_target("dispatch_recv", p.kept), _received(plan) + (_STATUS,), plan,
                              p.status, *p.kept)
    return _dispatched(plan, received, p.topk_ids, p.num_tokens, p.topk_weights, p.status, status)


def dispatch(plan: Plan, x: Array, topk_ids: Array, scales: Array | None, num_tokens: Array,
             topk_weights: Array | None = None, after: Array | None = None) -> Dispatched:
    """The fused call: one kernel on the NVLink path, else dispatch_send then dispatch_recv. after: an array the call
    must run after (see _after_arg)."""
    if not plan.p2p:
        return dispatch_recv(plan, dispatch_send(plan, x, topk_ids, scales, num_tokens, topk_weights, after))
    *received, send_status, status = _call("dispatch", _received(plan) + (_STATUS, _STATUS), plan, x,
                                           _scales_arg(plan, scales), topk_ids, num_tokens,
                                           _sent_weights_arg(plan, topk_weights), _after_arg(plan, x, after))
    return _dispatched(plan, received, topk_ids, num_tokens, topk_weights, send_status, status)


def prereduces(plan: Plan) -> bool:
    """Whether combine_send can pre-reduce (given the weights): on the NVLink path, and on the staged path up to the
    extension's max_nvlink_peers ranks (its runs of partial rows are planned per block for that many sources)."""
    return plan.p2p or plan.geo.world <= _constants()["max_nvlink_peers"]


def combine_send(plan: Plan, expert_y: Array, handle: CombineHandle,
                 topk_weights: Array | None = None) -> PendingCombine:
    """With topk_weights (and prereduces) the expert side pre-reduces: one row per (token, expert rank), the
    weighted sum of the token's rows there, in the output dtype (a row of combine_stride bytes), instead of one row
    per slot; on the staged path those rows go to each rank off NVLink as one put per source. None with weights in
    the handle: the handle's (given to dispatch, which on the NVLink path stored them on every rank: no exchange
    here)."""
    return _combine_send(plan, expert_y, handle, *_weights_of(plan, handle, topk_weights))


def _combine_send(plan: Plan, expert_y: Array, handle: CombineHandle, topk_weights: Array | None,
                  sent: bool) -> PendingCombine:
    """combine_send with its weights resolved (None: rows per slot) and whether the dispatch stored them. On a
    windowed plan nothing runs here: combine_recv runs the fused combine."""
    cfg = plan.geo.cfg
    reduced = topk_weights is not None and prereduces(plan)
    partial = cfg.out_dtype
    if plan.windowed:
        status = _varying(jnp.zeros((errors.STATUS_WORDS,), jnp.int32), (expert_y, handle.row_origin),
                          plan.geo.axis_name)
        return PendingCombine(status, handle.topk_ids, handle.num_tokens, topk_weights,
                              row_type(partial if reduced else expert_y.dtype), reduced, (expert_y, handle.row_origin),
                              sent)
    weights = topk_weights.astype(jnp.float32) if reduced else jnp.zeros((0,), jnp.float32)
    status, kept = _send_call("combine_send", plan, expert_y, handle.row_origin, weights,
                              partial_type=np.int64(row_type(partial)), weights_sent=np.int64(sent))
    return PendingCombine(status, handle.topk_ids, handle.num_tokens, topk_weights,
                          row_type(partial if reduced else expert_y.dtype), reduced, kept=kept)


def combine_recv(plan: Plan, q: PendingCombine, topk_weights: Array | None) -> Array:
    """topk_weights may be None when combine_send had them."""
    cfg = plan.geo.cfg
    weights = q.topk_weights if topk_weights is None else topk_weights
    if q.deferred is not None:
        expert_y, row_origin = q.deferred
        return _fused_combine(plan, expert_y, row_origin, q.topk_ids, weights, q.num_tokens, q.reduced,
                              q.weights_sent)
    results = (jax.ShapeDtypeStruct((cfg.max_tokens, cfg.hidden), cfg.out_dtype), _STATUS)
    y, status = _call(_recv_target("combine_recv", q.kept), results, plan, q.status, q.topk_ids,
                      weights.astype(jnp.float32), q.num_tokens, *q.kept, rows_type=np.int64(q.rows_type),
                      reduced=np.int64(q.reduced))
    return _checked(plan, y, status)


def _checked(plan: Plan, y: Array, status: Array) -> Array:
    """y, after raising the round trip's error with check_errors="sync" (`status`: the round trip's last kernel's,
    which holds every rank's first failure; with True the next round trips' check raises it)."""
    if plan.geo.check_errors == "sync":
        y = errors.check_now(status, after=y)  # y depends on the check: an eager call raises where y is read
    return y


def combine(plan: Plan, expert_y: Array, handle: CombineHandle, topk_weights: Array | None, weights_at: str) -> Array:
    """The fused call, the weights given where ``weights_at`` says ("send": pre-reduced where prereduces): one
    kernel on the NVLink path, else combine_send then combine_recv. None: the handle's weights."""
    topk_weights, sent = _weights_of(plan, handle, topk_weights)
    if not plan.p2p:
        if weights_at == "send":
            return combine_recv(plan, _combine_send(plan, expert_y, handle, topk_weights, sent), None)
        return combine_recv(plan, _combine_send(plan, expert_y, handle, None, False), topk_weights)
    return _fused_combine(plan, expert_y, handle.row_origin, handle.topk_ids, topk_weights, handle.num_tokens,
                          weights_at == "send", sent)


def _fused_combine(plan: Plan, expert_y: Array, row_origin: Array, topk_ids: Array, topk_weights: Array,
                   num_tokens: Array, reduced: bool, sent: bool) -> Array:
    """The fused combine call (NVLink path): pre-reduced when `reduced`; `sent`: the dispatch stored the weights."""
    cfg = plan.geo.cfg
    results = (jax.ShapeDtypeStruct((cfg.max_tokens, cfg.hidden), cfg.out_dtype), _STATUS, _STATUS)
    y, _, status = _call("combine", results, plan, expert_y, row_origin, topk_ids, topk_weights.astype(jnp.float32),
                         num_tokens, reduced=np.int64(reduced), weights_sent=np.int64(sent))
    return _checked(plan, y, status)
