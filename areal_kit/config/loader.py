"""Load a training config: preset YAML from train_scripts/, then `key=value` overrides.

    cfg = load_config("1.5B_n4", ["ppo.gen.max_new_tokens=8192", "actor.lr=2e-6"])
    describe_args(cfg)        # (key, value, help) rows: the table of `areal-kit train PRESET --show-args`
    describe_options(cfg)     # key, value, type, default, help, choices: what `--show-args --json` prints

$AREAL_KIT_FILEROOT, $AREAL_KIT_STORAGE_ROOT and $AREAL_KIT_RAY_ADDRESS, which setup's runtime sets,
are the defaults of fileroot, storage_root and ray_address (RUN_ENV).
OmegaConf merges and type-checks; its errors are rewritten into one line naming the key,
the nearest valid key or the expected type. Dataclass __post_init__ does the semantic checks.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException, ValidationError

from areal_kit.config.assets import PATH_KEYS, resolve
from areal_kit.config.cluster_spec import load_cluster_spec
from areal_kit.config.schema import ConfigError, TrainConfig
from areal_kit.train_scripts import PRESET_DIR, preset_names

# train_scripts/ ships inside the package (pyproject.toml maps it to areal_kit.train_scripts), so a
# wheel, `pip install .` and the image find the presets as an editable install does.

# Keys other PPO trainers have that this one cannot honour: naming one says why, where a "did you
# mean" would offer a neighbour that does something else.
WITHOUT_EFFECT = {
    "ppo.gae_lambda": "GAE needs a critic's value estimates and this PPO/GRPO has no critic (every token's "
                      "advantage comes from its answer's reward); drop the key",
}
# Keys of AReaL's configs whose value here can only be what areal-kit always does: that value is
# accepted and dropped (nothing reads it), another is refused saying why.
FIXED = {
    "mode": ("ray", "areal-kit always runs on Ray (a local one, or ray_address's)"),
    "actor.optimizer": ("adamw", "the trainer's optimizer is torch AdamW (actor.lr, actor.weight_decay, actor.adam_betas)"),
}


# Environment variables that give these keys their defaults, under the preset and the overrides:
# setup's runtime (its Ray containers, its host-runtime Ray processes) sets them, so `areal-kit
# train PRESET` run there reads and writes where setup's driver does, on the cluster's Ray.
RUN_ENV = {"fileroot": "AREAL_KIT_FILEROOT", "storage_root": "AREAL_KIT_STORAGE_ROOT",
           "ray_address": "AREAL_KIT_RAY_ADDRESS"}


def env_defaults() -> dict[str, str]:
    """RUN_ENV's keys that this environment sets (fileroot's is applied in finalize, below a cluster spec's)."""
    return {key: os.environ[name] for key, name in RUN_ENV.items() if os.environ.get(name) and key != "fileroot"}


def preset_path(name: str) -> Path:
    p = Path(name)
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    path = PRESET_DIR / f"{name}.yaml"
    if not path.exists():
        raise ConfigError(f"unknown preset {name!r}; expected one of {', '.join(preset_names())} "
                          "or a path to a .yaml file")
    return path


def all_keys(cls: type = TrainConfig, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted key of the schema -> its dataclass field (leaves only)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        t = hints[f.name]
        if isinstance(t, type) and dataclasses.is_dataclass(t):  # a section (a hint is a class, never an instance)
            out.update(all_keys(t, key + "."))
        else:
            out[key] = f
    return out


def _nearest(key: str) -> str:
    keys = list(all_keys())
    match = difflib.get_close_matches(key, keys, n=1, cutoff=0.5)
    if not match:
        leaf = key.rsplit(".", 1)[-1]
        match = [k for k in keys if k.rsplit(".", 1)[-1] == leaf][:1] or \
            difflib.get_close_matches(key, keys, n=1, cutoff=0.0)
    return match[0]


def _parse_override(item: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    key = key.strip().lstrip("+")
    if not sep or not key:
        raise ConfigError(f"override {item!r} is not key=value; expected e.g. actor.lr=2e-6")
    if key in WITHOUT_EFFECT:
        raise ConfigError(f"{key} has no effect here: {WITHOUT_EFFECT[key]}")
    if key in FIXED:
        _check_fixed(key, _yaml_value(value), "override ")
        return key, value
    if key not in all_keys() and not _in_mapping(key):
        raise ConfigError(f"unknown config key {key!r}; did you mean {_nearest(key)!r}? "
                          "(areal-kit train PRESET --show-args lists every key)")
    return key, value


def _check_fixed(key: str, value: object, source: str) -> None:
    want, why = FIXED[key]
    if value != want:
        raise ConfigError(f"{source}{key}={value!r} is not valid; {why}: expected {want} or no {key}")


def _drop_fixed(data: DictConfig, source: str) -> None:
    """Remove the FIXED keys from a loaded preset, each checked."""
    for key in FIXED:
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(data, parent) if parent else data
        if OmegaConf.is_dict(node) and leaf in node:
            _check_fixed(key, node.pop(leaf), f"{source}: ")


def _in_mapping(key: str) -> bool:
    """assets.model.uri: a key inside an option whose value is a mapping (assets, reward_plugins)."""
    parts = key.split(".")
    heads = [".".join(parts[:i]) for i in range(1, len(parts))]
    return any(h in all_keys() and _expected_type(h).startswith("dict") for h in heads)


def _expected_type(key: str) -> str:
    t = typing.get_type_hints(_owner(key))[key.rsplit(".", 1)[-1]]
    if typing.get_args(t):  # list[float], not just "list"
        return str(t).replace("typing.", "")
    return getattr(t, "__name__", str(t)).replace("typing.", "")


def _owner(key: str) -> type:
    cls = TrainConfig
    for part in key.split(".")[:-1]:
        cls = typing.get_type_hints(cls)[part]
    return cls


def _omegaconf_error(e: Exception, source: str) -> ConfigError:
    key = getattr(e, "full_key", "") or ""
    if isinstance(e, ConfigKeyError) and key in WITHOUT_EFFECT:
        return ConfigError(f"{source}: {key} has no effect here: {WITHOUT_EFFECT[key]}")
    if isinstance(e, ConfigKeyError):
        return ConfigError(f"{source}: unknown config key {key!r}; did you mean {_nearest(key)!r}?")
    if isinstance(e, ValidationError) and key:
        value = getattr(e, "msg", "").split("'")[1] if "'" in getattr(e, "msg", "") else "?"
        return ConfigError(f"{source}: {key}={value!r} is not valid; expected {_expected_type(key)}")
    return ConfigError(f"{source}: {str(e).splitlines()[0]}")


def load_config(preset: str, overrides: list[str] | None = None) -> TrainConfig:
    """Preset YAML + overrides -> a validated TrainConfig. Raises ConfigError (one line)."""
    return load_resolved(preset, overrides)[0]


def load_resolved(preset: str, overrides: list[str] | None = None) -> tuple[TrainConfig, list[str]]:
    """load_config, and a line per preset asset that a path the overrides name dropped.

    The overrides of the paths a run reads (config/assets.py PATH_KEYS) go last, so that the
    preset's own paths, under the user's other settings (storage_root), are known: a URI or hub id
    there becomes its storage path and an asset, and a preset asset filling a path the user
    changed is dropped."""
    path = preset_path(preset)
    base = OmegaConf.structured(TrainConfig)
    try:
        cfg = OmegaConf.merge(base, env_defaults(), *_load_chain(path))
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, str(path)) from None
    assert isinstance(cfg, DictConfig), "a structured TrainConfig merges into a mapping"
    pairs = [p for p in map(_parse_override, overrides or []) if p[0] not in FIXED]
    _apply(cfg, [p for p in pairs if p[0] not in PATH_KEYS])
    own, own_assets = _paths(cfg, path), _select(cfg, "assets", path)
    _apply(cfg, [p for p in pairs if p[0] in PATH_KEYS])
    named = set(own_assets) if any(k == "assets" for k, _ in pairs) else \
        {k.split(".")[1] for k, _ in pairs if k.startswith("assets.")}
    got = resolve(str(_select(cfg, "storage_root", path)), own, _paths(cfg, path), own_assets, named)
    for key, value in got.paths.items():
        OmegaConf.update(cfg, key, value, merge=False)
    for name in got.dropped:
        del cfg.assets[name]
    for name, a in got.add.items():
        cfg.assets[name] = a
    try:
        obj = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, str(path)) from None
    assert isinstance(obj, TrainConfig), "a structured TrainConfig converts to one"
    vars(obj)[_ORIGIN] = {"preset": preset, "overrides": list(overrides or [])}  # for origin(), not a field
    return finalize(obj), list(got.dropped.values())


_ORIGIN = "_origin"


def origin(cfg: TrainConfig) -> dict | None:
    """Where a loaded config's values came from (None: not made by load_config): {"preset": its
    name, "overrides": the key=value items, "preset_values": {key: what the preset and the presets
    it inherits set, interpolations as written}}; `areal-kit view` shows it beside each value."""
    got = vars(cfg).get(_ORIGIN)
    if got is None:
        return None
    flat: dict[str, Any] = {}
    keys = all_keys()

    def walk(node: dict, prefix: str) -> None:
        for k, v in node.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in keys:
                walk(v, key + ".")
            else:
                flat[key] = v

    try:
        merged = OmegaConf.to_container(OmegaConf.merge(*_load_chain(preset_path(got["preset"]))), resolve=False)
    except (ConfigError, OmegaConfBaseException):
        merged = {}
    walk(merged if isinstance(merged, dict) else {}, "")
    return {**got, "preset_values": flat}


def _apply(cfg: DictConfig, pairs: list[tuple[str, str]]) -> None:
    for key, value in pairs:
        try:
            OmegaConf.update(cfg, key, _yaml_value(value), merge=False)
        except OmegaConfBaseException:
            expected = _expected_type(key) if key in all_keys() else "a value of the type its mapping holds"
            raise ConfigError(f"override {key}={value!r} is not valid; expected {expected}") from None


def _select(cfg: DictConfig, key: str, path: Path) -> Any:  # a config value: YAML's types
    """cfg's value at key, interpolations resolved (a mapping as plain dicts)."""
    try:
        value = OmegaConf.select(cfg, key)
        return OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    except OmegaConfBaseException as e:
        raise _omegaconf_error(e, str(path)) from None


def _paths(cfg: DictConfig, path: Path) -> dict[str, str]:
    return {key: str(_select(cfg, key, path) or "") for key in PATH_KEYS}


def _load_chain(path: Path, depth: int = 0) -> list:
    """The preset and the presets it inherits from (`inherit: NAME`), base first."""

    try:
        data = OmegaConf.load(path)
    except Exception as e:  # noqa: BLE001 - YAML syntax: name the file and line
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{where} ({str(e).splitlines()[0]})") from None
    if not isinstance(data, DictConfig):
        raise ConfigError(f"{path}: expected a mapping of config keys at the top level")
    _drop_fixed(data, str(path))
    parent = data.pop("inherit", None)
    if parent is None:
        return [data]
    if depth > 5:
        raise ConfigError(f"{path}: inherit chain is deeper than 5; expected a short chain")
    try:
        parent_path = preset_path(str(parent))
    except ConfigError as e:
        raise ConfigError(f"{path}: inherit: {e}") from None
    return _load_chain(parent_path, depth + 1) + [data]


def finalize(cfg: TrainConfig) -> TrainConfig:
    """Check the config against its cluster spec; fill fileroot from the spec, $AREAL_KIT_FILEROOT or ./areal_runs."""
    if cfg.cluster:  # validated even when fileroot is overridden: a broken spec never passes
        spec = load_cluster_spec(cfg.cluster)
        cfg.fileroot = cfg.fileroot or spec.fileroot
        # The spec's GPU count (0 on CPU clusters: not checked) and host count must match.
        for name, have in (("n_gpus_per_node", spec.n_gpus_per_node),
                           ("n_nodes", len(spec.hosts))):
            want = getattr(cfg, name)
            if have and have != want:
                raise ConfigError(f"cluster spec {cfg.cluster} has {name}={have} but the config has "
                                  f"{name}={want}; expected them to match (override {name}={have} "
                                  "and allocation_mode)")
    if not cfg.fileroot:
        # The runtime's, else under the current directory, so two checkouts never share a run by accident.
        cfg.fileroot = os.environ.get(RUN_ENV["fileroot"]) or os.path.join(os.getcwd(), "areal_runs")
    cfg.fileroot = os.path.abspath(os.path.expanduser(cfg.fileroot))
    return cfg


def _yaml_value(text: str) -> Any:  # what YAML reads: a number, a string, a list, a mapping, ...
    if not text.strip():  # `key=` or `key= `: the empty string, not YAML's null
        return ""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _value(cfg: TrainConfig, key: str) -> object:
    for part in key.split("."):
        cfg = getattr(cfg, part)
    return cfg


def _default(f: dataclasses.Field) -> object:
    if f.default is dataclasses.MISSING and f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def describe_options(cfg: TrainConfig) -> list[dict]:
    """Every option in schema order, as `--show-args --json` prints it: key, value (as loaded, with
    the overrides), type, default, help, and choices where the field has them. JSON-serializable."""
    rows = []
    for key, f in all_keys().items():
        row = {"key": key, "value": _value(cfg, key), "type": _expected_type(key), "default": _default(f),
               "help": f.metadata.get("help", "")}
        if "choices" in f.metadata:
            row["choices"] = list(f.metadata["choices"])
        rows.append(row)
    return rows


def describe_args(cfg: TrainConfig) -> list[tuple[str, str, str]]:
    """(key, value, help) for every option, in schema order: the rows of `--show-args`."""
    return [(r["key"], repr(r["value"]) if isinstance(r["value"], str) else str(r["value"]), r["help"])
            for r in describe_options(cfg)]
