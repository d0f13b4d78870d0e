"""Every verl name thundersync_verl reaches exists in the pinned verl: a verl bump fails here first, by name.

1. The list is derived from the code, never written by hand (``thundersync_harness.verl_reach``):
   every verl import, attribute path and module string in the package, and every name the classes
   deriving from verl (trainer, streaming worker, rollout, platform, checkpoint engine, agent loop,
   replay buffers) read, call on ``super()`` or override. Each failure names the verl name, the
   class and the line that needs it.
2. Duck-typed reaches on objects verl hands over (``worker.actor.engine``) are not derivable here;
   the e2e ``main_ppo`` tests run them.
3. The derivation is run on a deliberately broken probe package and must name exactly what is
   missing there, so a derivation that silently finds nothing cannot pass.
"""

from __future__ import annotations

import ast
import functools
import inspect
import sys
from pathlib import Path

import pytest

import thundersync_verl
from thundersync_harness.verl_reach import (
    derived_classes,
    missing_class_names,
    package_sources,
    project_references,
    resolve,
    unresolved,
    verl_reaches,
)
from thundersync_verl import verl_adapter as va

REPO = Path(thundersync_verl.__file__).resolve().parent.parent
REFERENCE_DIRS = ("thundersync_verl", "tests", "benchmarks")  # where a name counts as read by this project


@functools.lru_cache(maxsize=None)
def _project():
    sources = package_sources(REPO, "thundersync_verl")
    references = project_references([REPO / d for d in REFERENCE_DIRS if (REPO / d).is_dir()])
    return sources, references


def test_pinned_version_matches_installed_verl_and_setup_py():
    import verl

    assert verl.__version__ == va.VERL_VERSION, f"verl {verl.__version__} is installed; the adapter is built for {va.VERL_VERSION}"
    assert f'"verl=={va.VERL_VERSION}"' in (REPO / "setup.py").read_text(), "setup.py must pin the adapter's verl version"


def test_every_verl_name_the_package_reaches_resolves():
    sources, _ = _project()
    reaches = verl_reaches(sources)
    from_adapter = [r for r in reaches if r.where.startswith("thundersync_verl/verl_adapter/")]
    assert len(from_adapter) >= 20, f"the adapter scan found only {[r.name for r in from_adapter]}: the derivation is broken"
    missing = unresolved(reaches)
    assert not missing, f"verl {va.VERL_VERSION} lacks {len(missing)} name(s) thundersync_verl uses:\n" + "\n".join(missing)


def test_every_zero_argument_adapter_getter_runs():
    import importlib
    import pkgutil

    folder = sorted(m.name for m in pkgutil.iter_modules(va.__path__))
    assert sorted(va.MODULES + va.BEHAVIOUR_MODULES) == folder, "va.MODULES / va.BEHAVIOUR_MODULES miss a module"
    sources = [inspect.getsource(importlib.import_module(f"{va.__name__}.{m}")) for m in va.MODULES]
    getters = [n.name for src in sources for n in ast.parse(src).body
               if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")
               and not (n.args.args or n.args.kwonlyargs or n.args.vararg or n.args.kwarg)]
    assert getters, "no zero-argument getters found in the adapter"
    for name in getters:
        assert getattr(va, name)() is not None, f"verl_adapter.{name}() returned None"


def test_names_verl_derived_classes_take_from_verl_exist():
    sources, references = _project()
    derived = derived_classes(sources)
    bases = {k for d in derived for k in d.verl_side}
    api = va.trainer_api()
    for needed in (api.PPOTrainer, va.tinker_actor_worker_base()):  # the trainer and the streaming worker
        assert needed in bases, f"no class deriving from {needed.__qualname__} found: the derivation is broken"
    missing = missing_class_names(derived, references)
    assert not missing, f"{len(missing)} name(s) verl-derived classes take from verl are gone:\n" + "\n".join(missing)


def test_registries_the_adapter_writes_have_the_shape_it_writes():
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.rollout import base as rollout_base

    assert ("vllm", "async") in rollout_base._ROLLOUT_REGISTRY, "verl's rollout adapter table is no longer keyed (name, mode)"
    assert "fsdp" in EngineRegistry._engines["language_model"], "verl's engine registry is no longer model_type -> backend"


# -- the derivation fails when a name is missing (point 3) ----------------------------------------
PROBE = '''
from thundersync_verl import verl_adapter as va

api = va.trainer_api()


class ProbeTrainer(api.PPOTrainer):
    probe_setting: int = 0  # an annotated class attribute: a new field, not an override

    def _step_once(self, metrics, timing_raw, sample_batch_size):  # a verl hook that exists
        return self._hook_verl_renamed(), self.global_steps

    def _hook_verl_never_had(self):  # defined and never read here: only verl could call it
        return super()._setup_verl_renamed()


def make_factory_trainer():
    from verl.trainer.ppo.v1.trainer_base import PPOTrainer

    class FactoryTrainer(PPOTrainer):
        def prepare_step(self):  # a verl hook that exists
            return self.missing_on_factory_class

    return FactoryTrainer


def reach():
    from verl.trainer.ppo.v1.trainer_base import NoSuchTrainerPiece

    return NoSuchTrainerPiece, api.tq.no_such_queue_call
'''


@pytest.fixture
def probe_package(tmp_path, monkeypatch):
    package = "ts_verl_api_probe"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "probe.py").write_text(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield package_sources(tmp_path, package), project_references([tmp_path / package])
    for name in [m for m in sys.modules if m.split(".")[0] == package]:
        del sys.modules[name]


def test_a_missing_verl_name_is_reported_by_name(monkeypatch):
    sources, _ = _project()
    reaches = [r for r in verl_reaches(sources) if r.attrs and r.module.startswith("verl")]
    for reach in reaches:
        parent = resolve(reach.module, reach.attrs[:-1])
        leaf = reach.attrs[-1]
        if inspect.ismodule(parent) and leaf in vars(parent) and not inspect.ismodule(vars(parent)[leaf]):
            break
    else:
        pytest.fail("no module-level verl name among the reaches to remove")
    assert unresolved([reach]) == []
    monkeypatch.delattr(parent, leaf)
    missing = unresolved([reach])
    assert len(missing) == 1 and missing[0].startswith(reach.name) and reach.where in missing[0], missing


def test_derivation_names_every_missing_name_in_a_probe(probe_package):
    sources, references = probe_package
    missing = sorted(unresolved(verl_reaches(sources)))
    assert [m.split(" ")[0] for m in missing] == ["ts_verl_api_probe.probe.api.tq.no_such_queue_call",
                                                 "verl.trainer.ppo.v1.trainer_base.NoSuchTrainerPiece"], missing
    assert all("AttributeError" in m for m in missing), missing
    derived = derived_classes(sources)
    assert sorted(d.site.qualname for d in derived) == ["ProbeTrainer", "make_factory_trainer.<locals>.FactoryTrainer"]
    missing = missing_class_names(derived, references)
    found = sorted(m.split("`")[-2] for m in missing)
    assert found == ["_hook_verl_never_had", "_hook_verl_renamed", "_setup_verl_renamed", "missing_on_factory_class"], missing
    assert all("ts_verl_api_probe/probe.py:" in m for m in missing), missing


def test_update_critic_epochs_runs_verls_update_with_the_epochs_for_that_call_only():
    """SAO's later critic epochs: verl's own ``_update_critic`` sees ``critic.ppo_epochs=E-1``; the config is
    restored afterwards, also when the update fails."""
    from omegaconf import OmegaConf

    seen = []

    class Trainer:
        config = OmegaConf.create({"critic": {"ppo_epochs": 3}})

        def _update_critic(self, batch, metrics):
            seen.append(int(self.config.critic.ppo_epochs))
            if batch == "bad":
                raise RuntimeError("critic worker died")
            metrics["critic/vf_loss"] = 0.5
            return batch

    trainer, metrics = Trainer(), {}
    assert va.update_critic_epochs(trainer, "batch", metrics, 2) == "batch" and metrics == {"critic/vf_loss": 0.5}
    with pytest.raises(RuntimeError, match="died"):
        va.update_critic_epochs(trainer, "bad", metrics, 2)
    assert seen == [2, 2] and trainer.config.critic.ppo_epochs == 3
