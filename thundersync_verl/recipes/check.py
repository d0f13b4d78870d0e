"""``thundersync recipes check``: every shipped recipe, composed with verl's own config tree and
checked as a launch would check it, with nothing launched and no GPU needed.

Why this module exists:
1. A recipe error found on a cluster costs a node-hour (a misspelt key verl ignores, a TP x PP
   that does not divide the learner GPUs, a ThunderSync rule); composing it here takes a second.
2. Each rule stays with its owner: verl's dataclass configs (types, their ``__post_init__`` rules,
   ``validate_config``), the asserts of verl's trainers, ThunderSync's ``ThunderSyncConfig.from_verl``
   and ``validate_thundersync_config``, and the learner's own (``learner/engine_rules.py``: the streaming
   learner's refusals, the worker's actor-config validation, the verl engine rules it meets at its first
   step). ``recipes.rules`` adds only what nothing checks before a launch: unknown keys, parallel sizes
   against GPU counts, batch divisibility, registered names.
3. A recipe is a yaml with a ``defaults:`` list. The options of every config group it selects from
   its own folder (``mode/``, ``shape/``, ``layout/`` ...) are expanded as a product, so every
   variant a user can launch is checked, not only the default one; each variant counts as a recipe.
4. Paths come from the environment (``${oc.env:MODEL_PATH}``): unset variables are filled with a
   placeholder for the check and listed in the JSON, so no cluster path is needed here.
5. Output: ONE JSON line on stdout (``learner_checked``: the variants whose learner-level rules ran), one
   line per invalid variant on stderr; exit code 0 only when
   every variant is valid, 2 for bad arguments (a one-line usage error).
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import re
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from thundersync_verl.recipes import rules as recipe_rules

DEFAULT_ROOT = Path(__file__).resolve().parents[2] / "recipes"  # the checkout's recipes/ (this file: thundersync_verl/recipes/)
USAGE = "usage: thundersync recipes check [--root DIR] [--only TEXT] [--verbose] [--list-losses]"
_ENV_REF = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)")


@dataclass(frozen=True)
class Variant:
    """One launchable configuration: a recipe file plus one option of each of its own config groups."""

    recipe: Path
    choices: tuple[tuple[str, str], ...] = ()
    extra: tuple[str, ...] = ()  # further hydra overrides, as a launcher would pass them

    @property
    def overrides(self) -> list[str]:
        return [f"{group}={option}" for group, option in self.choices] + list(self.extra)

    def launcher_overrides(self) -> list[str]:
        """A placeholder for each path the recipe leaves to its launcher (``???``): verl's own default
        would otherwise stand in, since hydra does not let ``???`` replace a value."""
        from omegaconf import OmegaConf

        out = []

        def walk(node, path: str) -> None:
            for key in node:
                where = f"{path}.{key}" if path else str(key)
                if OmegaConf.is_missing(node, key):
                    if where.endswith(recipe_rules.LAUNCHER_KEYS):
                        out.append(f"++{where}='<set by the launcher>'")
                elif OmegaConf.is_dict(node._get_node(key)):
                    walk(node._get_node(key), where)
        for path in self.global_files():
            doc = OmegaConf.load(path)
            walk(OmegaConf.masked_copy(doc, [k for k in doc if k not in ("hydra", "defaults")]), "")
        return list(dict.fromkeys(out))

    def global_files(self) -> list[Path]:
        """The recipe and the options its defaults list selects from its own folders at the global package
        (``cpu_base: tiny`` -> cpu_base/tiny.yaml): the files whose keys sit at the config's top level."""
        files = [self.recipe]
        for entry in _defaults_list(self.recipe) or []:
            if isinstance(entry, dict):
                for group, option in entry.items():
                    path = self.recipe.parent / str(group).split()[-1].split("@")[0] / f"{option}.yaml"
                    if path.is_file() and path.read_text().startswith("# @package _global_"):
                        files.append(path)
        return files

    def name(self, root: Path) -> str:
        try:
            rel = self.recipe.relative_to(root).with_suffix("")
        except ValueError:
            rel = self.recipe.with_suffix("")
        return f"{rel}[{','.join(self.overrides)}]" if self.overrides else str(rel)


@dataclass
class Verdict:
    variant: Variant
    problems: list[str] = field(default_factory=list)
    facts: dict = field(default_factory=dict)

    @property
    def valid(self) -> bool:
        return not self.problems


# ----- discovery -------------------------------------------------------------------------------
def _defaults_list(path: Path) -> list | None:
    import yaml

    try:
        doc = yaml.safe_load(path.read_text())
    except yaml.YAMLError:
        return []  # a yaml that does not parse is reported by composing it
    return doc.get("defaults") if isinstance(doc, dict) and isinstance(doc.get("defaults"), list) else None


def _own_groups(recipe: Path, defaults: list) -> list[str]:
    """Config groups the defaults list selects from folders next to the recipe (``mode: sync`` -> mode/)."""
    groups = []
    for entry in defaults:
        if not isinstance(entry, dict):
            continue
        for key in entry:
            group = str(key).split()[-1].split("@")[0]  # "override mode@_global_" -> "mode"
            if (recipe.parent / group).is_dir() and group not in groups:
                groups.append(group)
    return groups


def find_variants(root: Path) -> tuple[list[Variant], list[Path]]:
    """Every variant of every recipe under ``root``, and the yaml files that are neither."""
    yamls = sorted(root.rglob("*.yaml"))
    with_defaults = {p: d for p in yamls if (d := _defaults_list(p)) is not None}
    group_dirs = {p.parent / g for p, d in with_defaults.items() for g in _own_groups(p, d)}
    recipes = [p for p in with_defaults if not any(p.is_relative_to(g) for g in group_dirs)]
    used, variants = set(recipes), []
    for recipe in recipes:
        axes = []
        for group in _own_groups(recipe, with_defaults[recipe]):
            options = sorted((recipe.parent / group).glob("*.yaml"))
            used.update(options)
            if len(options) > 1:  # a one-option group is composed through the defaults list as it stands
                axes.append([(group, o.stem) for o in options])
        variants += [Variant(recipe, combo) for combo in itertools.product(*axes)]
    return variants, [p for p in yamls if p not in used]


# ----- composition -----------------------------------------------------------------------------
@contextlib.contextmanager
def _placeholder_env(names: set[str]):
    """Unset environment variables the recipes read, set to a visible placeholder for the check."""
    added = {n: f"<{n}>" for n in names if n not in os.environ}
    os.environ.update(added)
    try:
        yield sorted(added)
    finally:
        for name in added:
            os.environ.pop(name, None)


def _compose_all(variants: list[Variant]) -> list:
    """verl's config of each variant (or the exception composing it raised), as
    ``main_ppo --config-path <dir> --config-name <recipe> <overrides>`` builds it. One hydra
    context per recipe folder: its config repository caches the yaml files across variants."""
    from hydra import compose, initialize_config_dir

    results: list = [None] * len(variants)
    for folder in dict.fromkeys(v.recipe.parent for v in variants):
        with initialize_config_dir(config_dir=str(folder), version_base=None):
            for i, v in enumerate(variants):
                if v.recipe.parent == folder:
                    try:
                        results[i] = compose(config_name=v.recipe.stem, overrides=v.launcher_overrides() + v.overrides)
                    except Exception as err:  # hydra: a missing option, a bad override, a yaml error
                        results[i] = err
    return results


def _judge(variant: Variant, cfg) -> Verdict:
    """Run every rule on one composed variant; never raises for a bad recipe."""
    from omegaconf import OmegaConf

    verdict = Verdict(variant)
    if isinstance(cfg, Exception):
        verdict.problems.append(f"composition: {recipe_rules.one_line(cfg)}")
        return verdict
    env = set(_ENV_REF.findall(json.dumps(OmegaConf.to_container(cfg, resolve=False), default=str)))
    with _placeholder_env(env) as placeholders, warnings.catch_warnings():
        warnings.simplefilter("ignore")
        verdict.facts.update(env=sorted(env), env_placeholders=placeholders)
        try:
            raw = OmegaConf.to_container(cfg, resolve=True, throw_on_missing=False)
        except Exception as err:  # an interpolation that does not resolve names its key
            verdict.problems.append(f"interpolation: {recipe_rules.one_line(err)}")
            return verdict
        verdict.problems += recipe_rules.check(raw, verdict.facts)
    return verdict


def check_variants(variants: list[Variant]) -> list[Verdict]:
    return [_judge(v, cfg) for v, cfg in zip(variants, _compose_all(variants))]


def check_all(root: Path, only: str | None = None) -> tuple[list[Verdict], list[Path]]:
    variants, unclassified = find_variants(root)
    if only:
        variants = [v for v in variants if only in v.name(root)]
    return check_variants(variants), unclassified


# ----- report and command line -----------------------------------------------------------------
def summary(verdicts: list[Verdict], unclassified: list[Path], root: Path, seconds: float) -> dict:
    by_recipe: dict[str, dict] = {}
    for v in verdicts:
        key = v.variant.name(root).split("[")[0]
        entry = by_recipe.setdefault(key, {"variants": 0, "valid": 0})
        entry["variants"] += 1
        entry["valid"] += v.valid
    env = sorted({n for v in verdicts for n in v.facts.get("env", ())})
    return {"recipes": len(verdicts), "valid": sum(v.valid for v in verdicts),
            "learner_checked": sum(bool(v.facts.get("learner_checked")) for v in verdicts),
            "invalid": sum(not v.valid for v in verdicts), "by_recipe": by_recipe,
            "unclassified": [str(p.relative_to(root)) for p in unclassified], "env": env,
            "seconds": round(seconds, 1)}


def _parse(argv: list[str]) -> dict:
    """``check [--root DIR] [--only TEXT] [--verbose]``; a ValueError carries the one-line usage error."""
    if not argv or argv[0] != "check":
        raise ValueError(f"expected the subcommand 'check', got {argv[0] if argv else 'nothing'!r}")
    opts, rest = {"root": DEFAULT_ROOT, "only": None, "verbose": False}, list(argv[1:])
    while rest:
        arg = rest.pop(0)
        if arg == "--verbose":
            opts["verbose"] = True
        elif arg in ("--root", "--only"):
            if not rest:
                raise ValueError(f"{arg} needs a value")
            opts[arg[2:]] = Path(rest.pop(0)) if arg == "--root" else rest.pop(0)
        else:
            raise ValueError(f"unknown argument {arg!r}")
    if not opts["root"].is_dir():
        raise ValueError(f"--root {opts['root']} is not a folder")
    return opts


def main(argv: list[str]) -> int:
    """``thundersync recipes check``: 0 all valid, 1 some invalid, 2 bad arguments."""
    if "--list-losses" in argv:  # the policy-loss table (core/policy_losses.py), no recipe composed
        from thundersync_verl.core.policy_losses import format_table

        print(format_table())
        return 0
    if "-h" in argv or "--help" in argv:
        print(f"{USAGE}\n\ncompose every recipe under --root (default: recipes/ of this checkout) with verl's own "
              "config and check it against every rule a run would apply at start; prints one JSON summary line\n"
              "  --root DIR   the recipes folder\n  --only TEXT  only recipes whose name contains TEXT\n"
              "  --verbose    also name each valid recipe with what it sets up\n"
              "  --list-losses  print which actor.policy_loss.loss_mode values stream, and why the others do not")
        return 0
    try:
        opts = _parse(argv)
    except ValueError as err:
        print(f"thundersync recipes: error: {err} ({USAGE})", file=sys.stderr)
        return 2
    start, root = time.perf_counter(), opts["root"].resolve()
    verdicts, unclassified = check_all(root, opts["only"])
    for v in verdicts:
        if not v.valid:
            more = f" (+{len(v.problems) - 1} more)" if len(v.problems) > 1 else ""
            print(f"invalid {v.variant.name(root)}: {v.problems[0]}{more}", file=sys.stderr)
        elif opts["verbose"]:
            print(f"valid {v.variant.name(root)}: {recipe_rules.describe(v.facts)}", file=sys.stderr)
    for path in unclassified:
        print(f"unclassified {path.relative_to(root)}: neither a recipe (no defaults list) nor an option of "
              "a recipe's config group; move it into a group folder or delete it", file=sys.stderr)
    print(json.dumps(summary(verdicts, unclassified, root, time.perf_counter() - start)))
    return 0 if verdicts and all(v.valid for v in verdicts) and not unclassified else 1
