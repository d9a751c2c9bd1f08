"""An agent's episode whose calls do not all extend each other (rl/engine/segments.py): calls that
extend join into one sequence, a call that does not starts a segment of its own, and each segment
trains as its own sequence, its loss over exactly the tokens its calls sampled, with their
logprobs and versions. Reward shaping counts the episode once in its group's baseline; the episode
metrics count episodes, not sequences. The same through the real endpoint with a Qwen3-style
template: tests/integration/test_endpoint.py."""

import pytest
import torch

from areal_kit.api import Trajectory
from areal_kit.config.schema import PPOConfig
from areal_kit.rl.algo.batch import episode_stats, episodes, informative_groups, shape_rewards, step_stats
from areal_kit.rl.algo.packing import Answers
from areal_kit.rl.algo.ppo import loss_masks
from areal_kit.rl.engine.endpoint import Call
from areal_kit.rl.engine.segments import episode_of
from areal_kit.rl.engine.worker import answer_text, episode_samples, turn_fields
from areal_kit.rl.sample import Sample, trainer_rows

pytestmark = pytest.mark.unit


def calls() -> list[Call]:
    """Four calls: 1 extends 0 (the tool's [5] between), 2 re-renders the first reply ([3, 4]
    became [9]) so starts a segment, 3 extends 2 (the template's [10] between)."""
    return [Call([1, 2], [3, 4], [-0.5, -0.25], "stop", version=1, call=0),
            Call([1, 2, 3, 4, 5], [6], [-1.0], "stop", version=1, call=1),
            Call([1, 2, 9, 5, 6, 7], [8, 8], [-0.1, -0.2], "stop", version=2, call=2),
            Call([1, 2, 9, 5, 6, 7, 8, 8, 10], [11], [-0.3], "length", version=3, call=3)]


def test_calls_that_extend_join_and_a_call_that_does_not_starts_a_segment():
    t = episode_of(calls(), 0.5)
    t.check()
    assert t.segments is not None and len(t.segments) == 2
    a, b = t.segments
    assert (a.prompt_ids, a.output_ids, a.loss_mask, a.logprobs, a.versions) == (
        [1, 2], [3, 4, 5, 6], [1, 1, 0, 1], [-0.5, -0.25, 0.0, -1.0], [1, 1, 1, 1])
    assert (b.prompt_ids, b.output_ids, b.loss_mask, b.logprobs, b.versions) == (
        [1, 2, 9, 5, 6, 7], [8, 8, 10, 11], [1, 1, 0, 1], [-0.1, -0.2, 0.0, -0.3], [2, 2, 2, 3])
    assert (a.no_eos, b.no_eos, t.no_eos) == (False, True, True)  # the episode ends as its last call
    assert (a.reward, b.reward, t.reward) == (None, None, 0.5)  # one reward, the episode's
    assert (t.n_turns, t.n_model_tokens, t.n_env_tokens) == (4, 6, 2)
    # A tool answer inside each segment, and the first segment's last call answered before the second.
    assert t.n_tool_calls == 3


def test_an_episode_whose_calls_all_extend_is_one_sequence():
    first = Call([1, 2], [3, 4], [-0.5, -0.25], "stop", version=1, call=0)
    t = episode_of([first, Call([1, 2, 3, 4, 5], [6], [-1.0], "length", version=2, call=1)], None)
    assert t.segments is None and t.sequences == [t]
    assert (t.prompt_ids, t.output_ids, t.loss_mask, t.versions) == ([1, 2], [3, 4, 5, 6], [1, 1, 0, 1], [1, 1, 1, 2])
    assert t.no_eos and t.reward is None
    # A shorter prompt than the episode so far does not extend it either.
    t = episode_of([first, Call([1, 2, 3], [6], [-1.0], "stop", version=2, call=1)])
    assert t.segments is not None and [s.prompt_ids for s in t.segments] == [[1, 2], [1, 2, 3]]


def test_one_reward_per_call_gives_each_segment_its_last_call_s():
    t = episode_of(calls(), [0.1, 0.2, 0.3, 0.4])
    assert t.segments is not None
    assert [s.reward for s in t.segments] == [0.2, 0.4] and t.reward == 0.4
    one = episode_of(calls()[:2], [0.0, 1.0])  # one sequence: its last call's
    assert one.segments is None and one.reward == 1.0
    with pytest.raises(ValueError, match="returned 3 rewards for the 4 calls the endpoint answered"):
        episode_of(calls(), [0.1, 0.2, 0.3])


def test_episodes_without_calls_or_with_several_choices_are_refused():
    with pytest.raises(ValueError, match="without calls"):
        episode_of([])
    c = calls()[0]
    with pytest.raises(ValueError, match="n > 1"):
        episode_of([c, Call(c.prompt_ids, [7], [-0.1], "stop", version=1, call=0, choice=1)])
    with pytest.raises(ValueError, match="do not nest"):
        Trajectory.of_segments([episode_of(calls())])


ROW = {"id": "p0", "prompt_ids": [1, 2], "prompt_text": "q"}


def group(rewards: list, shared: list) -> list[Sample]:
    """A group of two episodes of prompt p0: the four calls' episode (two segments) with `rewards`
    (what the agent returned), and a one-call episode with task reward `shared`."""
    one = episode_of([Call([1, 2], [7], [-0.7], "stop", version=1, call=0)], shared)
    out = []
    for i, t in enumerate([episode_of(calls(), rewards), one]):
        out += episode_samples(ROW, 0, i, t, version=1, task_reward=float(t.reward or 0.0), format_reward=None)
    return out


def test_each_segment_trains_as_a_sequence_its_loss_over_exactly_its_sampled_tokens():
    samples = group(1.0, 0.0)
    assert [s.episode for s in samples] == [0, 0, None] and len(episodes(samples)) == 2
    rows = trainer_rows(shape_rewards(samples, PPOConfig(group_size=2)).train)
    assert len(rows) == 3  # three sequences for the trainer
    mask = loss_masks(rows, Answers([len(r.output_ids) for r in rows])).tolist()
    at = 0
    sampled = [calls()[:2], calls()[2:], [Call([1, 2], [7], [-0.7], "stop", version=1)]]
    for row, made in zip(rows, sampled):
        m = mask[at:at + len(row.output_ids)]
        at += len(row.output_ids)
        assert row.prompt_ids == made[0].prompt_ids
        assert [x for x, k in zip(row.output_ids, m) if k] == [t for c in made for t in c.token_ids]
        assert [x for x, k in zip(row.logprobs, m) if k] == [x for c in made for x in c.logprobs]


def test_the_group_baseline_counts_an_episode_once():
    """GRPO over the group's two episodes (rewards 1 and 0: mean 0.5, std 0.5), not its three
    sequences (which would give mean 2/3): the segmented episode's both sequences get +1."""
    out = shape_rewards(group(1.0, 0.0), PPOConfig(group_size=2, group_adv_norm=True))
    assert [round(s.seq_reward, 4) for s in out.samples] == [1.0, 1.0, -1.0]
    assert out.final_reward_mean == pytest.approx(0.5) and out.perc_zero_adv == 0.0
    # Per-call rewards: each sequence its own reward against the moments of the group's episodes
    # (episode rewards 0.4, the last segment's, and 0.0: mean 0.2, std 0.2).
    out = shape_rewards(group([0.1, 0.2, 0.3, 0.4], 0.0), PPOConfig(group_size=2, group_adv_norm=True))
    assert [s.task_reward for s in out.samples] == [0.2, 0.4, 0.0]
    assert [round(s.seq_reward, 4) for s in out.samples] == [0.0, 1.0, -1.0]


def test_truncation_and_zero_advantage_are_the_episode_s():
    # The segmented episode ends truncated: under overlong_filter both its sequences leave the loss.
    out = shape_rewards(group(1.0, 0.0), PPOConfig(group_size=2, overlong_filter=True))
    assert [sum(s.loss_mask) for s in out.train] == [0, 0, 1] and out.overlong_masked == 0.5
    # Equal episode rewards: the group is dropped whole, segments and all.
    ppo = PPOConfig(group_size=2, group_adv_norm=True, skip_zero_adv_groups=True)
    both = group(1.0, 1.0) + [Sample("p1", 1, [1], [2], [-0.1], False, 1, r) for r in (0.0, 1.0)]
    out = shape_rewards(both, ppo)
    assert out.perc_zero_adv == 0.5 and [s.id for s in out.train] == ["p1", "p1"]
    # Dynamic sampling judges episodes too: per-call rewards that differ within one episode are no
    # signal while the group's episodes end equal.
    assert informative_groups(group([0.0, 0.2, 0.3, 1.0], 1.0)) == ([], 1)
    assert len(informative_groups(group([0.0, 0.2, 0.3, 1.0], 0.0))[0]) == 1


def test_metrics_count_episodes_and_say_how_many_segments_they_had():
    samples = group(1.0, 0.0)
    ep = episode_stats(samples, failed_calls=0)
    assert ep["episode/segments"] == 1.5 and ep["episode/turns"] == 2.5
    assert ep["episode/tool_calls"] == 1.5 and ep["episode/tool_call_share"] == 0.5
    assert ep["episode/model_tokens"] == 3.5 and ep["episode/env_tokens"] == 1.0
    row = step_stats(samples, shape_rewards(samples, PPOConfig(group_size=2)), {})
    assert row["n_seqs"] == 3 and row["task_reward"] == 0.5 and row["no_eos_ratio"] == 0.5
    assert row["avg_seq_len"] == 3.5  # the model's tokens per episode


def test_rewards_grade_the_model_text_of_every_segment():
    t = episode_of(calls())
    def words(ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    assert answer_text(t, words) == "3 4 6" + "8 8 11"
    fields = turn_fields(t, words)
    assert [x["role"] for x in fields["turns"]] == ["model", "env", "model", "model", "env", "model"]
    assert fields["env_text"] == "5" + "10"


def test_a_segment_s_mask_leaves_the_template_s_tokens_out_of_the_ppo_actor_s_loss():
    """What the trainer computes from: loss_masks of the rows (rl/algo/ppo.py), one sequence per segment."""
    rows = trainer_rows(episode_samples(ROW, 0, 0, episode_of(calls(), 1.0), 1, 1.0, None))
    mask = loss_masks(rows, Answers([len(r.output_ids) for r in rows]))
    assert torch.equal(mask, torch.tensor([1.0, 1, 0, 1, 1, 1, 0, 1]))
