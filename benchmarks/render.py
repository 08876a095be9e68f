"""Render a benchmark record (JSON from ``python -m jax_moe_comm.bench --json``) into a README table and a plot.

    python benchmarks/render.py                       # newest record in benchmarks/results/
    python benchmarks/render.py path/to/record.json --readme README.md --png benchmarks/latest.png

The markdown table replaces whatever sits between ``<!-- bench:begin -->`` and ``<!-- bench:end -->`` in the README
(default: the project's README.md). Without the markers the table is only printed. Rows: config x tokens per rank;
columns: round-trip microseconds per backend, then the speed-up of nvshmem over padded and over ragged when both
are in the record. The PNG (needs matplotlib) shows latency vs tokens per backend, log-log, one panel per config.
The table needs only the standard library; the plot uses the bench's (jax_moe_comm and matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
BACKEND_ORDER = ("nvshmem", "nvshmem_unchecked", "floor", "floor_flagged", "reference", "ragged", "padded")


def newest_record(results: Path) -> Path:
    """The record in `results` with the latest "date" (file modification time breaks ties and unreadable dates)."""
    paths = sorted(results.glob("*.json"))
    if not paths:
        raise FileNotFoundError(f"no *.json record in {results}")

    def key(path: Path):
        try:
            date = str(json.loads(path.read_text()).get("date", ""))
        except (OSError, ValueError):
            date = ""
        return (date, os.path.getmtime(path))

    return max(paths, key=key)


def _backends(rows: list[dict]) -> list[str]:
    present = list(dict.fromkeys(r["backend"] for r in rows))
    return sorted(present, key=lambda b: (BACKEND_ORDER.index(b) if b in BACKEND_ORDER else len(BACKEND_ORDER), b))


def _us(value) -> str:
    if value is None:
        return "—"
    return f"{value:,.0f}" if value >= 1000 else f"{value:.1f}"


def markdown_table(record: dict, source: str | None = None) -> str:
    """The header line, the table, and the distinct errors below it. ``source``: the record's path, named in the
    header instead of its (long) command."""
    rows = record["rows"]
    backends = _backends(rows)
    by_key = {(r["config"], r["tokens"], r["backend"]): r for r in rows}
    speedups = [b for b in ("padded", "ragged") if "nvshmem" in backends and b in backends]

    head = ["config", "tokens/rank"] + [f"{b} µs" for b in backends] + [f"nvshmem vs {b}" for b in speedups]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(["---", "---:"] + ["---:"] * (len(head) - 2)) + "|"]
    errors: dict[str, str] = {}
    for config, tokens in dict.fromkeys((r["config"], r["tokens"]) for r in rows):
        cells = [config, str(tokens)]
        for b in backends:
            r = by_key.get((config, tokens, b))
            if r is None:
                cells.append("")
            elif r.get("total_us") is None:
                cells.append("error")
                errors.setdefault(b, f"{config} tokens {tokens}: {r.get('error', 'no time')}")
            else:
                cells.append(_us(r["total_us"]) + (" *" if r.get("error") else ""))
                if r.get("error"):
                    errors.setdefault(b, f"{config} tokens {tokens}: {r['error']}")
        nv = by_key.get((config, tokens, "nvshmem"), {}).get("total_us")
        for b in speedups:
            other = by_key.get((config, tokens, b), {}).get("total_us")
            cells.append(f"{other / nv:.2f}×" if nv and other else "—")
        lines.append("| " + " | ".join(cells) + " |")

    header = (f"Dispatch + combine round trip, µs per round trip (median; lower is better). "
              f"{record.get('date', '?')}, {record.get('device', '?')} (world {record.get('world', '?')}), "
              f"jax {record.get('jax', '?')}, commit `{record.get('commit', '?')}`, "
              + (f"record `{source}` (its command inside)." if source else f"command `{record.get('command', '?')}`."))
    if record.get("check_errors") is False:
        header += " MoEComm backends timed with `check_errors=False` (`--no-check`)."
    if record.get("weights_to") == "dispatch":
        header += " The MoEComm backends got the top-k weights with dispatch (`--weights-to dispatch`)."
    if record.get("note"):
        header += f" Note: {record['note']}"
    text = [header, "", *lines]
    if errors:
        text += ["", "Errors (first per backend; `*` marks a time whose row also reports an error):", ""]
        text += [f"- {b}: {msg}" for b, msg in errors.items()]
    return "\n".join(text)


def _shown_path(path: Path) -> str:
    """The record's path relative to the project (as the README names it), else as given."""
    try:
        return str(path.resolve().relative_to(HERE.parent))
    except ValueError:
        return str(path)


def update_readme(readme: Path, table: str) -> bool:
    """Replaces the text between the markers; False when the file or a marker is missing."""
    if not readme.is_file():
        return False
    text = readme.read_text()
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        return False
    readme.write_text(text[: start + len(BEGIN)] + "\n" + table + "\n" + text[end:])
    return True


def plot(record: dict, png: Path) -> bool:
    """Latency vs tokens per backend, log-log, one panel per config (the bench's own plot); False without
    matplotlib."""
    from jax_moe_comm.bench import plot_record

    return plot_record(record, png)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("record", nargs="?", help="record JSON (default: the newest in --results)")
    p.add_argument("--results", default=str(HERE / "results"), help="folder of records (default benchmarks/results)")
    p.add_argument("--readme", default=str(HERE.parent / "README.md"),
                   help="README with the markers (default: the project's README.md)")
    p.add_argument("--png", default=str(HERE / "latest.png"), help="plot to write (default benchmarks/latest.png)")
    args = p.parse_args(argv)

    path = Path(args.record) if args.record else newest_record(Path(args.results))
    record = json.loads(path.read_text())
    table = markdown_table(record, _shown_path(path))
    print(table)
    print()
    if update_readme(Path(args.readme), table):
        print(f"updated the table in {args.readme} from {path}")
    else:
        print(f"{args.readme} has no {BEGIN} ... {END} markers (or does not exist): table printed only")
    if plot(record, Path(args.png)):
        print(f"wrote {args.png}")
    else:
        print("matplotlib is not installed: no plot written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
