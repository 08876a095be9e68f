"""The CUDA extension's host API where it needs no GPU: launch_phase checks its arguments before any launch."""

import pytest

from jax_moe_comm import _native

pytestmark = pytest.mark.skipif(_native.ext is None, reason="CPU-only install: the CUDA extension was not built")


def test_launch_phase_rejects_an_unknown_phase():
    with pytest.raises(ValueError, match="unknown phase dispatch_all"):
        _native.ext.launch_phase(0, "dispatch_all", {}, 0)


@pytest.mark.parametrize("phase, first_missing", [
    ("dispatch_send", "x"), ("dispatch_recv", "expert_x"), ("combine_send", "expert_y"), ("combine_recv", "topk_ids"),
    ("dispatch", "x"), ("combine", "expert_y"),  # the fused halves
])
def test_launch_phase_names_a_missing_argument_before_launching(phase, first_missing):
    with pytest.raises(ValueError, match=f"missing argument {first_missing}"):
        _native.ext.launch_phase(0, phase, {}, 0)
