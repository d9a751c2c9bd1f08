"""Which code may take the whole TrainConfig: each component takes its own config section (or a
small dataclass of the few values it reads), and the whole config goes only where the run is
decided from several sections at once. WHY lists those places; a new function, method or
class attribute typed TrainConfig fails here until it takes its sections instead, or is listed
with its reason (and ARCHITECTURE.md's "Which component gets which config" names its module).

    PYTHONPATH=. python -m pytest tests/unit/test_config_ownership.py -q
"""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "areal_kit"
WORD = re.compile(r"\bTrainConfig\b")

# Why each takes the whole config -> the places: "module:qualified name", or "module:*" for a module
# whose every part is about the whole run.
WHY = {
    "the command and the plan: they show or check the whole run": [
        "areal_kit.rl.cmd:*", "areal_kit.rl.plan:*"],
    "the config's own loader": ["areal_kit.config.loader:*"],
    "the launch: prepares the run, and sizes Ray and the workers from the allocation and the sections": [
        "areal_kit.rl.driver.launch:*", "areal_kit.rl.driver.job:*", "areal_kit.rl.driver.raystart:start_ray",
        "areal_kit.rl.driver.controller:start_ray", "areal_kit.rl.driver.placement:check_gpu_sharing",
        "areal_kit.rl.driver.groups:create", "areal_kit.rl.driver.groups:reserve",
        "areal_kit.rl.driver.groups:worker_env", "areal_kit.rl.driver.groups:core_sets"],
    "a choice that reads the allocation beside another section, made once for the run": [
        "areal_kit.rl.sharing:shares_gpus", "areal_kit.rl.sharing:sleep_mode", "areal_kit.rl.sharing:check",
        "areal_kit.rl.weight_sync.mode:sync_mode", "areal_kit.rl.weight_sync.mode:weight_sync_dir",
        "areal_kit.rl.weight_sync.mode:choose"],
    "the failure advice: names the options to change, with the plan's figures": ["areal_kit.rl.driver.retry:*"],
    "the cluster's start of a run and its setup plan": [
        "areal_kit.cluster.train_start:*", "areal_kit.cluster.data:plan", "areal_kit.cluster.cmd:_setup_plan"],
    "the run's prompts: the dataset, the seed and the rewards that will grade it": [
        "areal_kit.data.prompts:run_prompts", "areal_kit.data.prompts:read_rows"],
    # The mixins declare the host's `cfg` they read: an actor is one class (Ray serves its methods).
    "an actor process hosting several components: it hands each its sections": [
        "areal_kit.rl.trainer.worker:TrainerWorker.__init__", "areal_kit.rl.trainer.weight_send:WeightSender",
        "areal_kit.rl.engine.worker:RolloutWorker.__init__", "areal_kit.rl.engine.worker:engine_kwargs",
        "areal_kit.rl.engine.weight_receive:WeightReceiver"],
}
ALLOWED = [place for places in WHY.values() for place in places]


def _allowed(name: str) -> bool:
    return name in ALLOWED or f"{name.split(':')[0]}:*" in ALLOWED


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _takers(tree: ast.AST, prefix: str = "") -> list[str]:
    """Qualified names of the functions with a parameter typed TrainConfig (alone, optional or in
    a union) and of the classes with an attribute so typed, under `tree`."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *(x for x in (a.vararg, a.kwarg) if x)]
            if any(p.annotation is not None and WORD.search(ast.unparse(p.annotation)) for p in params):
                out.append(prefix + node.name)
            out += _takers(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            if any(isinstance(s, ast.AnnAssign) and WORD.search(ast.unparse(s.annotation)) for s in node.body):
                out.append(prefix + node.name)
            out += _takers(node, f"{prefix}{node.name}.")
    return out


def takers() -> set[str]:
    return {f"{_module(p)}:{q}" for p in sorted(PKG.rglob("*.py")) for q in _takers(ast.parse(p.read_text()))}


def test_only_the_places_that_decide_the_run_take_the_whole_config():
    new = sorted(t for t in takers() if not _allowed(t))
    assert not new, (f"{new} take the whole TrainConfig: pass the component its section(s) (cfg.ppo, "
                     "cfg.actor.lora, ...) or a small dataclass of what it reads, as PPOActor, Turns and "
                     "WeightSync do; or, where the whole run is decided there, add it to ALLOWED with its reason")


def test_every_allowed_place_still_takes_it():
    found = takers()
    gone = [a for a in ALLOWED if not any(t == a or (a.endswith(":*") and t.startswith(a[:-1])) for t in found)]
    assert not gone, f"{gone} no longer take TrainConfig: drop them from ALLOWED"
    assert len(set(ALLOWED)) == len(ALLOWED)


def test_the_components_of_the_loop_take_their_sections():
    """The loop's components by name: none of them may come back into ALLOWED."""
    components = {"areal_kit.rl.driver.turns:Turns.__init__", "areal_kit.rl.driver.weight_sync:WeightSync.__init__",
                  "areal_kit.rl.driver.rollout:Rollout.__init__", "areal_kit.rl.driver.rollout:make_rollout",
                  "areal_kit.rl.driver.rollout:BatchRollout.__init__",
                  "areal_kit.rl.driver.rollout:StreamRollout.__init__",
                  "areal_kit.rl.driver.validation:Validator.__init__", "areal_kit.rl.algo.ppo:PPOActor.__init__",
                  "areal_kit.rl.algo.ppo:answer_budget", "areal_kit.rl.staleness:Staleness.of"}
    assert not components & takers()
    assert not any(_allowed(c) for c in components)


def test_the_finder_sees_optional_and_class_level_configs():
    tree = ast.parse("class Host:\n    cfg: TrainConfig\n"
                     "def f(a: int, cfg: TrainConfig | None = None) -> None: ...\n"
                     "def g(ppo: PPOConfig) -> None: ...\n"
                     "class C:\n    def __init__(self, *, c: 'TrainConfig') -> None: ...\n")
    assert _takers(tree) == ["Host", "f", "C.__init__"]


def test_architecture_names_every_module_that_takes_it():
    text = (ROOT / "ARCHITECTURE.md").read_text()
    section = text.split("**Which component gets which config.**", 1)[1].split("\n## ", 1)[0]
    paths = {"/".join(k.split(":")[0].split(".")[1:]) + ".py" for k in ALLOWED}
    missing = sorted(p for p in paths if f"`{p}`" not in section)
    assert not missing, f"ARCHITECTURE.md's config ownership does not name {missing}"
