"""The bench's floor probes (ffi/probe.cu, the measurement build only): what one direction of any round trip must at
least cost on this machine, timed under the bench's chains."""

from __future__ import annotations

import jax
import numpy as np
from jax import Array

from jax_moe_comm import _native, errors
from jax_moe_comm.nvshmem_backend import _STATUS, Plan, _call


def probe_exchange(plan: Plan, x: Array, flagged: bool = False) -> Array:
    """Per shard: x's bytes to the next rank, the previous rank's returned in x's shape and dtype (NVLink path). One
    kernel: the bytes on the link, a fence, a signal and its wait, no routing; flagged: the bytes in 8-byte words of 4
    data bytes and a flag the receiver polls, no fence and no signal (twice the bytes). x's size must be a multiple of
    16 bytes and at most max_tokens rows of the combine dtype (flagged: K / 2 times that); a MoEComm used for probes
    carries no round trips (the probe lands in its combine buffers). A peer that never arrives raises (reported under
    combine_recv, whose phase slot it uses)."""
    if not _native.ext.measurement_build():
        raise RuntimeError("the floor probes are in the measurement build only: build with JAX_MOE_COMM_MEASUREMENT=ON")
    out, status = _call("probe", (jax.ShapeDtypeStruct(x.shape, x.dtype), _STATUS), plan, x,
                        flagged=np.int64(flagged))
    errors.check_now(status, after=status)
    return out
