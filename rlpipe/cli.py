"""`rlpipe`: the pipeline files and the diagnostics.

  rlpipe pipeline [--rounds N]         write dvc.yaml and rounds/rK/dvc.yaml from the code and params.yaml
  rlpipe params-reference             write docs/params.md, every params key with its default and meaning
  rlpipe prune --keep K [--remote R]  drop all but the latest K rounds' checkpoints (pushed to R first)
  rlpipe runs [--all-branches]        one row per experiment: preset, changed params, pass@1, wall time
  rlpipe plots-page [--check]         the offline page template of `dvc plots show`
  rlpipe compare [--round rK]         every preset's token coefficients on one round's cached batch
  rlpipe update-node --round rK --node-rank K   node K of round K's multi-node update (update.nnodes)
  rlpipe merge-lora runs/policy/rK OUT   a LoRA round merged into its base, as a plain checkpoint
  rlpipe check-expectations           the seed's expected-value claims on an exact tabular environment
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


def _pipeline(args) -> int:
    from rlpipe.config import default_params_path, load_params
    from rlpipe.errors import PipelineError
    from rlpipe.pipeline import set_rounds, stale_files, write_pipeline

    root = Path.cwd()
    try:
        if args.rounds is not None:
            set_rounds(default_params_path(), args.rounds)
        params = load_params()
    except PipelineError as err:
        print(f"rlpipe pipeline: {err}", file=sys.stderr)
        return 1
    if args.check:
        stale = stale_files(params, root)
        for path in stale:
            print(f"out of date: {path.relative_to(root)}", file=sys.stderr)
        return 1 if stale else 0
    changed = write_pipeline(params, root)
    for path in changed:
        print(f"wrote {path.relative_to(root)}" if path.exists() else f"removed {path.relative_to(root)}")
    print(f"the pipeline holds {params.rounds} rounds; nothing else changed" if not changed else
          f"the pipeline holds {params.rounds} rounds: commit these files (`git add dvc.yaml rounds params.yaml`)")
    return 0


def _params_reference(args) -> int:
    from rlpipe.config.reference import render_reference

    out = Path(args.out)
    text = render_reference()
    if args.check:
        current = out.read_text() if out.is_file() else ""
        if current != text:
            print(f"out of date: {out} (run `rlpipe params-reference`)", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(f"wrote {out}")
    return 0


def _prune(args) -> int:
    from rlpipe.config import load_params
    from rlpipe.errors import PipelineError
    from rlpipe.retention import clear, prune

    root = Path.cwd()
    if args.clear:
        print("forgot what was pruned: `dvc repro` will recompute it" if clear(root) else "nothing was pruned")
        return 0
    if args.keep is None:
        print("rlpipe prune: give --keep K (or --clear)", file=sys.stderr)
        return 2
    try:
        removed = prune(root, args.keep, load_params().rounds, args.remote)
    except PipelineError as err:
        print(err, file=sys.stderr)
        return 1
    for path in removed:
        print(f"removed {path}" + (f" (pushed to {args.remote})" if args.remote else ""))
    if removed:
        print("`dvc repro --allow-missing` skips the pruned rounds; `dvc pull rounds/rK/dvc.yaml:update` restores one")
    else:
        print(f"nothing to prune: at most {args.keep} rounds' checkpoints are on disk")
    return 0


def _runs(args) -> int:
    from rlpipe.errors import PipelineError
    from rlpipe.runs import main as runs

    try:
        print(runs(Path.cwd(), args.all_branches, not args.no_mlflow, args.wide, args.json), end="")
    except PipelineError as err:
        print(f"rlpipe runs: {err}", file=sys.stderr)
        return 1
    return 0


def _merge_lora(args) -> int:
    from rlpipe.errors import PipelineError
    from rlpipe.models.lora import merge_checkpoint

    try:
        merge_checkpoint(Path(args.checkpoint), Path(args.out))
    except (PipelineError, FileNotFoundError) as err:
        print(f"rlpipe merge-lora: {err}", file=sys.stderr)
        return 1
    print(f"wrote {args.out}: {args.checkpoint} merged into its base, a plain checkpoint (AutoModelForCausalLM, vLLM)")
    return 0


def _update_node(args) -> int:
    from rlpipe.config import load_params
    from rlpipe.errors import PipelineError
    from rlpipe.train.torchrun import run_node

    try:
        run_node(load_params(), args.round, args.node_rank)
    except PipelineError as err:
        print(f"rlpipe update-node: {err}", file=sys.stderr)
        return 1
    return 0


def _plots_page(args) -> int:
    from rlpipe.plots_page import main as plots_page

    return plots_page(Path.cwd(), args.check)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlpipe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    pipeline = sub.add_parser("pipeline", help="write the DVC pipeline files from the code and params.yaml",
                              description="Write dvc.yaml and rounds/r1..rN/dvc.yaml (N = rounds in params.yaml): each "
                                          "stage's params keys, library files and artifacts. Run it after changing "
                                          "`rounds` beyond the files, or after changing the library's imports.")
    pipeline.add_argument("--rounds", type=int, help="set `rounds` in params.yaml to N first")
    pipeline.add_argument("--check", action="store_true", help="write nothing; exit 1 if a file is out of date")
    pipeline.set_defaults(run=_pipeline)
    reference = sub.add_parser("params-reference", help="write docs/params.md from the params models",
                               description="Every params.yaml key with its type, default and meaning, from rlpipe/config/.")
    reference.add_argument("--out", default="docs/params.md", help="where to write it (default docs/params.md)")
    reference.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is out of date")
    reference.set_defaults(run=_params_reference)
    prune = sub.add_parser("prune", help="drop old rounds' checkpoints from the workspace and the local cache",
                           description="Keep r0 and the latest K rounds' checkpoints (policy, optimizer state, critic); "
                                       "remove the older ones from the workspace and the local DVC cache, after "
                                       "`dvc push` to --remote when given. The round tables stay.")
    prune.add_argument("--keep", type=int, help="rounds whose checkpoints stay on disk (at least 1)")
    prune.add_argument("--remote", help="a DVC remote to push the pruned checkpoints to first (`dvc remote list`)")
    prune.add_argument("--clear", action="store_true", help="forget what was pruned, so that `dvc repro` recomputes it")
    prune.set_defaults(run=_prune)
    runs = sub.add_parser("runs", help="one readable row per experiment: preset, changed params, pass@1, wall time",
                          description="One row per experiment (the workspace, its baseline commit and the commit's "
                                      "DVC experiments): the preset, the params changed against the baseline, "
                                      "held-out greedy pass@1 before and after with its standard error, pass@k, "
                                      "the rounds, and the wall time of its MLflow parent run. The full tables: "
                                      "`dvc exp show --csv`, runs/metrics/*.json.")
    runs.add_argument("--all-branches", action="store_true", help="every branch's experiments, not only HEAD's")
    runs.add_argument("--no-mlflow", action="store_true", help="do not read wall times from MLflow (faster)")
    runs.add_argument("--wide", action="store_true", help="list every changed param in full")
    runs.add_argument("--json", action="store_true", help="the rows as JSON, every field in full")
    runs.set_defaults(run=_runs)
    merge = sub.add_parser("merge-lora", help="write a LoRA round's policy merged into its base, as a plain checkpoint",
                           description="Write base + (alpha / r) B A of a LoRA checkpoint (model.lora; e.g. "
                                       "runs/policy/r6) as a plain save_pretrained directory with the tokenizer, "
                                       "which AutoModelForCausalLM and vLLM load without peft or the base. Run it "
                                       "from the project root: the adapters name their base runs/policy/r0 relative "
                                       "to it.")
    merge.add_argument("checkpoint", help="a round's LoRA policy directory, e.g. runs/policy/r6")
    merge.add_argument("out", help="the directory to write (replaced atomically)")
    merge.set_defaults(run=_merge_lora)
    page = sub.add_parser("plots-page", help="write the offline page template for dvc plots (.dvc/plots_page.html)",
                          description="Write .dvc/plots_page.html, the template `dvc plots show` and `dvc plots diff` use "
                                      "(.dvc/config: plots.html_template): DVC's page with Vega, Vega-Lite and "
                                      "vega-embed inlined, so that it works offline. Needs npm and its registry; "
                                      "each tarball is checked against its pinned integrity.")
    page.add_argument("--check", action="store_true", help="write nothing; exit 1 if the template is not what the pins give")
    page.set_defaults(run=_plots_page)
    compare = sub.add_parser("compare", help="compare every preset on one round's cached batch",
                             description="Score every algorithm preset on one round's cached batch "
                                         "(runs/rounds/<round>/batch.parquet): each preset's per-token "
                                         "coefficient (its loss's gradient weight by autograd), how it weights "
                                         "short against long and easy against hard responses. Writes a table and "
                                         "plots to --out and logs them to MLflow.")
    compare.add_argument("--round", help="round name (default: the first round)")
    compare.add_argument("--params", default="params.yaml",
                         help="the params file whose round names and max_new_tokens apply (default params.yaml)")
    compare.add_argument("--out", help="output directory (default runs/compare/<round>)")
    compare.add_argument("--no-mlflow", action="store_true", help="do not log the report to MLflow")
    compare.set_defaults(run=_compare)
    node = sub.add_parser("update-node", help="run one other node of a round's multi-node update (update.nnodes)",
                          description="Start this machine's torchrun agent for round --round's update as node "
                                      "--node-rank (1..update.nnodes-1), with update.nproc processes; it waits "
                                      "at update.rdzv_endpoint (up to update.rdzv_timeout seconds) for node 0, "
                                      "the machine whose `dvc repro` runs the update stage, and returns when the "
                                      "update ends. Run it in the same checkout and params.yaml as node 0, on a "
                                      "shared filesystem; once per round (README, 'Multi-node updates').")
    node.add_argument("--round", required=True, help="round name, e.g. r3")
    node.add_argument("--node-rank", type=int, required=True, help="this machine's node rank, 1..update.nnodes-1")
    node.set_defaults(run=_update_node)
    check = sub.add_parser("check-expectations", help="check the expected-value claims on an exact environment",
                           description="Check each preset's expected-value claim (unbiased, scaled by (M-1)/M, by about "
                                       "1/sigma, weighted by w(p)) on a tabular environment where the exact policy "
                                       "gradient comes from enumeration: each preset's expected gradient, estimated "
                                       "by Monte Carlo over --groups groups of --samples responses, against the "
                                       "exact one (docs/algorithms.md, 'Expected-value properties'). Exits 1 if a "
                                       "claim fails; writes a table and a plot to --out.")
    check.add_argument("--samples", type=int, default=4, help="M, samples per prompt (default 4)")
    check.add_argument("--groups", type=int, default=20000,
                       help="Monte-Carlo groups per prompt; more narrows the estimate's error bars (default 20000)")
    check.add_argument("--seed", type=int, default=0, help="seed of the Monte-Carlo draws (default 0)")
    check.add_argument("--out", default="runs/expectations", help="where the table and plot go (default runs/expectations)")
    check.set_defaults(run=_check_expectations)
    args = parser.parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
