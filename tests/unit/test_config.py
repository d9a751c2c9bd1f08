"""Config schema (validation in __post_init__) and the loader: presets, inherit, overrides, help."""

import dataclasses
import json

import pytest
from areal_kit.train_scripts import preset_names

from areal_kit.config import loader
from areal_kit.config.dataset import DatasetConfig
from areal_kit.config.loader import all_keys, describe_args, describe_options, load_config
from areal_kit.config.schema import (
    ConfigError,
    ExpCtrl,
    GenConfig,
    MBSpec,
    MFCConfig,
    ModelConfig,
    PPOConfig,
    TrainConfig,
)


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # fileroot defaults under the cwd


def tiny_cfg(**kw):
    kw.setdefault("actor", ModelConfig(path="tiny://toy"))
    kw.setdefault("allocation_mode", "d1")
    kw.setdefault("n_gpus_per_node", 1)
    kw.setdefault("dataset", DatasetConfig(max_prompt_len=16))
    kw.setdefault("ppo", PPOConfig(gen=GenConfig(max_new_tokens=8)))
    return TrainConfig(**kw)


# ------------------------------------------------------------------ schema
def test_defaults_are_valid_apart_from_the_model_path():
    with pytest.raises(ConfigError, match="actor.path is empty"):
        TrainConfig()
    cfg = tiny_cfg()
    assert cfg.n_gpus == 1


@pytest.mark.parametrize("make,message", [
    (lambda: GenConfig(max_new_tokens=0), "ppo.gen.max_new_tokens=0"),
    (lambda: GenConfig(min_new_tokens=9, max_new_tokens=8), "ppo.gen.min_new_tokens=9"),
    (lambda: GenConfig(temperature=0.0), "ppo.gen.temperature=0.0"),
    (lambda: GenConfig(top_p=0.0), "ppo.gen.top_p=0.0"),
    (lambda: GenConfig(top_p=1.5), "ppo.gen.top_p=1.5"),
    (lambda: GenConfig(top_k=0), "ppo.gen.top_k=0"),
    (lambda: PPOConfig(group_size=0), "ppo.group_size=0"),
    (lambda: PPOConfig(group_size=1, group_adv_norm=True), "a group of 1 has no baseline"),
    (lambda: PPOConfig(eps_clip=0.0), "ppo.eps_clip=0.0"),
    (lambda: PPOConfig(eps_clip=1.0), "ppo.eps_clip=1.0"),
    (lambda: PPOConfig(kl_ctl=-0.1), "ppo.kl_ctl=-0.1"),
    (lambda: PPOConfig(kl_estimator="k4"), "expected one of k1, k2, k3"),
    (lambda: PPOConfig(kl_mode="both"), "ppo.kl_mode='both'"),
    (lambda: PPOConfig(ppo_n_minibatches=0), "ppo.ppo_n_minibatches=0"),
    (lambda: PPOConfig(discount=0.0), "ppo.discount=0.0"),
    (lambda: PPOConfig(discount=1.1), "ppo.discount=1.1"),
    (lambda: PPOConfig(max_head_offpolicyness=-1), "ppo.max_head_offpolicyness=-1"),
    (lambda: PPOConfig(behav_imp_weight_cap=1.0), "ppo.behav_imp_weight_cap=1.0"),
    (lambda: PPOConfig(reward_fns=[]), "ppo.reward_fns is empty"),
    (lambda: ModelConfig(path="x", lr=0.0), "actor.lr=0.0"),
    (lambda: ModelConfig(path="x", lr_scheduler="step"), "actor.lr_scheduler='step'"),
    (lambda: ModelConfig(path="x", zero_stage=4), "actor.zero_stage=4"),
    (lambda: ModelConfig(path="x", dtype="fp16"), "actor.dtype='fp16'"),
    (lambda: ModelConfig(path="x", warmup_steps_proportion=1.0), "actor.warmup_steps_proportion=1.0"),
    (lambda: ModelConfig(path="x", adam_betas=[0.9]), "actor.adam_betas=[0.9]"),
    (lambda: MBSpec(max_tokens_per_mb=0), "mb_spec.max_tokens_per_mb=0"),
    (lambda: DatasetConfig(type="csv"), "dataset.type='csv'"),
    (lambda: DatasetConfig(type="jsonl", path=""), "dataset.path is empty for dataset.type=jsonl"),
    (lambda: DatasetConfig(train_bs_n_seqs=0), "dataset.train_bs_n_seqs=0"),
    (lambda: DatasetConfig(max_prompt_len=0), "dataset.max_prompt_len=0"),
    (lambda: ExpCtrl(total_train_epochs=0), "exp_ctrl.total_train_epochs=0"),
    (lambda: ExpCtrl(ckpt_freq_secs=-1), "exp_ctrl.ckpt_freq_secs=-1"),
    (lambda: tiny_cfg(experiment_name="a/b"), "experiment_name='a/b'"),
    (lambda: tiny_cfg(trial_name=""), "trial_name=''"),
    (lambda: tiny_cfg(trial_name=".hidden"), "trial_name='.hidden'"),
    (lambda: tiny_cfg(n_nodes=0), "n_nodes=0"),
    (lambda: tiny_cfg(weight_sync="nccl"), "weight_sync='nccl'"),
    (lambda: tiny_cfg(recover_mode="always"), "recover_mode='always'"),
    (lambda: tiny_cfg(recover_retries=-1), "recover_retries=-1"),
    (lambda: tiny_cfg(allocation_mode="d2"), "d2 needs 2 GPUs, cluster has 1x1=1"),
])
def test_schema_rejects(make, message):
    with pytest.raises(ConfigError) as e:
        make()
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_micro_batch_must_hold_one_sequence():
    with pytest.raises(ConfigError) as e:
        tiny_cfg(actor_train=MFCConfig(MBSpec(23)))
    assert "actor_train.mb_spec.max_tokens_per_mb=23 is smaller than one sequence" in str(e.value)
    assert "= 24); expected >= 24" in str(e.value)
    tiny_cfg(actor_train=MFCConfig(MBSpec(24)), ref_inf=MFCConfig(MBSpec(24)))


# ------------------------------------------------------------------ loader
def test_overrides_apply_with_types():
    cfg = load_config("1.5B_n4", ["ppo.gen.max_new_tokens=8192", "actor.lr=2e-6", "ppo.adv_norm=false",
                                  "ppo.reward_fns=[math,gsm8k]", "trial_name=t1", "+seed=7"])
    assert cfg.ppo.gen.max_new_tokens == 8192
    assert isinstance(cfg.ppo.gen.max_new_tokens, int)
    assert cfg.actor.lr == 2e-6
    assert isinstance(cfg.actor.lr, float)
    assert cfg.ppo.adv_norm is False
    assert cfg.ppo.reward_fns == ["math", "gsm8k"]
    assert cfg.trial_name == "t1"
    assert cfg.seed == 7
    assert isinstance(cfg, TrainConfig)
    assert isinstance(cfg.ppo, PPOConfig)


def test_later_override_wins():
    assert load_config("tiny", ["seed=2", "seed=3"]).seed == 3


def test_interpolation_of_storage_root():
    cfg = load_config("1.5B_n4", ["storage_root=/mnt/shared"])
    assert cfg.actor.path == "/mnt/shared/models/DeepSeek-R1-Distill-Qwen-1.5B"
    assert cfg.dataset.path == "/mnt/shared/datasets/prompts_for_r1_distilled.jsonl"


def test_fileroot_defaults_under_cwd(tmp_path):
    assert load_config("tiny").fileroot == str(tmp_path / "areal_runs")
    assert load_config("tiny", ["fileroot=~/x"]).fileroot.endswith("/x")
    assert load_config("tiny", ["fileroot=rel"]).fileroot == str(tmp_path / "rel")


@pytest.mark.parametrize("override,message", [
    ("actor.lrr=1", "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
    ("ppo.gen.max_new_token=8", "did you mean 'ppo.gen.max_new_tokens'?"),
    ("ppo.group=4", "did you mean 'ppo.group_size'?"),
    ("max_head_offpolicyness=2", "did you mean 'ppo.max_head_offpolicyness'?"),
    ("ppo.gae_lambda=0.95", "ppo.gae_lambda has no effect here: GAE needs a critic's value estimates"),
    ("mode=slurm", "override mode='slurm' is not valid; areal-kit always runs on Ray"),
    ("actor.optimizer=sgd", "override actor.optimizer='sgd' is not valid; the trainer's optimizer is torch AdamW"),
    ("exp_ctrl.save_freq_steps=-1", "exp_ctrl.save_freq_steps=-1 is not valid"),
    ("actor.lr=abc", "actor.lr='abc' is not valid; expected float"),
    ("ppo.group_size=two", "ppo.group_size='two' is not valid; expected int"),
    ("ppo.group_size=1.5", "expected int"),
    ("ppo.adv_norm=maybe", "ppo.adv_norm='maybe' is not valid; expected bool"),
    ("ppo.reward_fns=math", "ppo.reward_fns='math' is not valid; expected list[str]"),
    ("actor.adam_betas=[a,b]", "actor.adam_betas='[a,b]' is not valid; expected list[float]"),
    ("noequals", "override 'noequals' is not key=value"),
    ("=3", "override '=3' is not key=value"),
    ("ppo.gen.temperature=0", "ppo.gen.temperature=0.0 is not valid"),
    ("allocation_mode= ", "allocation_mode is empty"),
])
def test_bad_overrides(override, message):
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [override])
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def write(path, text):
    path.write_text(text)
    return str(path)


def test_yaml_file_preset_with_inherit(tmp_path):
    p = write(tmp_path / "mine.yaml", "inherit: tiny\ntrial_name: mine\nppo:\n  group_size: 4\n")
    cfg = load_config(p)
    assert cfg.trial_name == "mine"
    assert cfg.ppo.group_size == 4
    assert cfg.actor.path == "tiny://toy"  # from tiny
    # a YAML preset can inherit from another YAML file by path
    q = write(tmp_path / "mine2.yaml", f"inherit: {p}\nseed: 5\n")
    cfg2 = load_config(q)
    assert (cfg2.seed, cfg2.ppo.group_size) == (5, 4)


@pytest.mark.parametrize("text,message", [
    ("inherit: tiny\nactor:\n  lrr: 1\n", "unknown config key 'actor.lrr'; did you mean 'actor.lr'?"),
    ("inherit: tiny\nactor:\n  lr: abc\n", "actor.lr='abc' is not valid; expected float"),
    ("inherit: tiny\nppo:\n  gae_lambda: 0.95\n", "ppo.gae_lambda has no effect here: GAE needs a critic"),
    ("inherit: tiny\nactor:\n  optimizer: sgd\n", ("bad.yaml: actor.optimizer='sgd' is not valid; the trainer's "
                                                    "optimizer is torch AdamW (actor.lr, actor.weight_decay, "
                                                    "actor.adam_betas): expected adamw")),
    ("mode: local\ninherit: tiny\n", "bad.yaml: mode='local' is not valid"),
    ("inherit: nosuch\n", "inherit: unknown preset 'nosuch'"),
    ("- 1\n- 2\n", "expected a mapping of config keys at the top level"),
    ("actor: [\n", "not valid YAML at line 2"),
    ("inherit: tiny\nppo: 3\n", "bad.yaml"),
    ("inherit: tiny\nppo:\n  gen:\n    max_new_tokens: ${nosuch}\n", "nosuch"),
])
def test_bad_preset_files(tmp_path, text, message):
    p = write(tmp_path / "bad.yaml", text)
    with pytest.raises(ConfigError) as e:
        load_config(p)
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_the_guides_fixed_keys_are_accepted_with_their_one_value(tmp_path):
    """mode and actor.optimizer left the schema (nothing read them); AReaL's mode=ray and
    optimizer adamw, the only things areal-kit does, still load, from a preset or an override."""
    p = write(tmp_path / "guide.yaml", "inherit: tiny\nmode: ray\nactor:\n  optimizer: adamw\n  lr: 0.002\n")
    cfg = load_config(p, ["mode=ray", "actor.optimizer=adamw"])
    assert cfg.actor.lr == 0.002
    assert "mode" not in all_keys() and "actor.optimizer" not in all_keys()


@pytest.mark.parametrize("kind", ["save", "ckpt"])
def test_the_guides_null_frequency_is_off(kind, tmp_path):
    """The guide's exp_ctrl.save_freq_*=null: off, as 0 is. With all three null the checkpointer
    never finds an HF save (save) or a recover checkpoint (ckpt) due."""
    from types import SimpleNamespace

    from areal_kit.rl.driver.checkpointer import Checkpointer

    keys = [f"{kind}_freq_{u}" for u in ("epochs", "steps", "secs")]
    cfg = load_config("1.5B_n4", [f"exp_ctrl.{k}=null" for k in keys])
    assert [getattr(cfg.exp_ctrl, k) for k in keys] == [0, 0, 0]
    rule = getattr(Checkpointer(SimpleNamespace(cfg=cfg), None), "saves" if kind == "save" else "checkpoints")
    assert not any(rule.due(step, epoch=step, end_of_epoch=True, seconds_since=1e6) for step in range(1, 50))
    on = load_config("1.5B_n4", [f"exp_ctrl.{keys[1]}=1"])  # the same rule with steps=1: due each step
    assert getattr(Checkpointer(SimpleNamespace(cfg=on), None), "saves" if kind == "save" else "checkpoints").due(3)
    # in a preset too
    p = write(tmp_path / "n.yaml", f"inherit: tiny\nexp_ctrl:\n  {keys[0]}: null\n")
    assert getattr(load_config(p).exp_ctrl, keys[0]) == 0


def test_inherit_cycle_stops(tmp_path):
    p = tmp_path / "loop.yaml"
    write(p, f"inherit: {p}\n")
    with pytest.raises(ConfigError, match="inherit chain is deeper than 5"):
        load_config(str(p))


def test_unknown_preset_lists_the_real_ones():
    with pytest.raises(ConfigError) as e:
        load_config("1.5B_n8")
    for name in ("tiny", "1.5B_n1", "1.5B_n4", "1.5B_n16", "7B_n4", "7B_n16"):
        assert name in str(e.value)
    assert "_gpu_base" not in str(e.value)


# ------------------------------------------------------------------ cluster spec
def spec(tmp_path, **fields):
    data = {"cluster_type": "local", "cluster_name": "c", "fileroot": str(tmp_path / "fr"),
            "default_mount": "/storage:/storage", "n_gpus_per_node": 8, **fields}
    return write(tmp_path / "spec.json", json.dumps(data))


def test_fileroot_from_cluster_spec(tmp_path):
    cfg = load_config("1.5B_n1", [f"cluster={spec(tmp_path)}"])
    assert cfg.fileroot == str(tmp_path / "fr")
    # an explicit fileroot wins over the spec's
    cfg = load_config("1.5B_n1", [f"cluster={spec(tmp_path)}", f"fileroot={tmp_path}/own"])
    assert cfg.fileroot == str(tmp_path / "own")


def test_cluster_spec_gpu_count_must_match(tmp_path):
    with pytest.raises(ConfigError, match="has n_gpus_per_node=8 but the config has n_gpus_per_node=2"):
        load_config("tiny", [f"cluster={spec(tmp_path)}"])
    # 0 = a CPU cluster: not compared
    load_config("tiny", [f"cluster={spec(tmp_path, n_gpus_per_node=0)}"])


def test_cluster_spec_host_count_must_match(tmp_path):
    p = spec(tmp_path, hosts=["h1", "h2"])
    with pytest.raises(ConfigError, match="has n_nodes=2 but the config has n_nodes=4"):
        load_config("1.5B_n4", [f"cluster={p}"])


def test_broken_cluster_spec_fails_even_with_fileroot(tmp_path):
    p = write(tmp_path / "broken.json", "{")
    from areal_kit.errors import UserError

    with pytest.raises(UserError, match="invalid JSON"):
        load_config("tiny", [f"cluster={p}", f"fileroot={tmp_path}"])


# ------------------------------------------------------------------ --show-args help
def test_every_option_has_help_in_its_field_metadata():
    empty = [k for k, f in all_keys().items() if not f.metadata.get("help", "").strip()]
    assert empty == [], f"options without help in config/: {empty}"


def test_every_section_has_help_in_its_field_metadata():
    sections = [f"{cls.__name__}.{f.name}" for cls in (TrainConfig, PPOConfig, MFCConfig)
                for f in dataclasses.fields(cls) if dataclasses.is_dataclass(f.default_factory)]
    # The walk finds the sections (a broken one would find none of them).
    assert {"TrainConfig.actor", "TrainConfig.ppo", "TrainConfig.rollout", "PPOConfig.gen",
            "MFCConfig.mb_spec"} <= set(sections), f"sections found: {sections}"
    empty = [s for s in sections if not _field(s).metadata.get("help", "").strip()]
    assert empty == [], f"sections without help: {empty}"


def _field(dotted: str):
    cls_name, name = dotted.split(".")
    cls = {"TrainConfig": TrainConfig, "PPOConfig": PPOConfig, "MFCConfig": MFCConfig}[cls_name]
    return next(f for f in dataclasses.fields(cls) if f.name == name)


def test_help_texts_are_the_schema_fields_metadata():
    keys = all_keys()
    assert keys["ppo.kl_estimator"].metadata["help"].startswith("KL estimator: k1")
    assert keys["actor_train.mb_spec.max_tokens_per_mb"].metadata["help"].startswith(
        "Most tokens in one packed micro-batch")
    # one text for a group of options, naming each option's unit
    for kind, what in (("save", "Persistent HF saves"), ("ckpt", "Recover checkpoints")):
        for unit, said in (("epochs", "epochs"), ("steps", "steps"), ("secs", "seconds")):
            assert keys[f"exp_ctrl.{kind}_freq_{unit}"].metadata["help"].startswith(f"{what} every N {said} (0 or")
    # a text written over several source lines is one line of help
    recover = keys["recover_mode"].metadata["help"]
    assert "fault" in recover, recover
    assert "disabled" in recover, recover
    assert "\n" not in recover, recover


def test_the_comment_parser_is_gone():
    assert not hasattr(loader, "field_help"), "loader still parses help out of source comments"


@pytest.mark.parametrize("key", [k for k, f in all_keys().items() if "choices" in f.metadata])
def test_a_value_outside_the_choices_is_refused_naming_them(key):
    choices = all_keys()[key].metadata["choices"]
    bad = 9 if isinstance(choices[0], int) else "bogus"
    expected = f"{key}={bad!r} is not valid; expected one of {', '.join(map(str, choices))}"
    with pytest.raises(ConfigError) as e:
        load_config("tiny", [f"{key}={bad}"])
    assert expected in str(e.value)


def test_describe_options_is_json_with_the_loaded_values():
    cfg = load_config("tiny", ["ppo.gen.max_new_tokens=2", "ppo.reward_fns=[toy,math]", "ppo.kl_estimator=k2"])
    rows = json.loads(json.dumps(describe_options(cfg)))
    assert [r["key"] for r in rows] == list(all_keys()), "not every key, or not in schema order"
    by_key = {r["key"]: r for r in rows}
    assert by_key["ppo.gen.max_new_tokens"] == {"key": "ppo.gen.max_new_tokens", "value": 2, "type": "int",
                                                "default": 16384, "help": "Most tokens generated per answer."}
    assert by_key["ppo.reward_fns"]["value"] == ["toy", "math"]
    assert by_key["ppo.reward_fns"]["default"] == ["math"]
    assert by_key["ppo.reward_fns"]["type"] == "list[str]"
    assert by_key["ppo.kl_estimator"]["value"] == "k2"
    assert by_key["ppo.kl_estimator"]["choices"] == ["k1", "k2", "k3"]
    assert "choices" not in by_key["actor.lr"], "a free-valued option lists choices"


def test_mutable_defaults_are_not_shared():
    a, b = PPOConfig(), PPOConfig()
    a.reward_fns.append("toy")
    assert b.reward_fns == ["math"]


def test_describe_args_values():
    rows = {k: (v, h) for k, v, h in describe_args(load_config("7B_n4"))}
    assert rows["ppo.group_size"][0] == "16"
    assert rows["allocation_mode"][0] == "'vllm.d4p1m4+d8p2m1'"
    assert rows["ppo.reward_fns"][0] == "['math']"
    assert len(rows) == len(all_keys())


def test_all_keys_are_dotted_leaves():
    keys = all_keys()
    assert "ppo.gen.max_new_tokens" in keys
    assert "ref_inf.mb_spec.max_tokens_per_mb" in keys
    assert "ppo" not in keys
    assert "ppo.gen" not in keys
    assert preset_names() == sorted(["tiny", "tiny_dapo", "tiny_storage", "1.5B_1gpu", "1.5B_n1", "1.5B_n1_dapo", "1.5B_n4",
                                            "1.5B_n16", "7B_n4", "7B_n16", "tiny_lora", "7B_n1_lora", "tiny_tool"])
