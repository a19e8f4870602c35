"""``python -m bench``: every scenario against its baselines; writes results.json and a table.

    python -m bench                          # all scenarios (what `make bench` runs)
    python -m bench --only recovery,hang     # some of them
    python -m bench --quick                  # fewer steps and repetitions, smaller sizes
    python -m bench --table-only bench/results.json   # rebuild the table from results

A full run writes ``bench/results.json`` and ``bench/results.md``; ``--only`` and
``--quick`` write to ``bench/out/`` unless ``--out`` says otherwise, so a partial run
never replaces the full results.
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import load_average, machine, markdown
from bench.suite import FULL, QUICK, SCENARIOS, Context

BENCH = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n")[0])
    parser.add_argument(
        "--only", default="", help=f"comma-separated scenarios among {', '.join(SCENARIOS)}"
    )
    parser.add_argument("--quick", action="store_true", help="a fast pass for development")
    parser.add_argument("--out", type=Path, default=None, help="results JSON (and .md beside it)")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    parser.add_argument("--table-only", type=Path, default=None, metavar="RESULTS_JSON")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        parser.error(f"--only: unknown scenario(s) {', '.join(unknown)}; one of {list(SCENARIOS)}")
    args.scenarios = only or list(SCENARIOS)
    if args.out is None:
        partial = bool(only) or args.quick
        args.out = BENCH / ("out/results.json" if partial else "results.json")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table_only is not None:
        print(markdown(json.loads(args.table_only.read_text())), end="")
        return 0
    settings = QUICK if args.quick else FULL
    workdir = Path(tempfile.mkdtemp(prefix="tg-bench-", dir="/var/tmp"))
    began = time.monotonic()

    def log(message: str) -> None:
        print(f"[bench {time.monotonic() - began:6.0f}s] {message}", file=sys.stderr, flush=True)

    results: dict[str, Any] = {
        "command": "python -m bench " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "machine": machine(),
        "settings": settings.to_json(),
        "load_before": load_average(),
    }
    ctx = Context(settings, workdir, log)
    log(f"work directory {workdir}; scenarios {', '.join(args.scenarios)}")
    try:
        for name in args.scenarios:
            started = time.monotonic()
            log(f"{name} ...")
            results[name] = SCENARIOS[name](ctx)
            results[name]["wall_s"] = time.monotonic() - started
            log(f"{name} done in {results[name]['wall_s']:.0f} s")
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    results["load_after"] = load_average()
    results["wall_s"] = time.monotonic() - began
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2) + "\n")
    table = markdown(results)
    args.out.with_suffix(".md").write_text(table)
    print(table, end="")
    log(f"wrote {args.out} and {args.out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
