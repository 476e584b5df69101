"""``rollout.replay`` (hl_core/rollout/replay.py): a run that replays another run's logged rollouts trains on them
token for token, the same per-update losses as the run that sampled them; the log's samples are what it reads (a
log sampled under another seed gives that run's losses instead); a foreign or broken log is refused naming the
file and the fix. Also the summary's CPU seconds."""

from __future__ import annotations

import json

import pytest

from helpers import REPO, read_jsonl, run_recipe
from hl_core.errors import DataError
from hl_core.rollout.replay import SampleReplay

ONLINE = REPO / "recipes" / "tiny" / "online_grpo_math.yaml"
STEPS = 3
# every update's groups sampled at update 0 by the initial policy (the real-model study's offline set)
COMMON = [f"train.max_steps={STEPS}", f"rollout.every={STEPS}", "eval.every=null", "checkpoint.save_final=false",
          "train.micro_batch_size=2", "rollout.num_generations=4", "rollout.reward.kind=callable",
          "rollout.reward.function=eval.addition:sum_credit"]  # graded by length: groups of unequal scores


def _losses(out):
    return [(r["loss"], r["grad_norm"]) for r in read_jsonl(out / "metrics.jsonl")]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """Two sampling runs that log their groups: the default rollout seed and another one."""
    root = tmp_path_factory.mktemp("replay")
    runs = {}
    for name, extra in (("a", []), ("other_seed", ["rollout.seed=99"])):
        out = root / name
        run_recipe(ONLINE, COMMON + [f"output_dir={out}", "rollout.log_samples=true", *extra])
        runs[name] = out
    return runs


def test_replay_trains_on_the_logged_groups_exactly(logged, tmp_path):
    replayed = tmp_path / "replayed"
    run_recipe(ONLINE, COMMON + [f"output_dir={replayed}", f"rollout.replay={logged['a'] / 'rollouts'}"])
    assert _losses(replayed) == _losses(logged["a"])  # plain GRPO: the behaviour log-probs recomputed, bit for bit
    rows = read_jsonl(replayed / "metrics.jsonl")
    assert [r["rollout"] for r in rows] == [True] + [False] * (STEPS - 1)
    # the control: a log sampled under another seed (same prompts, other completions) gives that run's losses
    other = tmp_path / "other"
    run_recipe(ONLINE, COMMON + [f"output_dir={other}", f"rollout.replay={logged['other_seed'] / 'rollouts'}"])
    assert _losses(other) == _losses(logged["other_seed"])
    assert _losses(other) != _losses(logged["a"]), "the two logs train differently, so the comparison is not vacuous"


def test_summary_reports_cpu_seconds_of_updates_and_rollouts(logged):
    summary = json.loads((logged["a"] / "summary.json").read_text())
    assert 0.0 < summary["rollout_cpu_s"] <= summary["step_cpu_s"]


@pytest.mark.parametrize("extra, message", [
    (["train.seed=7"], "is not this run's prompt at data position"),  # another data order
    (["rollout.every=1"], "was sampled at update 0, but this run samples it at update 1"),
    ([f"train.max_steps={STEPS + 1}", f"rollout.every={STEPS + 1}"], "has no group for update 3"),
])
def test_a_log_of_another_run_is_refused(logged, tmp_path, extra, message):
    proc = run_recipe(ONLINE, COMMON + [f"output_dir={tmp_path}", f"rollout.replay={logged['a'] / 'rollouts'}",
                                        *extra], expect=2)
    assert message in proc.stderr and "Fix: point `rollout.replay`" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_replay_without_rollouts_or_log_is_refused(tmp_path):
    proc = run_recipe(ONLINE, COMMON + [f"output_dir={tmp_path / 'a'}", "rollout.every=null",
                                        f"rollout.replay={tmp_path}"], expect=2)
    assert "`rollout.every` is null" in proc.stderr and "Traceback" not in proc.stderr
    proc = run_recipe(ONLINE, COMMON + [f"output_dir={tmp_path / 'b'}", f"rollout.replay={tmp_path / 'nothing'}"],
                      expect=2)
    assert "holds no samples log" in proc.stderr and "Traceback" not in proc.stderr


ROW = {"rollout_step": 0, "train_step": 0, "position": 3, "prompt": [{"role": "user", "content": "1+1"}],
       "reference": "2", "completion_ids": [[5, 6], [7]], "completions": ["2", "3"], "scores": [1.0, 0.0]}


def _write(tmp_path, rows):
    folder = tmp_path / "rollouts"
    folder.mkdir(exist_ok=True)
    (folder / "rank00000.jsonl").write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n"
                                                    for r in rows))
    return folder


def test_groups_come_back_as_logged(tmp_path):
    replay = SampleReplay(str(_write(tmp_path, [ROW])), 2)
    prompt = {"messages": ROW["prompt"], "reference": "2"}
    assert replay.groups(0, 0, [3], [prompt]) == ([[[5, 6], [7]]], ["2", "3"], [1.0, 0.0])
    with pytest.raises(DataError, match="is not this run's prompt"):
        replay.groups(0, 0, [3], [{"messages": ROW["prompt"], "reference": "3"}])


@pytest.mark.parametrize("row, message", [
    ("{not json", "not a JSON object"),
    ({**ROW, "scores": [1.0]}, "must each be a list of 2 entries"),
    ({k: v for k, v in ROW.items() if k != "position"}, "lacks `position`"),
    ({**ROW, "completion_ids": [[5, "x"], [7]]}, "must be lists of token ids"),
    ({**ROW, "scores": [1.0, "high"]}, "`scores` numbers"),
    ({**ROW, "train_step": -1}, "non-negative integers"),
])
def test_a_broken_row_names_its_line(tmp_path, row, message):
    folder = _write(tmp_path, [ROW | {"position": 9}, row])
    with pytest.raises(DataError, match=message) as info:
        SampleReplay(str(folder), 2)
    assert f"{folder / 'rank00000.jsonl'}:2" in str(info.value) and "Fix:" in str(info.value)


def test_two_logs_of_one_group_are_refused(tmp_path):
    with pytest.raises(DataError, match="a second group for update 0, data position 3"):
        SampleReplay(str(_write(tmp_path, [ROW, ROW])), 2)
