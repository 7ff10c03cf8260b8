"""`rlpipe`: the diagnostics command line.

  rlpipe compare [--round rK]          every preset's token coefficients on one round's cached batch
  rlpipe check-expectations            the seed's expected-value claims on an exact tabular environment
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _compare(args) -> int:
    from rlpipe import paths
    from rlpipe.config import load_params
    from rlpipe.diagnostics.compare import compare_round
    from rlpipe.errors import PipelineError
    from rlpipe.tracking.client import StageTracker

    try:
        params = load_params(args.params)
        round_name = args.round or params.round_names[0]
        out_dir = Path(args.out) if args.out else paths.PLOTS.parent / "compare" / round_name
        rows, files = compare_round(paths.batch_path(round_name), out_dir, params.rollout.max_new_tokens)
    except PipelineError as err:
        print(f"rlpipe compare: {err}", file=sys.stderr)
        return 1
    print((out_dir / "compare.md").read_text())
    if not args.no_mlflow:
        tracker = StageTracker(params, f"compare@{round_name}", round_name)
        for path in files:
            tracker.log_artifact(path, "compare")
        tracker.log_metrics({f"compare/{r['preset']}/{k}": v for r in rows for k, v in r.items()
                             if isinstance(v, float) and v == v})
        tracker.close(failed=False)
    print(f"wrote {', '.join(str(f) for f in files)}")
    return 0


def _check_expectations(args) -> int:
    from rlpipe.diagnostics.expectations import check_expectations, format_table, plot_expectations

    rows = check_expectations(m=args.samples, groups_per_prompt=args.groups, seed=args.seed)
    table = format_table(rows)
    print(table)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "expectations.md").write_text(table + "\n")
    plot_expectations(rows, args.samples, out_dir / "expectations.png")
    print(f"wrote {out_dir / 'expectations.md'}, {out_dir / 'expectations.png'}")
    failed = [r.preset for r in rows if r.holds is False]
    if failed:
        print(f"claims that do not hold: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    compare = sub.add_parser("compare", help="compare every preset on one round's cached batch")
    compare.add_argument("--round", help="round name (default: the first round)")
    compare.add_argument("--params", default="params.yaml")
    compare.add_argument("--out", help="output directory (default runs/compare/<round>)")
    compare.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    compare.set_defaults(run=_compare)
    check = sub.add_parser("check-expectations", help="check the expected-value claims on an exact environment")
    check.add_argument("--samples", type=int, default=4, help="M, samples per prompt (default 4)")
    check.add_argument("--groups", type=int, default=20000, help="Monte-Carlo groups per prompt")
    check.add_argument("--seed", type=int, default=0)
    check.add_argument("--out", default="runs/expectations", help="where the table and plot go (default runs/expectations)")
    check.set_defaults(run=_check_expectations)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
