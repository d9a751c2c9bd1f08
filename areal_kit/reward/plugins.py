"""Reward and workflow plug-ins named in config: `pkg.module:attr` or `path/to/file.py:attr`.

    ppo:
      reward_fns: [math, mine]                     # summed per sample
      reward_plugins: {mine: my_pkg.rewards:score}  # name -> dotted path

`reward_specs(ppo)` turns ppo.reward_fns into (name, spec) pairs and imports every plug-in
once in the driver, so a path that does not import is a one-line UserError before any worker
starts. Workers import the same specs again (rollout engines, reward processes).

    python -m areal_kit.reward.plugins my_pkg.rewards:score      # imports it, or says why not
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from typing import TYPE_CHECKING, Any

from areal_kit.api import RewardFn
from areal_kit.errors import UserError
from areal_kit.reward.registry import get_reward, known_rewards, register

if TYPE_CHECKING:
    from areal_kit.config.schema import PPOConfig

# Built-in rewards that ship with areal-kit: trusted (bounded time, never raise), so they run
# in the rollout engine's process; everything else runs in the reward pool (reward/pool.py).
BUILTIN = {"math": "math", "gsm8k": "gsm8k", "toy": "areal_kit.data.toy_task:toy_reward",
           "calc": "areal_kit.data.toy_task:calc_reward"}


def load_object(spec: str, what: str = "reward") -> Any:  # a user's object: a function, a class, ...
    """The object a `module:attr` or `file.py:attr` spec names; UserError (one line) if none."""
    module, sep, attr = spec.rpartition(":")
    if not sep or not module or not attr:
        raise UserError(f"{what} {spec!r} is not a plug-in path; expected pkg.module:function or file.py:function")
    try:
        if module.endswith(".py"):
            if not os.path.isfile(module):
                raise UserError(f"{what} {spec!r}: file {module} not found; expected a Python file")
            name = "areal_plugin_" + os.path.splitext(os.path.basename(module))[0]
            mod = sys.modules.get(name)
            if mod is None or getattr(mod, "__file__", None) != module:
                loader_spec = importlib.util.spec_from_file_location(name, module)
                if loader_spec is None or loader_spec.loader is None:
                    raise UserError(f"{what} {spec!r}: {module} does not load as a Python module")
                mod = importlib.util.module_from_spec(loader_spec)
                loader_spec.loader.exec_module(mod)
                sys.modules[name] = mod
        else:
            mod = importlib.import_module(module)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any import-time error is the user's to fix
        raise UserError(f"{what} {spec!r} does not import ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                        "expected a module importable on every node (installed or on PYTHONPATH)") from None
    try:
        obj = getattr(mod, attr)
    except AttributeError:
        raise UserError(f"{what} {spec!r}: module {module} has no {attr!r}") from None
    return obj


def reward_spec(name: str, plugins: dict[str, str]) -> str:
    """What one entry of ppo.reward_fns refers to: a built-in name or a plug-in path."""
    if name in plugins:
        return plugins[name]
    if name in BUILTIN or ":" in name:
        return BUILTIN.get(name, name)
    if name in known_rewards():  # registered in code by the user
        return name
    known = sorted(set(BUILTIN) | set(plugins) | {k for k in known_rewards() if ":" not in k})
    raise UserError(f"unknown reward {name!r} in ppo.reward_fns; known rewards: {', '.join(known)}; or give "
                    "a dotted path pkg.module:function, or name one in ppo.reward_plugins")


def load_reward(spec: str) -> RewardFn:
    """The callable of a spec; plug-ins are also registered under their spec in the registry."""
    if ":" not in spec:
        return get_reward(spec)
    fn = load_object(spec, "reward")
    if not callable(fn):
        raise UserError(f"reward {spec!r} is a {type(fn).__name__}, not a function; expected "
                        "(prompt, completion, sample) -> float | dict")
    return register(spec, fn)


def call_reward(spec: str, prompt: str, completion: str, sample: dict) -> float | dict | str:
    """One reward call inside a pool worker: what the reward returned, if it can be scored
    (a number or a dict), else its repr, which the scorer reports as a bad return."""
    try:
        fn = load_reward(spec)
    except UserError as e:
        raise ImportError(str(e)) from None
    value = fn(prompt, completion, sample)
    return value if isinstance(value, (int, float, dict)) else repr(value)[:80]


def is_trusted(spec: str) -> bool:
    return spec in BUILTIN.values()


def reward_specs(ppo: PPOConfig) -> list[tuple[str, str]]:
    """(name, spec) of every reward in ppo.reward_fns, each imported once here."""
    out = []
    for name in ppo.reward_fns:
        spec = reward_spec(name, ppo.reward_plugins)
        load_reward(spec)
        out.append((name, spec))
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m areal_kit.reward.plugins pkg.module:function")
    try:
        print(load_object(sys.argv[1]))
    except UserError as e:
        sys.exit(f"error: {e}")
