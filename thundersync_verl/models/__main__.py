"""Command line for the tiny models: ``python -m thundersync_verl.models {--rebuild,build,eval,path}``.

1. ``build`` installs the shipped student and teacher into the cache (or builds them when the
   shipped copy does not match the specs) and prints their paths as JSON. ``--rebuild`` always
   builds both from scratch; ``--rebuild --ship`` then replaces the package's shipped copy.
2. ``eval`` samples a model on held-out problems with the sandboxed agent loop and prints the
   reward report as JSON (the figure quoted when deciding whether RL has room to improve).
3. ``path`` prints where the models live without building anything.
"""

from __future__ import annotations

import argparse
import json
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m thundersync_verl.models", description=__doc__.splitlines()[0])
    parser.add_argument("--rebuild", action="store_true", help="build both models from scratch into the cache")
    parser.add_argument("--ship", action="store_true", help="with --rebuild: copy them into the package (shipped/)")
    parser.add_argument("--seed", type=int, default=0, help="with --rebuild: the build seed (shipped models: 0)")
    sub = parser.add_subparsers(dest="command")
    build = sub.add_parser("build", help="install the shipped student and teacher (or build them) if missing")
    build.add_argument("--cache-dir", default=None, help="root folder (default: $THUNDERSYNC_MODEL_DIR or ~/.cache/...)")
    build.add_argument("--force", action="store_true", help="rebuild even if present")
    build.add_argument("--quiet", action="store_true")
    evaluate = sub.add_parser("eval", help="reward of a model under sampling")
    evaluate.add_argument("model", help="'student', 'teacher' or a model folder")
    evaluate.add_argument("--n-problems", type=int, default=200)
    evaluate.add_argument("--seed", type=int, default=0)
    evaluate.add_argument("--temperature", type=float, default=1.0)
    evaluate.add_argument("--cache-dir", default=None)
    path = sub.add_parser("path", help="print the model folders without building")
    path.add_argument("--cache-dir", default=None)
    args = parser.parse_args(argv)
    if args.rebuild == (args.command is not None) or (args.ship and not args.rebuild):
        parser.error("give either --rebuild [--ship] or one of the commands build, eval, path")

    from thundersync_verl.models.factory import default_root, ensure_tiny_models
    from thundersync_verl.models.variants import version_hash

    if args.rebuild:
        paths = ensure_tiny_models(force=True, seed=args.seed)
        if args.ship:
            from thundersync_verl.models.shipped import ship

            print(f"shipped into {ship(paths, seed=args.seed)}", file=sys.stderr)
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    elif args.command == "build":
        paths = ensure_tiny_models(args.cache_dir, force=args.force, progress=not args.quiet)
        print(json.dumps({k: str(v) for k, v in paths.items()}))
    elif args.command == "path":
        from pathlib import Path

        root = Path(args.cache_dir) if args.cache_dir else default_root()
        print(json.dumps({k: str(root / version_hash() / k) for k in ("student", "teacher")}))
    else:
        import torch

        from thundersync_verl.models.evaluate import evaluate_policy

        torch.set_num_threads(2)
        model = args.model
        if model in ("student", "teacher"):
            model = ensure_tiny_models(args.cache_dir)[model]
        report = evaluate_policy(model, args.n_problems, args.seed, temperature=args.temperature)
        print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
