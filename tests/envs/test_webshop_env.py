"""WebShop env: pages, actions, goals and reward through the env (data from the data dir)."""

from __future__ import annotations

import shutil

import pytest

from crl_bench.env_api import make_env
from crl_bench.envs.webshop.reward import SpacyTagger, TaggerMissingError, get_reward, verify_en_core_web_sm


@pytest.fixture(scope="module")
def env():
    e = make_env("webshop")
    yield e
    e.close()


def _say(env, action):
    return env.step(f"<answer>{action}</answer>")


def _open_target(env) -> None:
    """Search for the goal (instruction, else the product's title), page to the target, open it."""
    goal = env.goal
    for query in (env.task_prompt(), env.world.catalogue.by_asin[goal.asin].title):
        _say(env, f"search[{query}]")
        if goal.asin in env.s.results:
            break
        _say(env, "click[back to search]")
    assert goal.asin in env.s.results, goal.asin
    for _ in range(env.s.results.index(goal.asin) // 10):
        _say(env, "click[next >]")
    obs, r, term, trunc, info = _say(env, f"click[{goal.asin.lower()}]")
    assert not info["invalid_action"] and env.s.page == "item" and r == 0.0


def _exact_reward(env, goal) -> float:
    p = env.world.catalogue.by_asin[goal.asin]
    return get_reward(p, goal, env.world.catalogue.prices[p.asin], dict(goal.goal_options), env.world.tagger)


def test_splits_goal_order_and_weights(env):
    assert env.task_ids("eval") == list(range(500))
    train = env.task_ids("train")
    assert len(train) == 6910 - 500 and train[0] == 500
    assert env.world.goals[0].asin == "B0743JKHBV" and env.world.goals[6909].asin == "B09NPML43M"
    w = env.task_weights("train")
    assert len(w) == len(train) and w[0] == env.world.goals[500].weight
    again = make_env("webshop")
    assert [g.instruction_text for g in again.world.goals[:50]] == [g.instruction_text for g in env.world.goals[:50]]


def test_retrieval_query_is_the_goal(env):
    obs, _ = env.reset(options={"task": 3})
    assert env.retrieval_query(obs) == "Goal: " + env.task_prompt() and env.task_prompt()


def test_scripted_episode_buys_the_target_for_reward_1(env):
    done = 0
    for task in env.task_ids("eval"):
        goal = env.world.goals[task]
        if _exact_reward(env, goal) != 1.0:      # upstream: ~7% of goals cannot reach 1.0
            continue
        obs, info = env.reset(options={"task": task})
        assert "[button] Search [button_]" in obs and env.task_prompt() in obs
        _open_target(env)
        for _name, value in goal.goal_options.items():
            obs, *_ = _say(env, f"click[{value}]")
            assert f"[clicked button] {value} [clicked button_]" in obs
        obs, r, term, trunc, info = _say(env, "click[buy now]")
        assert term and not trunc and r == 1.0 and info["success"], (task, info.get("reward_info"))
        done += 1
        if done == 5:
            break
    assert done == 5


def test_a_wrong_option_loses_exactly_its_share(env):
    for task in env.task_ids("eval"):
        goal = env.world.goals[task]
        p = env.world.catalogue.by_asin[goal.asin]
        name = next((n for n, v in goal.goal_options.items() if len(set(p.options.get(n, []))) > 1), None)
        if name is None or _exact_reward(env, goal) != 1.0:
            continue
        wrong = next(v for v in p.options[name] if v != goal.goal_options[name]
                     and v not in goal.goal_options[name] and goal.goal_options[name] not in v)
        env.reset(options={"task": task})
        _open_target(env)
        for n, v in goal.goal_options.items():
            _say(env, f"click[{wrong if n == name else v}]")
        _, r, term, _, info = _say(env, "click[buy now]")
        d = len(goal.attributes) + len(goal.goal_options) + 1
        assert term and not info["success"]
        assert r == pytest.approx((d - 1) / d), (task, wrong, info["reward_info"])
        return
    pytest.fail("no eval goal with a choosable option")


def test_invalid_actions_are_fed_back_and_change_nothing(env):
    obs0, _ = env.reset(options={"task": 3})
    for bad in ("click[buy now]", "look around", "search[]"):
        obs, r, term, trunc, info = _say(env, bad)
        assert info["invalid_action"] and r == 0.0 and not term and env.s.page == "search"
        assert obs.startswith("Last: Invalid action")
    obs, r, term, trunc, info = env.step("search[shoes] without tags")
    assert info["invalid_action"]
    _say(env, "search[men's running shoes]")
    assert env.s.page == "results"
    obs, _, _, _, info = _say(env, "search[socks]")              # no search bar on the results page
    assert info["invalid_action"] and "no search bar" in obs and env.s.keywords == "men's running shoes"
    obs, _, _, _, info = _say(env, "click[no such button]")
    assert info["invalid_action"] and info["invalid_actions"] == 6 and info["steps"] == 7


def test_pages_paging_options_and_back(env):
    env.reset(options={"task": 7})
    obs, *_ = _say(env, "SEARCH[ Women's Dress ]")               # case and spacing tolerated
    assert env.s.keywords == "women's dress" and len(env.s.results) == 50
    assert "Page 1 (Total results: 50)" in obs and "< Prev" not in obs
    first_page = env.s.results[:10]
    assert all(f"[button] {a} [button_]" in obs for a in first_page)
    assert env.clickables()[:2] == ["back to search", "next >"]
    obs, *_ = _say(env, "click[next >]")
    assert "Page 2" in obs and "[button] < Prev [button_]" in obs and env.s.results[10] in obs
    _say(env, "click[< prev]")
    assert env.s.page_num == 1
    # open a product with options
    asin = next(a for a in first_page if env.world.catalogue.by_asin[a].options) \
        if any(env.world.catalogue.by_asin[a].options for a in first_page) else first_page[0]
    obs, *_ = _say(env, f"click[{asin.lower()}]")
    p = env.world.catalogue.by_asin[asin]
    assert env.s.page == "item" and p.title in obs and f"Price: {p.price_text}" in obs
    if p.options:
        name, values = next(iter(p.options.items()))
        _say(env, f"click[{values[0]}]")
        assert env.s.options == {name: values[0]}
        if len(values) > 1:                                       # a re-click replaces the value
            obs, *_ = _say(env, f"click[{values[1]}]")
            assert env.s.options == {name: values[1]} and obs.startswith(f"You have clicked {values[1]}.")
    obs, *_ = _say(env, "click[features]")
    assert env.s.page == "sub" and all(b.strip() in obs for b in p.bullet_points)
    _say(env, "click[< prev]")
    assert env.s.page == "item"
    _say(env, "click[< prev]")                                    # back to the results: options cleared
    assert env.s.page == "results" and env.s.options == {}
    obs, *_ = _say(env, "click[back to search]")
    assert env.s.page == "search" and env.admissible_actions() is None
    _say(env, "search[women's dress]")
    obs = env.render()
    assert f"[clicked button] {asin} [clicked button_]" in obs      # visited products are marked


def test_step_limit():
    e = make_env("webshop", max_steps=2)
    e.reset(options={"task": 0})
    _say(e, "search[pillow]")
    _, r, term, trunc, info = _say(e, "click[next >]")
    assert trunc and not term and r == 0.0 and not info["success"]


def test_the_reward_model_is_verified_and_never_silently_replaced(tmp_path):
    tagger = SpacyTagger()
    nouns = tagger.nouns("Bluetooth Headphones with Noise Cancelling, Black")
    assert "headphones" in nouns and "with" not in nouns          # a blank pipeline would tag nothing
    with pytest.raises(TaggerMissingError, match="none of"):
        SpacyTagger("no_such_model_xx").nouns("a pillow")
    copy = tmp_path / "model"
    shutil.copytree(tagger._nlp.path, copy)
    verify_en_core_web_sm(copy)
    (copy / "tagger" / "model").write_bytes(b"tampered")
    with pytest.raises(TaggerMissingError, match="tagger/model: sha256"):
        verify_en_core_web_sm(copy)


def test_bench_webshop_smoke():
    from crl_bench.bench.webshop import bench_webshop, format_result

    r = bench_webshop(episodes=5)
    assert r["steps"] >= 5 * 5 and r["steps_per_s"] > 0 and r["search_ms"] > 0
    assert "steps/s" in format_result(r)


def test_human_goals_work_with_the_default_split():
    e = make_env("webshop", human_goals=True)
    n = len(e.world.goals)
    train, ev = e.task_ids("train"), e.task_ids("eval")
    assert n == 13 and ev == [0, 1, 2, 3]                  # the first 30% held out
    assert train and ev and not set(train) & set(ev) and sorted(train + ev) == list(range(n))
    assert len(e.task_weights("train")) == len(train)
    for task in (train[0], ev[0]):
        obs, info = e.reset(options={"task": task})
        assert e.goal is e.world.goals[task] and e.task_prompt() in obs
        obs, r, term, trunc, info = _say(e, "search[pillow]")
        assert not info["invalid_action"] and e.s.page == "results" and r == 0.0
    e.reset()                                              # no task given: a train goal
    assert e.task in train
    e.close()


def test_explicit_test_goals_out_of_range_name_the_range():
    with pytest.raises(ValueError, match=r"'0-499' outside the 13 human goals 0\.\.12"):
        make_env("webshop", human_goals=True, test_goals="0-499")
    with pytest.raises(ValueError, match="leave some for training"):
        make_env("webshop", human_goals=True, test_goals=(0, 12))
    with pytest.raises(ValueError, match=r"outside the 6910 synthetic goals 0\.\.6909"):
        make_env("webshop", test_goals="6000-7000")
    e = make_env("webshop", human_goals=True, test_goals="10-12")
    assert e.task_ids("eval") == [10, 11, 12] and e.task_ids("train") == list(range(10))


def test_default_test_goals():
    from crl_bench.envs.webshop.env import default_test_goals

    assert default_test_goals(6910, human_goals=False) == range(500)
    assert default_test_goals(13, human_goals=True) == range(4)
    assert default_test_goals(12_000, human_goals=True) == range(500)
    with pytest.raises(ValueError, match="no training goals"):
        default_test_goals(1, human_goals=True)
    with pytest.raises(ValueError, match="no training goals"):
        default_test_goals(500, human_goals=False)


def test_data_files_are_the_json_files_read(env):
    import os

    names = {"webshop/items_shuffle_1000.json", "webshop/items_ins_v2_1000.json"}
    files = env.data_files()
    assert set(files) == names
    root = os.environ["CRL_BENCH_DATA"]
    assert all(p.is_absolute() and p.is_file() and p.samefile(os.path.join(root, n)) for n, p in files.items())
    human = make_env("webshop", human_goals=True).data_files()
    assert set(human) == names | {"webshop/items_human_ins.json"}
