"""The presets in train_scripts/: the guide's settings, and `--dry-run` of each on this CPU machine."""

import pytest
from areal_kit.train_scripts import preset_names
from cli_run import dry_run

from areal_kit.cli import main
from areal_kit.config.alloc import parse_allocation
from areal_kit.config.loader import load_config

GPU_PRESETS = ["1.5B_n1", "1.5B_n4", "1.5B_n16", "7B_n4", "7B_n16"]

# The AReaL guide's presets: -> allocation_mode, prompts, group, max_new_tokens, ppo_n_minibatches, kl_ctl
TABLE = {
    "1.5B_n1": ("actor_gen:d4p1m2,*:d4p2m1", 1024, 8, 16384, 1, 0.001),
    "1.5B_n4": ("vllm.d16p1m1+d8p2m1", 1024, 8, 16384, 1, 0.001),
    "1.5B_n16": ("vllm.d64p1m1+d32p2m1", 1024, 8, 16384, 1, 0.001),
    "7B_n4": ("vllm.d4p1m4+d8p2m1", 1024, 16, 16384, 4, 0.01),
    "7B_n16": ("vllm.d16p1m4+d32p2m1", 1024, 16, 16384, 4, 0.01),
}
NODES = {"1.5B_n1": 1, "1.5B_n4": 4, "1.5B_n16": 16, "7B_n4": 4, "7B_n16": 16}


@pytest.fixture(autouse=True)
def _cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("AREAL_DEVICE", raising=False)
    monkeypatch.setenv("AREAL_USER", "tester")


def test_the_presets_exist():
    assert sorted(preset_names()) == sorted(["tiny", "tiny_storage", *GPU_PRESETS, *DAPO_PRESETS, "1.5B_1gpu",
                                             *LORA_PRESETS, "tiny_tool"])


DAPO_PRESETS = ["tiny_dapo", "1.5B_n1_dapo"]
LORA_PRESETS = ["tiny_lora", "7B_n1_lora"]


@pytest.mark.parametrize("name", DAPO_PRESETS)
def test_dapo_variants_turn_the_recipe_on_over_their_base(name):
    cfg, base = load_config(name), load_config(name.removesuffix("_dapo"))
    p = cfg.ppo
    assert p.dynamic_sampling and p.dynamic_sampling_max_rounds >= 1
    assert (p.eps_clip, p.eps_clip_high) == (0.2, 0.28)
    assert 0 < p.overlong_buffer < p.gen.max_new_tokens
    assert p.group_adv_norm and p.loss_agg == "token-mean"
    assert cfg.exp_ctrl.eval_every and cfg.exp_ctrl.eval_n_samples >= 8 and cfg.dataset.eval_size
    assert (cfg.allocation_mode, cfg.actor.path) == (base.allocation_mode, base.actor.path)
    assert cfg.experiment_name != base.experiment_name  # its runs never resume the base's checkpoints


@pytest.mark.parametrize("name", ["tiny", "tiny_storage", *GPU_PRESETS])
def test_preset_loads(name):
    cfg = load_config(name)
    assert cfg.actor.path
    parse_allocation(cfg.allocation_mode).check(cfg.n_nodes, cfg.n_gpus_per_node)


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_guide_table(name):
    cfg = load_config(name)
    got = (cfg.allocation_mode, cfg.dataset.train_bs_n_seqs, cfg.ppo.group_size, cfg.ppo.gen.max_new_tokens,
           cfg.ppo.ppo_n_minibatches, cfg.ppo.kl_ctl)
    assert got == TABLE[name]
    assert (cfg.n_nodes, cfg.n_gpus_per_node) == (NODES[name], 8)


@pytest.mark.parametrize("name", GPU_PRESETS)
def test_guide_shared_settings(name):
    cfg = load_config(name)
    p, x = cfg.ppo, cfg.exp_ctrl
    assert (x.total_train_epochs, x.save_freq_epochs, x.ckpt_freq_secs) == (10, 1, 600)
    assert (cfg.recover_mode, cfg.recover_retries) == ("auto", 10)
    assert p.reward_output_scaling == 5
    assert p.adv_norm is True
    assert p.group_adv_norm is False
    assert (p.gen.temperature, p.gen.top_p) == (0.6, 1.0)
    assert cfg.actor.lr == 1e-6
    assert cfg.actor.lr_scheduler == "constant"
    assert cfg.actor.warmup_steps_proportion == 0
    assert cfg.dataset.max_prompt_len == 2048
    assert p.eps_clip == 0.2
    budget = 2048 + p.gen.max_new_tokens + 1024
    assert cfg.actor_train.mb_spec.max_tokens_per_mb == budget == 19456
    assert cfg.ref_inf.mb_spec.max_tokens_per_mb == budget
    size = "7B" if name.startswith("7B") else "1.5B"
    assert cfg.actor.path == f"/storage/models/DeepSeek-R1-Distill-Qwen-{size}"
    assert cfg.actor.path.startswith(cfg.storage_root)


def test_tiny_runs_on_one_cpu_machine():
    cfg = load_config("tiny")
    assert cfg.n_nodes == 1
    assert cfg.actor.path.startswith("tiny://")
    assert cfg.dataset.type == "toy"
    assert cfg.ppo.group_adv_norm is True
    assert cfg.ppo.group_size >= 2
    assert cfg.dataset.train_bs_n_seqs >= 32  # fewer prompts a step collapse the toy task




@pytest.mark.parametrize("name", GPU_PRESETS)
def test_gpu_preset_dry_run_on_cpu(name, capsys, tmp_path):
    out = dry_run(["train", name, "--dry-run"], capsys)
    cfg = load_config(name)
    a = parse_allocation(cfg.allocation_mode)
    n = NODES[name]
    p = cfg.ppo
    n_seqs = 1024 * p.group_size
    assert f"cluster: {n} node(s) x 8 GPU(s) = {8 * n} GPUs" in out
    need = f"{a.gen_gpus}+{a.train_gpus}={a.total_gpus}" if a.kind == "decoupled" else str(a.total_gpus)
    assert f"{cfg.allocation_mode} needs {need} GPUs, cluster has {n}x8={8 * n}: ok" in out
    assert f"generation: {a.gen_gpus} GPUs as {a.gen.dp} vLLM engine(s), tensor parallel {a.gen.tp}" in out
    assert f"training: {a.train_gpus} GPUs, DeepSpeed ZeRO-{cfg.actor.zero_stage} over {a.train.world} rank(s)" in out
    assert f"batch: 1024 prompts x {p.group_size} answers = {n_seqs} sequences" in out
    assert f"{p.ppo_n_minibatches} optimizer step(s) per batch" in out
    assert "tokens: prompt <= 2048, answer <= 16384; micro-batches <= 19456 tokens" in out
    assert f"at most {n_seqs * (2048 + 16384):,} tokens a batch" in out
    trial = f"ppo-r1-distill/{name}"
    assert f"logs: {tmp_path}/areal_runs/logs/tester/{trial}/train.log" in out
    assert f"recover: {tmp_path}/areal_runs/recover/tester/{trial}" in out
    assert f"checkpoints: {tmp_path}/areal_runs/checkpoints/tester/{trial}/actor" in out
    assert "dry run: configuration is valid" in out


def test_a_shared_gpu_preset_says_where_it_runs(capsys, monkeypatch):
    """1.5B_n1 keeps the guide's allocation (generation and training on the same 8 GPUs): CPU nodes
    share cores; on GPU nodes (forced with AREAL_DEVICE=cuda, none here) the roles take turns, the
    engines asleep while the trainer trains, and the split layout still runs too."""
    out = dry_run(["train", "1.5B_n1", "--dry-run"], capsys)
    assert ("training: 8 GPUs, DeepSpeed ZeRO-2 over 8 rank(s) (d4m1p2) sharing the generation GPUs (on CPU: "
            "worker slots on the same cores)") in out
    monkeypatch.setenv("AREAL_DEVICE", "cuda")
    out = dry_run(["train", "1.5B_n1", "--dry-run"], capsys)
    assert ("sharing the generation GPUs, taking turns: the engines sleep (vLLM sleep level 2) while the trainer "
            "trains, then wake for the weight sync") in out
    assert ("weight sync: ipc (auto on shared GPUs): each trainer rank hands the engine worker beside it one CUDA IPC "
            "buffer") in out
    assert "dry run: configuration is valid" in out
    out = dry_run(["train", "1.5B_n1", "--dry-run", "allocation_mode=vllm.d2p1m2+d4p1m1"], capsys)
    assert "dry run: configuration is valid" in out and "taking turns" not in out
    # The tiny preset on one GPU: a shared d1p1m1, synchronous (turns cannot overlap).
    out = dry_run(["train", "tiny", "--dry-run", "allocation_mode=d1p1m1", "n_gpus_per_node=1",
                   "ppo.max_head_offpolicyness=0"], capsys)
    assert "trainer rank 0: 1 group x 1 bundle {GPU: 1, CPU: 2}; engine 0 (tp 1) on those ranks' GPUs" in out
    with pytest.raises(SystemExit) as got:
        main(["train", "tiny", "--dry-run", "allocation_mode=d1p1m1", "n_gpus_per_node=1"])
    assert got.value.code == 2
    assert "use ppo.max_head_offpolicyness=0" in capsys.readouterr().err


def test_dry_run_numbers_for_1p5b_n4(capsys):
    out = dry_run(["train", "1.5B_n4", "--dry-run"], capsys)
    assert "needs 16+16=32 GPUs, cluster has 4x8=32: ok" in out
    assert "generation: 16 GPUs as 16 vLLM engine(s), tensor parallel 1" in out
    assert "training: 16 GPUs, DeepSpeed ZeRO-2 over 16 rank(s)" in out
    assert "batch: 1024 prompts x 8 answers = 8192 sequences" in out
    assert "weight sync: broadcast: trainer rank 0 broadcasts to 16 engine worker(s) in 32 MB buckets" in out


def test_dry_run_names_the_weight_sync_path(capsys, tmp_path):
    out = dry_run(["train", "tiny", "--dry-run"], capsys)
    assert "weight sync: auto: trainer rank 0 broadcasts to 1 engine worker(s)" in out
    assert "on CPU it writes engines on its node through shared memory" in out
    out = dry_run(["train", "7B_n4", "--dry-run", "weight_sync=disk", f"fileroot={tmp_path}"], capsys)
    assert f"weight sync: disk: trainer rank 0 saves a Hugging Face folder in {tmp_path}/cache/weight_sync/" \
           "ppo-r1-distill/7B_n4, 16 engine worker(s) reload it" in out


def test_dry_run_applies_overrides(capsys):
    out = dry_run(["train", "7B_n4", "ppo.gen.max_new_tokens=8192", "--dry-run",
                   "actor_train.mb_spec.max_tokens_per_mb=11264"], capsys)
    assert "answer <= 8192; micro-batches <= 11264 tokens" in out
    assert "generation: 16 GPUs as 4 vLLM engine(s), tensor parallel 4" in out


def test_dry_run_tiny_counts_steps(capsys):
    out = dry_run(["train", "tiny", "--dry-run"], capsys)
    cfg = load_config("tiny")
    spe = cfg.dataset.toy_size // cfg.dataset.train_bs_n_seqs
    assert f"dataset: {cfg.dataset.toy_size} prompts (built-in toy task); {spe} steps per epoch, " \
           f"{spe * cfg.exp_ctrl.total_train_epochs} steps in all" in out
    out = dry_run(["train", "tiny", "--dry-run", "exp_ctrl.total_train_steps=7"], capsys)
    assert "steps per epoch, 7 steps in all" in out


def test_dry_run_reads_a_local_dataset(capsys, tmp_path):
    pytest.importorskip("areal_kit.data.sources", reason="dataset loaders (data/sources.py) not written yet")
    rows = "".join(f'{{"question": "q{i}", "answer": "{i}"}}\n' for i in range(10))
    (tmp_path / "d.jsonl").write_text(rows)
    out = dry_run(["train", "tiny", "--dry-run", "dataset.type=jsonl", f"dataset.path={tmp_path}/d.jsonl",
                   "dataset.train_bs_n_seqs=4"], capsys)
    assert "dataset: 10 prompts" in out
    assert "2 steps per epoch" in out
