"""The bench's record: where it ran, the command, and its rows as a table or a plot."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from .impls import ALL_BACKENDS


def git_commit() -> str:
    if os.environ.get("JMC_COMMIT"):
        return os.environ["JMC_COMMIT"]
    try:
        root = Path(__file__).resolve().parent.parent
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def command_line(argv: Sequence[str]) -> str:
    """The command that ran this (through the launcher: its command, rebuilt from the environment it sets)."""
    cmd = "-m jax_moe_comm.bench" + (" " + shlex.join(argv) if argv else "")
    if "JAX_PROCESS_ID" in os.environ:
        n = os.environ.get("JAX_LOCAL_WORLD", os.environ.get("JAX_NUM_PROCESSES", "?"))
        return f"python -m jax_moe_comm.launch -n {n} -- {cmd}"
    return f"python {cmd}"


def format_table(rows: list[dict]) -> str:
    """A plain-text table of the rows (times in microseconds); --overlap's columns where a row has them."""
    times = ["total_us", "dispatch_us", "combine_us"]
    if any(r.get("overlapped_us") is not None for r in rows):
        times += ["compute_us", "overlapped_us", "hidden_us"]
    head = ("config", "tokens", "backend", *times, "GB/s", "error")

    def num(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    label = lambda r: r["backend"] + (f"/{r['send_stream']}" if r.get("send_stream") else "")  # noqa: E731
    lines = [(r["config"], str(r["tokens"]), label(r), *(num(r.get(t)) for t in times), num(r.get("gbps"), 2),
              (r.get("error") or r.get("note") or "")[:70])
             for r in rows]
    widths = [max(len(h), *(len(line[i]) for line in lines)) if lines else len(h) for i, h in enumerate(head)]
    fmt = lambda cells: "  ".join(c.rjust(w) if 2 < i < len(head) - 1 else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths, strict=True))).rstrip()
    return "\n".join([fmt(head), fmt(["-" * w for w in widths])] + [fmt(line) for line in lines])


def plot_record(record: dict, path: str | Path) -> bool:
    """Latency vs tokens per backend, log-log, one panel per config; False (with a message) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return False
    configs = list(dict.fromkeys(r["config"] for r in record["rows"]))
    fig, axes = plt.subplots(1, max(1, len(configs)), figsize=(5.5 * max(1, len(configs)), 4.2), squeeze=False)
    for ax, config in zip(axes[0], configs, strict=False):
        rows = [r for r in record["rows"] if r["config"] == config and r.get("total_us")]
        for backend in sorted(dict.fromkeys(r["backend"] for r in rows), key=ALL_BACKENDS.index):
            pts = sorted((r["tokens"], r["total_us"]) for r in rows if r["backend"] == backend and r["total_us"] > 0)
            if pts:
                ax.plot(*zip(*pts, strict=True), marker="o", label=backend)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(config)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("dispatch + combine (µs)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"{record.get('device', '')}, world {record.get('world', '?')}, {record.get('date', '')[:10]}, "
                 f"commit {record.get('commit', '?')}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True
