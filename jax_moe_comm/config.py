"""MoECommConfig: the static description of one MoE layer's communication.

Every field is validated when the config is built: a bad value raises ``ValueError`` naming the argument
and the rule it breaks. Values that need the mesh (the world size) are checked by ``MoEComm``.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax.numpy as jnp
import numpy as np

PAYLOAD_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32, jnp.float8_e4m3fn)
OUT_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)
DEFAULT_SCALE_BLOCK = 128
OVERFLOW_POLICIES = ("error", "drop")
CAPACITY_PER = ("rank", "expert")
# A packed row's origin is stored as one int32: (src_group * max_tokens + token) * K + slot.
_MAX_ORIGIN = 2**31 - 1


def _dtype_name(dtype: Any) -> str:
    return np.dtype(dtype).name


def _positive_int(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return int(value)


def _canonical_dtype(name: str, value: Any, allowed: tuple) -> np.dtype:
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise ValueError(f"{name} must be a dtype, got {value!r}") from exc
    if dtype not in [np.dtype(d) for d in allowed]:
        names = ", ".join(_dtype_name(d) for d in allowed)
        raise ValueError(f"{name} must be one of {names}; got {dtype.name}")
    return dtype


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def describe_axes(axes: str | tuple[str, ...]) -> str:
    """The EP axes for a message: "mesh axis 'ep'" or "mesh axes ('context', 'expert')"."""
    if isinstance(axes, str):
        axes = (axes,)
    return f"mesh axis {axes[0]!r}" if len(axes) == 1 else f"mesh axes {tuple(axes)!r}"


@dataclasses.dataclass(frozen=True)
class MoECommConfig:
    """Static shapes and options of one dispatch/combine.

    Args:
      num_experts: E, experts in the layer; a multiple of the world size.
      experts_per_token: K, top-k experts per token (1 <= K <= E).
      hidden: H, elements per token row.
      max_tokens: static bound of tokens per DP group per call (rows of ``x``).
      dtype: payload dtype of ``x``: bfloat16, float16, float32 or float8_e4m3fn.
      scale_block: B, elements per fp32 scale; fp8 only (default 128), ``hidden % B == 0``.
      out_dtype: dtype of the combined output: bfloat16, float16 or float32.
      dp_size: ranks per DP group; the group's ranks hold identical tokens.
      capacity: with ``capacity_per="rank"``: rows of ``expert_x`` per rank, shared by its local experts; default
        the worst case (``worst_case_rows``), which no routing overflows. With ``capacity_per="expert"``: rows each
        local expert keeps (a multiple of ``align``); default every row an expert can get (``num_dp * max_tokens``,
        aligned). Exclusive with ``capacity_factor``.
      capacity_factor: capacity as a factor of the average load instead: each local expert's average rows times the
        factor, aligned, ``C_e = round_up(ceil(capacity_factor * num_dp * max_tokens * K / E), align)``; with
        ``capacity_per="rank"`` the rank keeps ``L * C_e`` rows (at most the worst case) pooled over its experts, with
        ``capacity_per="expert"`` each expert keeps ``C_e`` (as GShard, Switch and MaxText do). Training with a factor
        of 1.0 to 2.0 bounds ``expert_x`` and lets ``overflow="drop"`` drop what does not fit.
      capacity_per: what the capacity bounds. "rank" (default): the rows of all local experts together (pooled): one
        expert may keep more than its share when others get less; rows are packed in layout order and those from
        position ``capacity`` on do not fit. "expert": each local expert separately: expert l keeps the first ``C_e``
        of its rows in the receive layout's order, i.e. by (source DP group, source token): the lowest DP group's
        earliest tokens first; its later rows do not fit. ``expert_x`` then has ``min(L * C_e, worst_case_rows)``
        rows (``expert_capacity_for``) and the kept runs are packed as always (``group_sizes``).
      align: each local expert's row count is padded to a multiple of ``align``.
      overflow: what a dispatch does with rows that do not fit (see ``capacity_per``): "error" (default) fails the
        round trip with a capacity overflow MoECommError (combine gives NaN); "drop" drops them, as capacity-factor
        MoE training does: their slots contribute zero to combine, ``group_sizes`` count the rows kept and
        ``Dispatched.dropped_rows`` counts the rows dropped. The same rows on both backends.
    """

    num_experts: int
    experts_per_token: int
    hidden: int
    max_tokens: int
    dtype: Any = jnp.bfloat16
    scale_block: int | None = None
    out_dtype: Any = jnp.bfloat16
    dp_size: int = 1
    capacity: int | None = None
    align: int = 1
    capacity_factor: float | None = None
    overflow: str = "error"
    capacity_per: str = "rank"

    def __post_init__(self) -> None:
        set_ = lambda name, value: object.__setattr__(self, name, value)  # noqa: E731 (frozen dataclass)
        for name in ("num_experts", "experts_per_token", "hidden", "max_tokens", "dp_size", "align"):
            set_(name, _positive_int(name, getattr(self, name)))
        if self.experts_per_token > self.num_experts:
            raise ValueError(
                f"experts_per_token must be <= num_experts ({self.num_experts}), got {self.experts_per_token}"
            )
        set_("dtype", _canonical_dtype("dtype", self.dtype, PAYLOAD_DTYPES))
        set_("out_dtype", _canonical_dtype("out_dtype", self.out_dtype, OUT_DTYPES))
        if self.is_fp8:
            block = DEFAULT_SCALE_BLOCK if self.scale_block is None else self.scale_block
            block = _positive_int("scale_block", block)
            if self.hidden % block:
                raise ValueError(f"hidden ({self.hidden}) must be a multiple of scale_block ({block})")
            set_("scale_block", block)
        elif self.scale_block is not None:
            raise ValueError(f"scale_block is only for dtype float8_e4m3fn; got scale_block={self.scale_block!r} "
                             f"with dtype {self.dtype.name}")
        if self.capacity is not None:
            set_("capacity", _positive_int("capacity", self.capacity))
        if self.capacity_factor is not None:
            f = self.capacity_factor
            if isinstance(f, bool) or not isinstance(f, (int, float, np.integer, np.floating)) or not (
                    math.isfinite(f) and f > 0):
                raise ValueError(f"capacity_factor must be a positive number (times the average load), got {f!r}")
            if self.capacity is not None:
                raise ValueError("give capacity (rows) or capacity_factor (times the average load), not both; got "
                                 f"capacity={self.capacity} and capacity_factor={f!r}")
            set_("capacity_factor", float(f))
        if self.overflow not in OVERFLOW_POLICIES:
            raise ValueError(f"overflow must be one of {OVERFLOW_POLICIES}, got {self.overflow!r}")
        if self.capacity_per not in CAPACITY_PER:
            raise ValueError(f"capacity_per must be one of {CAPACITY_PER} (what capacity bounds: a rank's rows, pooled "
                             f"over its experts, or each expert's), got {self.capacity_per!r}")
        if self.capacity_per == "expert" and self.capacity is not None and self.capacity % self.align:
            raise ValueError(f"capacity ({self.capacity} rows per expert, capacity_per='expert') must be a multiple of "
                             f"align ({self.align}): give capacity={round_up(self.capacity, self.align)}")

    @property
    def is_fp8(self) -> bool:
        return self.dtype == np.dtype(jnp.float8_e4m3fn)

    @property
    def scale_cols(self) -> int:
        """Columns of the fp32 scale array: H // B for fp8, 0 otherwise."""
        return self.hidden // self.scale_block if self.is_fp8 else 0

    def num_dp(self, world: int) -> int:
        return world // self.dp_size

    def local_experts(self, world: int) -> int:
        return self.num_experts // world

    def worst_case_rows(self, world: int) -> int:
        """Most rows one rank can receive: every token of every DP group, once per local expert it picks,
        plus alignment padding of each local expert's group."""
        num_local = self.local_experts(world)
        rows = self.max_tokens * self.num_dp(world) * min(self.experts_per_token, num_local)
        if self.align > 1:
            rows = round_up(rows + num_local * (self.align - 1), self.align)
        return rows

    def _per_expert_from_factor(self, world: int) -> int:
        """C_e of ``capacity_factor``: each local expert's average rows times the factor, aligned."""
        average = self.num_dp(world) * self.max_tokens * self.experts_per_token / self.num_experts
        return round_up(max(1, math.ceil(self.capacity_factor * average)), self.align)

    def expert_capacity_for(self, world: int) -> int | None:
        """Rows each local expert keeps with ``capacity_per="expert"`` (``capacity`` if given, else from
        ``capacity_factor`` if given, else ``num_dp * max_tokens`` aligned: all it can get); None with "rank"."""
        if self.capacity_per != "expert":
            return None
        if self.capacity is not None:
            return self.capacity
        if self.capacity_factor is not None:
            return self._per_expert_from_factor(world)
        return round_up(self.num_dp(world) * self.max_tokens, self.align)

    def capacity_for(self, world: int) -> int:
        """Rows of ``expert_x``. capacity_per="rank": ``capacity`` if given, else from ``capacity_factor`` if given,
        else the worst case. "expert": ``L * expert_capacity_for(world)``, at most the worst case (which the kept
        rows never exceed)."""
        worst = self.worst_case_rows(world)
        if self.capacity_per == "expert":
            return min(self.local_experts(world) * self.expert_capacity_for(world), worst)
        if self.capacity is not None:
            return self.capacity
        if self.capacity_factor is None:
            return worst
        return min(self.local_experts(world) * self._per_expert_from_factor(world), worst)

    def _fixed_capacity(self, world: int) -> dict:
        """The capacity fields of a derived config with this one's capacities, without the factor."""
        fixed = self.expert_capacity_for(world) if self.capacity_per == "expert" else self.capacity_for(world)
        return dict(capacity=fixed, capacity_factor=None)

    def gradient_config(self, world: int, grad_dtype: Any) -> MoECommConfig:
        """The config of an fp8 layer's backward round trip (MoEComm's grad_dtype buffer set): the same routing,
        capacity and overflow policy, payload in grad_dtype."""
        return dataclasses.replace(self, dtype=grad_dtype, scale_block=None, **self._fixed_capacity(world))

    def weights_exchange_config(self, world: int) -> MoECommConfig:
        """The config of the backward's weights exchange (autodiff.py): the same routing, capacity and overflow policy,
        hence the same layout, with a float32 row of the token's K weights (padded to 4 columns) as the payload."""
        return dataclasses.replace(self, dtype=jnp.float32, out_dtype=jnp.float32, scale_block=None,
                                   hidden=round_up(self.experts_per_token, 4), **self._fixed_capacity(world))

    def validate_world(self, world: int, axis_name: str | tuple[str, ...]) -> None:
        """Checks that need the EP world size (the product of the EP axes' sizes); ValueError naming the argument
        otherwise."""
        axes = describe_axes(axis_name)
        if world % self.dp_size:
            raise ValueError(f"dp_size ({self.dp_size}) must divide the size of {axes} ({world})")
        if self.num_experts % world:
            raise ValueError(f"num_experts ({self.num_experts}) must be a multiple of the size of {axes} ({world})")
        if self.num_dp(world) * self.max_tokens * self.experts_per_token > _MAX_ORIGIN:
            raise ValueError("num_dp * max_tokens * experts_per_token must fit in int32")


CHECK_ERRORS = (True, False, "sync")
SEND_STREAMS = (None, "xla_async", "own")


def _threshold(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int (tokens per rank), got {value!r}")
    return int(value)


@dataclasses.dataclass(frozen=True)
class Options:
    """How one MoEComm runs its round trips: MoEComm's keyword arguments of the same names (documented there),
    validated. None of them changes what a round trip computes (staged, the thresholds and the window of
    max_symmetric_bytes give the same results bit for bit; the pre-reduction within the output dtype's rounding)."""

    check_errors: bool | str = True
    timeout_s: float = 30.0
    prereduce_min_tokens: int = 64
    ids_first_min_tokens: int = 1024
    low_latency_max_tokens: int = 0
    staged: bool = False
    max_symmetric_bytes: int | None = None
    max_sms: int | None = None
    send_stream: str | None = None

    def __post_init__(self) -> None:
        if self.check_errors not in CHECK_ERRORS or not isinstance(self.check_errors, (bool, str)):
            raise ValueError(f"check_errors must be True, False or 'sync', got {self.check_errors!r}")
        t = self.timeout_s
        if isinstance(t, bool) or not isinstance(t, (int, float, np.integer, np.floating)) or not 0 < t <= 86400:
            raise ValueError(f"timeout_s must be a number of seconds in (0, 86400], got {t!r}")
        object.__setattr__(self, "timeout_s", float(t))
        for name in ("prereduce_min_tokens", "ids_first_min_tokens", "low_latency_max_tokens"):
            object.__setattr__(self, name, _threshold(name, getattr(self, name)))
        if not isinstance(self.staged, bool):
            raise ValueError(f"staged must be a bool, got {self.staged!r}")
        m = self.max_symmetric_bytes
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1):
            raise ValueError(f"max_symmetric_bytes must be None or a positive int (bytes per GPU), got {m!r}")
        if m is not None:
            object.__setattr__(self, "max_symmetric_bytes", int(m))
        n = self.max_sms
        if n is not None and (isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1):
            raise ValueError(f"max_sms must be None or a positive int (SMs each kernel may use), got {n!r}")
        if n is not None:
            object.__setattr__(self, "max_sms", int(n))
        if not (self.send_stream is None or isinstance(self.send_stream, str)) or \
                self.send_stream not in SEND_STREAMS:
            raise ValueError(f"send_stream must be one of {SEND_STREAMS}, got {self.send_stream!r}")


@dataclasses.dataclass(frozen=True)
class Geometry:
    """Static sizes of one (config, EP world) pair, in the paper's notation, and the options of one MoEComm; shared
    by both backends.

    ``axis_name``: the EP axes, a tuple of one or more mesh axis names (MoEComm always gives a tuple, even for one
    axis), as the collectives and ``axis_index`` inside shard_map take them. A rank's EP index is the row-major
    index over them in this order; the coordinates of the other mesh axes select independent EP groups.
    """

    cfg: MoECommConfig
    world: int
    axis_name: tuple[str, ...]
    options: Options = Options()

    @property
    def check_errors(self) -> bool | str:
        return self.options.check_errors

    @property
    def T(self) -> int:  # noqa: N802 (paper notation)
        return self.cfg.max_tokens

    @property
    def K(self) -> int:  # noqa: N802
        return self.cfg.experts_per_token

    @property
    def L(self) -> int:  # noqa: N802
        return self.cfg.local_experts(self.world)

    @property
    def num_dp(self) -> int:
        return self.cfg.num_dp(self.world)

    @property
    def rows_per_peer(self) -> int:
        """Most rows one rank sends to one peer in either direction: each token of a DP group goes to at
        most min(K, L) experts of one rank."""
        return self.T * min(self.K, self.L)

    @property
    def capacity(self) -> int:
        return self.cfg.capacity_for(self.world)

    @property
    def expert_capacity(self) -> int | None:
        """Rows each local expert keeps (capacity_per="expert"), or None (pooled)."""
        return self.cfg.expert_capacity_for(self.world)
