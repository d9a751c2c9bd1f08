"""The DAPO-era recipe pieces, each against a hand computation: overlong reward shaping and
overlong filtering (rl/algo/batch.py, functional.py), the group choice of dynamic sampling,
dataset.mix (data/prompts.py, config/dataset.py), a recover checkpoint of a step that took more
than one batch, and the plot's eval and per-source panels (monitor.py). The same pieces run
through the real engine in tests/integration/test_recipes_tiny.py."""

import json
from pathlib import Path

import pytest
import torch

from areal_kit.config.loader import load_config
from areal_kit.config.schema import ConfigError, GenConfig, PPOConfig
from areal_kit.curves import extra_panels, write_png
from areal_kit.data.prompts import PromptLoader, mix_rows
from areal_kit.errors import UserError
from areal_kit.rl.algo import functional as Fn
from areal_kit.rl.algo.batch import Shaped, informative_groups, overlong_penalty, shape_rewards, step_stats
from areal_kit.rl.driver.job import RunState
from areal_kit.rl.sample import Sample

pytestmark = pytest.mark.unit


def ppo(**kw):
    return PPOConfig(group_size=2, group_adv_norm=True, gen=GenConfig(max_new_tokens=10), **kw)


def sample(pid, group, reward, n_tokens, no_eos=False, **extra):
    return Sample(pid, group, [1, 2], [5] * n_tokens, [0.0] * n_tokens, no_eos, 0, reward, **extra)


# ------------------------------------------------------------------ overlong shaping
def test_overlong_penalty_is_dapos_linear_ramp_over_the_buffer():
    p = ppo(overlong_buffer=4, overlong_penalty_factor=0.5)
    # max_new_tokens 10, buffer 4: free up to 6 tokens, then -0.5 * (L - 6) / 4
    assert [overlong_penalty(n, p) for n in (1, 6, 7, 8, 10)] == [0.0, 0.0, -0.125, -0.25, -0.5]
    assert overlong_penalty(10, ppo()) == 0.0  # buffer 0: off


def test_shaped_reward_adds_the_penalty_and_the_metric_is_its_mean():
    p = ppo(overlong_buffer=4, overlong_penalty_factor=1.0)
    ss = [sample("a", 0, 1.0, 8), sample("a", 1, 1.0, 3)]
    out = shape_rewards(ss, p)
    assert [s.final_reward for s in out.samples] == [0.5, 1.0]  # 1 - (8 - 6) / 4, and 1
    assert out.overlong_penalty == pytest.approx(-0.25)
    assert out.perc_zero_adv == 0.0  # equal task rewards, unequal shaped ones: a signal
    row = step_stats(ss, out, {})
    assert row["overlong_penalty"] == pytest.approx(-0.25)


def test_a_bad_buffer_is_one_line():
    with pytest.raises(ConfigError, match=r"ppo.overlong_buffer=10 .*expected 0 \(off\) up to"):
        ppo(overlong_buffer=10)


# ------------------------------------------------------------------ overlong filtering
def test_overlong_filter_keeps_truncated_answers_in_the_baseline_but_not_in_the_loss():
    ss = [sample("a", 0, 1.0, 3), sample("a", 1, 0.0, 10, no_eos=True)]
    out = shape_rewards(ss, ppo(overlong_filter=True))
    by_group = {s.group: s for s in out.train}
    assert by_group[1].loss_mask == [0] * 10
    assert by_group[0].loss_mask is None
    assert by_group[0].seq_reward > 0 > by_group[1].seq_reward  # normalized over both answers
    assert out.overlong_masked == 0.5


@pytest.mark.parametrize(("mode", "expected"), [
    ("token-mean", (1 + 3) / 2),  # the masked answer adds no tokens
    ("seq-mean-token-mean", ((1 + 3) / 2) / 1),  # nor an answer to the mean
    ("seq-mean-token-sum-norm", ((1 + 3) / 8) / 1),
])
def test_a_fully_masked_answer_is_not_counted_by_any_loss_agg(mode, expected):
    loss = [torch.tensor([1.0, 3.0]), torch.tensor([5.0, 7.0, 9.0])]
    masks = [torch.ones(2), torch.zeros(3)]
    assert Fn.aggregate(loss, masks, mode, 8).item() == pytest.approx(expected)


# ------------------------------------------------------------------ dynamic sampling
def test_informative_groups_judge_the_raw_task_reward_only():
    ss = [sample("a", 0, 1.0, 2, format_reward=0.5), sample("a", 0, 1.0, 2),  # equal accuracy
          sample("b", 1, 0.0, 2), sample("b", 1, 1.0, 2),
          sample("c", 2, 0.0, 2), sample("c", 2, 0.0, 2)]
    keep, dropped = informative_groups(ss)
    assert [[s.id for s in g] for g in keep] == [["b", "b"]]
    assert dropped == 2


def test_a_group_is_the_prompt_and_its_engine_group_number():
    # Two engines number their groups from 0: the same number under another prompt is another group.
    ss = [sample("a", 0, 1.0, 2), sample("b", 0, 0.0, 2), sample("a", 0, 0.0, 2), sample("b", 0, 0.0, 2)]
    keep, dropped = informative_groups(ss)
    assert [g[0].id for g in keep] == ["a"] and dropped == 1


def test_dynamic_sampling_needs_groups():
    with pytest.raises(ConfigError, match="dynamic_sampling=true with ppo.group_size=1"):
        PPOConfig(group_size=1, dynamic_sampling=True)


# ------------------------------------------------------------------ dataset.mix
def rows(name, n):
    return [{"id": f"{name}/q{i}", "source": name, "question": f"q{i}", "answer": "1"} for i in range(n)]


def test_mix_weights_take_a_seeded_share_of_each_source():
    base = rows("math", 10) + rows("code", 6)
    mix = [{"name": "math", "weight": 0.5}, {"name": "code", "weight": 2.0}]
    got = mix_rows(base, mix, seed=3)
    math = [r for r in got if r["source"] == "math"]
    code = [r for r in got if r["source"] == "code"]
    assert len(math) == 5 and len(code) == 12
    assert len({r["id"] for r in got}) == len(got)  # a copy is another prompt to the loader
    assert {r["id"] for r in code} >= {f"code/q{i}#2" for i in range(6)}
    assert mix_rows(base, mix, seed=3) == got  # a pure function of the seed
    assert [r["id"] for r in mix_rows(base, mix, seed=4) if r["source"] == "math"] != [r["id"] for r in math]


def test_a_mix_resumes_at_the_exact_position():
    got = mix_rows(rows("a", 9) + rows("b", 9), [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}], 1)
    run = PromptLoader(got, 4, seed=1)
    for _ in range(5):
        run.next_batch()
    resumed = PromptLoader(mix_rows(rows("a", 9) + rows("b", 9),
                                    [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.5}], 1), 4, seed=1)
    resumed.seek(5)
    assert resumed.next_batch() == run.next_batch()


def test_a_source_weighed_to_nothing_is_one_line():
    with pytest.raises(UserError, match="dataset.mix source 'b' gives no training rows"):
        mix_rows(rows("a", 4) + rows("b", 2), [{"name": "a", "weight": 1.0}, {"name": "b", "weight": 0.1}], 1)


@pytest.mark.parametrize(("mix", "message"), [
    ('[{path: a.jsonl, type: jsonl, weight: 0}]', r"dataset.mix\[0\].weight=0 is not valid; expected a number > 0"),
    ('[{path: a.jsonl, type: jsonl, wieght: 1}]', r"dataset.mix\[0\] has unknown key\(s\) wieght"),
    ('[{path: a.jsonl, type: csv}]', r"dataset.mix\[0\].type='csv' is not valid"),
    ('[{path: x/a.jsonl, type: jsonl}, {path: y/a.jsonl, type: jsonl}]', r"names \['a', 'a'\] are not unique"),
    ('[{type: jsonl}]', r"dataset.mix\[0\] has no path for type jsonl"),
])
def test_a_bad_mix_is_one_line(mix, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", [f"dataset.mix={mix}"])


def test_a_mix_with_a_path_is_refused():
    with pytest.raises(ConfigError, match="dataset.path='a.jsonl' and dataset.mix are both set"):
        load_config("tiny", ["dataset.path=a.jsonl", "dataset.type=jsonl", "dataset.mix=[{path: b.jsonl}]"])


def test_mix_entries_take_unset_keys_from_dataset():
    mix = "[{path: /d/gsm.jsonl, type: jsonl, weight: 2}, {type: toy, name: sums}]"
    cfg = load_config("tiny", ["dataset.question_field=q", f"dataset.mix={mix}"])
    gsm, sums = cfg.dataset.mix
    assert (gsm["name"], gsm["question_field"], gsm["weight"]) == ("gsm", "q", 2.0)
    assert (sums["name"], sums["type"], sums["weight"]) == ("sums", "toy", 1.0)


def test_step_stats_report_each_sources_task_reward():
    ss = [sample("a", 0, 1.0, 2, source="math"), sample("a", 0, 0.0, 2, source="math"),
          sample("b", 1, 1.0, 2, source="code")]
    row = step_stats(ss, Shaped(ss, ss, list(range(len(ss))), perc_zero_adv=0.0, final_reward_mean=0.0), {})
    assert row["task_reward/math"] == 0.5 and row["task_reward/code"] == 1.0


# ------------------------------------------------------------------ recover of a multi-batch step
def test_the_loader_position_is_the_batches_taken_not_the_steps(tmp_path):
    from test_recover_checkpoint import Ctrl, dump, load, make_job

    job = make_job(tmp_path)
    c = Ctrl(job, 2)
    c.state.batches = 5  # two steps that took five batches between them (dynamic sampling)
    st = json.loads(Path(dump(c), "state.json").read_text())
    assert st["batches"] == 5 and st["sampling"]["next_step_index"] == 5
    assert st["loader"] == job.loader.state_at(5)
    state = load(make_job(tmp_path), c.log)
    assert (state.global_step, state.batches) == (2, 5)
    assert isinstance(state, RunState)


# ------------------------------------------------------------------ plot
def test_plot_adds_the_eval_and_per_source_panels(tmp_path):
    rows_ = [{"global_step": i, "task_reward": 0.1 * i, "task_reward/math": 0.1, "task_reward/code": 0.2,
              **({"eval/pass@1": 0.5, "eval/avg@4": 0.4, "eval/pass@4": 0.8} if i % 2 else {})} for i in range(1, 7)]
    panels = extra_panels(rows_)
    assert [keys for _, _, keys in panels] == [["task_reward/code", "task_reward/math"],
                                               ["eval/avg@4", "eval/pass@1", "eval/pass@4"]]
    out = tmp_path / "m.png"
    write_png(rows_, str(out))
    assert out.stat().st_size > 10_000
    assert extra_panels([{"global_step": 1, "task_reward": 0.0}]) == []


# ------------------------------------------------------------------ clip-higher
def test_clip_higher_lets_a_positive_advantage_ratio_grow_past_eps_clip():
    old = torch.zeros(3)
    logp = torch.log(torch.tensor([1.25, 1.35, 0.7]))  # ratios
    adv = torch.tensor([1.0, 1.0, -1.0])
    sym, _ = Fn.ppo_loss(logp, old, adv, 0.2)
    high, st = Fn.ppo_loss(logp, old, adv, 0.2, eps_clip_high=0.28)
    assert sym.tolist() == pytest.approx([-1.2, -1.2, 0.8])  # both clipped at 1.2; 0.7 -> 0.8 below
    assert high.tolist() == pytest.approx([-1.25, -1.28, 0.8])  # 1.25 inside the wider range, 1.35 at 1.28
    assert st["clip"].tolist() == [0.0, 1.0, 1.0]


def test_clip_high_below_eps_clip_is_one_line():
    with pytest.raises(ConfigError, match=r"ppo.eps_clip_high=0.1 is not valid; expected 0 \(= eps_clip\)"):
        PPOConfig(eps_clip_high=0.1)
