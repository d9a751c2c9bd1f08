"""A multi-turn episode built from its turns (areal_kit/api.py's Trajectory.from_turns): the
environment's tokens are context, never answer. They carry logprob 0 and loss mask 0, take the
weight version of the model token before them, and count in neither the answer's length (the
avg_seq_len metric, the overlong penalty) nor the text the rewards grade, which get the turns
apart instead. The trainer side is tests/unit/test_ppo_actor.py's episode test."""

import pytest

from areal_kit.api import Completion, Trajectory, Turn
from areal_kit.config.schema import GenConfig, PPOConfig
from areal_kit.rl.algo.batch import shape_rewards, step_stats
from areal_kit.rl.engine.worker import _sample, answer_text, turn_fields

pytestmark = pytest.mark.unit

WORDS = {1: "call", 2: "(3+4)", 7: "=7", 8: ";", 4: "7"}


def decode(ids: list[int]) -> str:
    return " ".join(WORDS.get(i, str(i)) for i in ids)


def episode(versions=None) -> Trajectory:
    v = versions or [None, None]
    return Trajectory.from_turns([Turn.model(Completion([1, 2], [-0.1, -0.2], "stop", v[0])),
                                  Turn.env([7, 8]),
                                  Turn.model(Completion([4], [-0.4], "stop", v[1]))])


def test_the_turns_make_tokens_logprobs_mask_and_versions():
    t = episode(versions=[[3, 3], [4]])
    t.check()
    assert t.output_ids == [1, 2, 7, 8, 4]
    assert t.logprobs == [-0.1, -0.2, 0.0, 0.0, -0.4]
    assert t.loss_mask == [1, 1, 0, 0, 1]
    assert t.versions == [3, 3, 3, 3, 4]  # the environment's tokens take the version before them
    assert t.n_model_tokens == 3
    assert episode().versions is None  # batch mode: no versions


@pytest.mark.parametrize(("turns", "why"), [
    ([Turn.env([7])], "first turn after the prompt is the model's"),
    ([], "first turn after the prompt is the model's"),
    ([Turn("model", [1, 2], [-0.1])], "a model turn of 2 tokens has 1 logprobs"),
    ([Turn.model(Completion([1], [-0.1], "stop")), Turn("tool", [5])], "expected 'model' or 'env'"),
])
def test_bad_turns_are_refused(turns, why):
    with pytest.raises(ValueError, match=why):
        Trajectory.from_turns(turns)


def test_rewards_grade_the_models_text_and_see_the_tools_apart():
    t = episode()
    assert answer_text(t, decode) == "call (3+4) 7"  # the model's turns' tokens, decoded as one
    assert turn_fields(t, decode) == {"turns": [{"role": "model", "text": "call (3+4)"},
                                                {"role": "env", "text": "=7 ;"},
                                                {"role": "model", "text": "7"}], "env_text": "=7 ;"}
    told = Trajectory.from_turns([Turn("model", [1], [-0.1], text="CALL "), Turn.env([7]), Turn.model(
        Completion([4], [-0.4], "stop"))])
    assert answer_text(told, decode) == "CALL 7"  # a turn's own text where the workflow gave one
    single = Trajectory([1, 2], [-0.1, -0.2])
    assert answer_text(single, decode) == "call (3+4)" and turn_fields(single, decode) == {}


def test_tool_tokens_count_in_no_length_metric_nor_the_overlong_penalty():
    ppo = PPOConfig(group_size=2, overlong_buffer=2, gen=GenConfig(max_new_tokens=4))
    row = {"id": "r", "prompt_ids": [9, 9]}
    long_tool = Trajectory.from_turns([Turn.model(Completion([1], [-0.1], "stop")), Turn.env([7] * 20),
                                       Turn.model(Completion([4], [-0.4], "stop"))])
    samples = [_sample(row, 0, long_tool, 0, 1.0, None), _sample(row, 0, Trajectory([1, 2, 3, 4], [-0.1] * 4), 0,
                                                                  1.0, None)]
    assert [s.model_len for s in samples] == [2, 4]
    shaped = shape_rewards(samples, ppo)
    # 2 model tokens are under max_new_tokens - overlong_buffer: no penalty, for all its 22 tokens;
    # the single-turn answer of 4 reaches max_new_tokens: the full penalty
    assert [s.final_reward for s in shaped.samples] == [1.0, 0.0]
    assert step_stats(samples, shaped, {})["avg_seq_len"] == 3.0
