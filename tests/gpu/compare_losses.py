"""Compares the training losses of two runs of jax_moe_comm.examples.train (--log-json files).

    python tests/gpu/compare_losses.py nvshmem.json reference.json [--rtol 1e-2]

Prints the largest relative difference of the per-step train losses and of the held-out losses; exits 1 when it
exceeds rtol (default 1e-2, bfloat16's tolerance) or when either run failed to halve its held-out loss.
"""

from __future__ import annotations

import argparse
import json
import sys


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs=2)
    p.add_argument("--rtol", type=float, default=1e-2)
    args = p.parse_args()
    a, b = (json.load(open(path)) for path in args.runs)
    if len(a["train_loss"]) != len(b["train_loss"]):
        print(f"different step counts: {len(a['train_loss'])} vs {len(b['train_loss'])}")
        return 1
    train = max(abs(x - y) / abs(y) for x, y in zip(a["train_loss"], b["train_loss"], strict=True))
    held = max(abs(x["loss"] - y["loss"]) / abs(y["loss"]) for x, y in zip(a["eval_loss"], b["eval_loss"],
                                                                           strict=True))
    ok = train <= args.rtol and held <= args.rtol and a["passed"] and b["passed"]
    print(f"{a['backend']} vs {b['backend']}, {len(a['train_loss'])} steps: train loss max rel diff {train:.1e}, "
          f"held-out {held:.1e} (rtol {args.rtol:.0e}); held-out loss {a['initial_loss']:.4f} -> "
          f"{a['final_loss']:.4f} vs {b['initial_loss']:.4f} -> {b['final_loss']:.4f}  {'PASS' if ok else 'FAIL'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
