"""The ``thundersync`` console command.

Subcommands: ``demo`` (the embedded CPU run of verl), ``build-model`` (tiny models),
``simulate`` / ``plan`` (the pipeline simulator), ``recipes check`` (compose and validate every recipe).
Heavy imports happen per subcommand.
"""

from __future__ import annotations

import argparse
import sys


def _demo(args) -> int:
    from thundersync_verl.demo import run_demo

    run_demo(algo=args.algo, mode=args.mode, steps=args.steps, work_dir=args.work_dir, extra=args.overrides,
             results_dir=args.results_dir)
    return 0


def _build_model(args) -> int:
    from thundersync_verl.models import ensure_tiny_models

    paths = ensure_tiny_models(force=args.force, progress=True)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


def _sim(argv: list[str]) -> int:
    from thundersync_verl.sim.sim_cli import main as sim_main

    return int(sim_main(argv) or 0)


def _recipes(argv: list[str]) -> int:
    from thundersync_verl.recipes.check import main as recipes_main

    return recipes_main(argv)


def build_parser() -> argparse.ArgumentParser:
    from thundersync_verl.run.results import add_results_dir_argument

    from thundersync_verl.cli_args import Parser, positive_int

    parser = Parser(prog="thundersync", description="Zero-staleness streaming RL for verl")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="run stock verl.trainer.main_ppo on the embedded CPU task")
    demo.add_argument("--algo", default="grpo", choices=["grpo", "opd"], help="opd: on-policy distillation from the tiny teacher")
    demo.add_argument("--mode", default="thundersync", choices=["sync", "async", "fully_async", "thundersync"])
    demo.add_argument("--steps", type=positive_int, default=20, help="training steps (1 or more)")
    demo.add_argument("--work-dir", default="runs/demo")
    add_results_dir_argument(demo)
    demo.add_argument("overrides", nargs="*", help="extra hydra overrides passed to verl, e.g. data.train_batch_size=16")
    demo.set_defaults(func=_demo)
    build = sub.add_parser("build-model", help="build the tiny student/teacher models (offline, deterministic)")
    build.add_argument("--force", action="store_true")
    build.set_defaults(func=_build_model)
    for name in ("simulate", "plan"):
        sub.add_parser(name, help=f"pipeline simulator: {name} (see `thundersync {name} --help`)", add_help=False)
    sub.add_parser("recipes", help="`recipes check`: compose and validate every recipe under recipes/ (no launch, no GPU)",
                   add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("simulate", "plan"):
        return _sim(argv)
    if argv and argv[0] == "recipes":
        return _recipes(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
