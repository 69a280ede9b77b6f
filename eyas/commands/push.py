"""eyas push: upload an exported head to the Hugging Face Hub with a generated model card.

Only config.json, model.safetensors and README.md are uploaded (one commit). The head is
validated first. The token comes from HF_TOKEN or `hf auth login`; it is never printed.

examples:
  eyas push runs/x/export --repo-id my-org/smollm2-135m-eagle3 --dry-run
  eyas push runs/x/export --repo-id my-org/smollm2-135m-eagle3 --private \
      --eval-report runs/x/eval/eval_report.json
  eyas push -r recipes/smollm2-135m-eagle3.yaml          (dir = run_dir/export, repo = export.repo_id)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from eyas.commands._common import CommandError, load_recipe_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", nargs="?", help="exported head directory (default: run_dir/export)")
    parser.add_argument("--recipe", "-r", help="YAML recipe: defaults DIR, --repo-id and --private")
    parser.add_argument("--repo-id", help="Hub repo ORG/NAME (default: export.repo_id of the recipe)")
    parser.add_argument("--private", action="store_true", default=None, help="create the repo private")
    parser.add_argument("--revision", help="branch to push to (created when missing)")
    parser.add_argument("--eval-report", help="eval report JSON for the card (default: DIR/eval_report.json)")
    parser.add_argument(
        "--dry-run", action="store_true", help="show what would be uploaded and the card; upload nothing"
    )
    parser.add_argument("overrides", nargs="*", default=[], metavar="key.sub=value", help=argparse.SUPPRESS)


def run(args: argparse.Namespace) -> int:
    from eyas.export.hub import PushError, plan_push, push_head
    from eyas.export.validate import validate_export

    if args.dir and "=" in args.dir and not Path(args.dir).is_dir():  # an override, not DIR
        args.overrides, args.dir = [args.dir, *args.overrides], None
    head_dir, repo_id, private = args.dir, args.repo_id, args.private
    if args.recipe or not (head_dir and repo_id):
        recipe = load_recipe_from_args(args)
        head_dir = head_dir or str(recipe.paths.export)
        repo_id = repo_id or recipe.export.repo_id
        private = recipe.export.private if private is None else private
    if not repo_id:
        raise CommandError("no --repo-id (and the recipe has no export.repo_id)", code=2)
    problems = validate_export(head_dir)
    if problems:
        listed = "".join(f"\n  - {p}" for p in problems)
        raise CommandError(f"{head_dir} breaks the serving contract; not uploading:{listed}")
    try:
        plan = plan_push(
            head_dir, repo_id, private=bool(private), revision=args.revision, eval_report=args.eval_report
        )
    except (PushError, ValueError, FileNotFoundError) as err:
        raise CommandError(str(err)) from None
    if args.dry_run:
        print("dry run: nothing uploaded. Would upload:")
        print(plan.describe())
        print("\n--- README.md ---")
        print(plan.card)
        return 0
    try:
        url = push_head(plan)
    except PushError as err:
        raise CommandError(str(err)) from None
    print(plan.describe())
    print(f"pushed: {url}")
    return 0
