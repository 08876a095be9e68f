"""Merges bench records of one machine into one record (e.g. the launcher run and the single-process run).

    python benchmarks/merge.py OUT.json launcher.json:nvshmem,reference,padded single.json:ragged --note "..."

Each input is PATH[:backend,backend,...] (default: every backend in it). The output keeps the first input's fields
(date, commit, device, chain, ...), takes the named backends' rows from each input in order, joins the commands
with " ; " (each followed by its backends in brackets) and records the note.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("out")
    p.add_argument("inputs", nargs="+", metavar="PATH[:backends]")
    p.add_argument("--note", default="")
    args = p.parse_args(argv)
    merged, commands = None, []
    for item in args.inputs:
        path, _, names = item.partition(":")
        record = json.load(open(path))
        wanted = set(names.split(",")) if names else {row["backend"] for row in record["rows"]}
        rows = [row for row in record["rows"] if row["backend"] in wanted]
        commands.append(f"{record['command']}  [{', '.join(sorted(wanted))}; {record['processes']} process(es)]")
        if merged is None:
            merged = dict(record, rows=[])
        if record["commit"] != merged["commit"]:
            print(f"{path}: commit {record['commit']} differs from {merged['commit']}", file=sys.stderr)
            return 1
        merged["rows"] += rows
        merged["complete"] = merged["complete"] and record["complete"]
    merged["command"] = " ; ".join(commands)
    if args.note:
        merged["note"] = args.note
    with open(args.out, "w") as f:
        f.write(json.dumps(merged, indent=1) + "\n")
    print(f"wrote {args.out}: {len(merged['rows'])} rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
