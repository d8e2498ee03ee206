"""Learning alarms (crl_bench/results/alarms.py): each alarm on synthetic metrics rows, their state across a
resume, the alerts in summary.json and report.html, and one trainer step that raises one."""

from __future__ import annotations

import copy
import json

import pytest

from crl_bench.config import AlarmConfig
from crl_bench.results.alarms import ALARMS, LearningAlarms, alert_line, run_alerts
from crl_bench.results.summary import build_summary, summary_problems, write_summary


def _row(step: int, **kw) -> dict:
    """A training row on which no alarm's condition holds; ``kw`` overrides."""
    return {"step": step, "groups_with_signal": 2, "adv_abs_mean": 0.3, "reply_entropy": 2.0, **kw}


def _feed(alarms: LearningAlarms, rows: list[dict]) -> dict[int, list[str]]:
    """The names of the alerts raised at each step (steps without one left out)."""
    out = {}
    for r in rows:
        alerts = alarms.update(r)
        if alerts:
            out[r["step"]] = [a["alarm"] for a in alerts]
    return out


# ---- no_signal -------------------------------------------------------------------------------------
def test_no_signal_fires_after_the_streak_once_and_again_after_clearing():
    quiet = {"groups_with_signal": 0, "adv_abs_mean": 0.0}
    rows = [_row(1), _row(2, **quiet), _row(3, **quiet), _row(4, **quiet), _row(5),
            _row(6, **quiet), _row(7, **quiet)]
    alarms = LearningAlarms(AlarmConfig())
    fired = _feed(alarms, rows)
    assert fired == {3: ["no_signal"], 7: ["no_signal"]}
    # longer threshold from the config: three steps running
    assert _feed(LearningAlarms(AlarmConfig(no_signal_steps=3)), rows) == {4: ["no_signal"]}


def test_no_signal_counts_zero_advantages_with_signal_only_across_subgroups():
    # experience methods centre within subgroups: a group may differ between its subgroups and still
    # give every episode advantage 0
    rows = [_row(1, adv_abs_mean=0.0, groups_with_signal=1), _row(2, adv_abs_mean=0.0, groups_with_signal=1)]
    alarms = LearningAlarms(AlarmConfig())
    alerts = [a for r in rows for a in alarms.update(r)]
    assert [(a["alarm"], a["step"]) for a in alerts] == [("no_signal", 2)]
    a = alerts[0]
    assert a["steps"] == 2 and a["first_step"] == 1 and a["groups_with_signal"] == 1 and a["adv_abs_mean"] == 0
    assert "no learning signal" in a["message"]


def test_no_signal_rows_without_the_quantities_keep_the_streak():
    quiet = {"groups_with_signal": 0, "adv_abs_mean": 0.0}
    alarms = LearningAlarms(AlarmConfig())
    assert alarms.update(_row(1, **quiet)) == []
    assert alarms.update({"step": 2}) == []                 # no signal keys: the streak stays at 1
    assert [a["alarm"] for a in alarms.update(_row(3, **quiet))] == ["no_signal"]


# ---- entropy_collapse --------------------------------------------------------------------------------
def test_entropy_collapse_below_half_of_step_one():
    ents = {1: 2.0, 2: 1.2, 3: 1.0, 4: 0.99, 5: 0.5, 6: 1.5, 7: 0.9}
    alarms = LearningAlarms(AlarmConfig())
    out = {}
    for s, e in ents.items():
        alerts = alarms.update(_row(s, reply_entropy=e))
        if alerts:
            out[s] = alerts
    # 1.0 is exactly half (a fall of 50 %, not more); 0.99 fires; 0.5 still collapsed; 1.5 clears
    assert sorted(out) == [4, 7]
    a = out[4][0]
    assert a["alarm"] == "entropy_collapse" and a["reference"] == 2.0 and a["reference_step"] == 1
    assert a["reply_entropy"] == 0.99 and a["limit"] == pytest.approx(1.0)
    assert _feed(LearningAlarms(AlarmConfig(entropy_drop=0.25)),
                 [_row(s, reply_entropy=e) for s, e in ents.items()]) == {2: ["entropy_collapse"],
                                                                          7: ["entropy_collapse"]}


def test_entropy_reference_is_the_first_row_that_has_it():
    alarms = LearningAlarms(AlarmConfig())
    first = _row(1)
    del first["reply_entropy"]                              # an engine without entropies at step 1
    assert alarms.update(first) == []
    assert alarms.update(_row(2, reply_entropy=1.0)) == []
    assert alarms.update({"step": 3, "groups_with_signal": 1}) == []
    assert [a["reference_step"] for a in alarms.update(_row(4, reply_entropy=0.4))] == [2]


# ---- extractor_parse -----------------------------------------------------------------------------------
def test_extractor_parse_fires_when_the_rate_crosses_below_and_absent_steps_change_nothing():
    rates = {1: 0.6, 2: 0.4, 3: 0.3, 4: None, 5: 0.2, 6: 0.7, 7: 0.1}
    rows = [_row(s) if r is None else _row(s, extractions_parse_rate=r, extractions_step=10)
            for s, r in rates.items()]
    assert _feed(LearningAlarms(AlarmConfig()), rows) == {2: ["extractor_parse"], 7: ["extractor_parse"]}
    assert _feed(LearningAlarms(AlarmConfig(parse_rate=0.65)), rows) == {1: ["extractor_parse"],
                                                                         7: ["extractor_parse"]}
    alert = LearningAlarms(AlarmConfig()).update(rows[1])[0]
    assert alert["parse_rate"] == 0.4 and alert["replies"] == 10 and alert["threshold"] == 0.5


# ---- merge_stale --------------------------------------------------------------------------------------
def _merge(step: int, writes: int | None, ran: int = 1) -> dict:
    row = _row(step, merge_pass=ran, merge_skipped=1 - ran)
    if writes is not None and ran:
        row.update(merge_pass_writes=writes, merge_pass_calls=2)
    return row


def test_merge_stale_counts_passes_not_steps():
    rows = [_merge(5, 0), _row(6), _row(7), _merge(10, 0), _merge(11, None, ran=0), _row(12), _merge(15, 0),
            _merge(20, 0), _merge(25, 3), _merge(30, 0), _merge(35, 0), _merge(40, 0)]
    fired = _feed(LearningAlarms(AlarmConfig()), rows)
    # the third stale pass (step 15), the skipped pass of step 11 and the steps without one not counted;
    # a pass that wrote (step 25) clears it, three stale ones later it fires again
    assert fired == {15: ["merge_stale"], 40: ["merge_stale"]}
    assert _feed(LearningAlarms(AlarmConfig(merge_passes=1)), rows) == {5: ["merge_stale"], 30: ["merge_stale"]}
    alarms = LearningAlarms(AlarmConfig())
    alert = [a for r in rows[:7] for a in alarms.update(r)][0]
    assert alert["passes"] == 3 and alert["calls"] == 2 and alert["threshold"] == 3


# ---- guided_equals_free --------------------------------------------------------------------------------
def _gf(step: int, g: float, f: float, n: int = 32, **kw) -> dict:
    return _row(step, **{"success_rate/guided": g, "success_rate/free": f, "episodes/guided": n,
                         "episodes/free": n, "warmup": False, **kw})


def test_guided_equals_free_after_five_steps_within_noise():
    rows = [_gf(1, 0.25, 0.25, warmup=True), _gf(2, 0.6, 0.1)]
    rows += [_gf(s, 0.3, 0.25) for s in range(3, 7)]        # 4 steps within noise (se ~ 0.11)
    rows += [_row(7)]                                         # no subgroup metrics (absent): no change
    rows += [_gf(8, 0.0, 0.0)]                                # se 0, both 0: equal -> 5th step
    rows += [_gf(9, 0.25, 0.25), _gf(10, 0.9, 0.1), _gf(11, 0.2, 0.2)]
    alarms = LearningAlarms(AlarmConfig())
    fired = {}
    for r in rows:
        for a in alarms.update(r):
            fired[r["step"]] = a
    assert sorted(fired) == [8]
    a = fired[8]
    assert a["alarm"] == "guided_equals_free" and a["steps"] == 5 and a["first_step"] == 3
    assert a["n_guided"] == 32 and a["guided"] == 0.0 and a["se"] == 0.0
    # a narrower band (noise_z 0.4: 0.3 vs 0.25 is then a difference): no alarm; longer streaks: later or none
    assert _feed(LearningAlarms(AlarmConfig(noise_z=0.4)), rows) == {}
    assert _feed(LearningAlarms(AlarmConfig(guided_free_steps=6)), rows) == {9: ["guided_equals_free"]}
    assert _feed(LearningAlarms(AlarmConfig(guided_free_steps=7)), rows) == {}
    assert _feed(LearningAlarms(AlarmConfig(guided_free_steps=1)), rows) == {
        3: ["guided_equals_free"], 11: ["guided_equals_free"]}


def test_guided_equals_free_certain_difference_and_empty_subgroups():
    alarms = LearningAlarms(AlarmConfig(guided_free_steps=1))
    assert alarms.update(_gf(1, 1.0, 0.0)) == []             # se 0 but 1 vs 0: a difference
    assert alarms.update(_gf(2, 0.5, 0.5, n=0)) == []         # no episodes: absent
    assert [a["alarm"] for a in alarms.update(_gf(3, 1.0, 1.0))] == ["guided_equals_free"]


# ---- all alarms ---------------------------------------------------------------------------------------
def test_disabled_config_raises_nothing():
    rows = [_row(s, groups_with_signal=0, adv_abs_mean=0.0, reply_entropy=2.0 / s, extractions_parse_rate=0.0,
                 merge_pass=1, merge_pass_writes=0, **{"success_rate/guided": 0.5, "success_rate/free": 0.5,
                                                       "episodes/guided": 4, "episodes/free": 4})
            for s in range(1, 8)]
    on = _feed(LearningAlarms(AlarmConfig()), rows)
    assert {n for names in on.values() for n in names} == set(ALARMS)     # every alarm can fire on them
    assert _feed(LearningAlarms(AlarmConfig(enabled=False)), rows) == {}


def test_alerts_are_json_and_have_name_step_message():
    rows = [_row(s, groups_with_signal=0, adv_abs_mean=0.0) for s in (1, 2)]
    alarms = LearningAlarms(AlarmConfig())
    alert = [a for r in rows for a in alarms.update(r)][0]
    assert json.loads(json.dumps(alert)) == alert
    assert {"alarm", "step", "message"} <= set(alert) and alert["step"] == 2
    assert alert_line(alert).startswith("WARNING learning alarm no_signal at step 2: no learning signal")


def test_state_dict_round_trip_keeps_streaks_and_what_fired():
    quiet = {"groups_with_signal": 0, "adv_abs_mean": 0.0}
    head = [_gf(1, 0.2, 0.2, reply_entropy=2.0), _gf(2, 0.2, 0.2, extractions_parse_rate=0.1, **quiet)]
    tail = [_gf(3, 0.2, 0.2, reply_entropy=0.9, extractions_parse_rate=0.1, **quiet), _gf(4, 0.2, 0.2)]
    cfg = AlarmConfig(guided_free_steps=4)
    a = LearningAlarms(cfg)
    assert _feed(a, head) == {2: ["extractor_parse"]}
    state = json.loads(json.dumps(a.state_dict()))           # plain data (saved with torch.save)
    b = LearningAlarms(cfg)
    b.load_state_dict(state)
    resumed = _feed(b, tail)
    assert resumed == _feed(a, tail)
    # the no_signal streak, the entropy reference of step 1 and the guided = free streak span the
    # resume; the parse alarm fired before it and does not fire again
    assert resumed == {3: ["no_signal", "entropy_collapse"], 4: ["guided_equals_free"]}
    assert _feed(LearningAlarms(cfg), tail) == {3: ["extractor_parse"]}       # what a fresh start gives


def test_run_alerts_in_step_order_and_last_row_of_a_step_wins():
    alert = {"alarm": "no_signal", "step": 2, "message": "m"}
    rows = [{"step": 0, "eval": {"free": {}}}, {"step": 2, "alerts": [dict(alert, message="old")]},
            {"step": 1}, {"step": 3, "alerts": [dict(alert, step=3)]}, {"step": 2, "alerts": [alert]},
            {"step": 3}]
    assert run_alerts(rows) == [alert]


# ---- summary.json and report.html -------------------------------------------------------------------
EVIL = "<script>alert('x')</script> & more"


def _add_alerts(run_dir, alerts_at_step: dict[int, list[dict]]) -> None:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    for r in rows:
        if "eval" not in r and r["step"] in alerts_at_step:
            r["alerts"] = alerts_at_step[r["step"]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_summary_carries_the_alerts_and_validates(tmp_path):
    from test_summary import make_run

    alert = {"alarm": "entropy_collapse", "step": 2, "message": EVIL, "reply_entropy": 0.4, "reference": 1.6}
    d = make_run(tmp_path, "with-alerts")
    _add_alerts(d, {2: [alert]})
    path = write_summary(d)                                  # validates against the schema
    s = json.loads(path.read_text())
    assert s["runs"][0]["alerts"] == [alert]
    assert summary_problems(s) == []
    broken = copy.deepcopy(s)
    del broken["runs"][0]["alerts"][0]["message"]
    assert any("$.runs[0].alerts[0]" in p and "message" in p for p in summary_problems(broken))
    # a run without alerts (or written before alarms existed) has no key and stays valid
    plain = build_summary(make_run(tmp_path, "plain"))
    assert "alerts" not in plain["runs"][0] and summary_problems(plain) == []


def test_report_lists_alerts_escaped_and_no_alarms_otherwise(tmp_path):
    from test_report import write_run

    from crl_bench.results import report as rep

    root = tmp_path / "runs"
    noisy = write_run(root, "grpo", 0, bank=False)
    write_run(root, "grpo", 1, bank=False)
    _add_alerts(noisy, {3: [{"alarm": "no_signal", "step": 3, "message": EVIL}]})
    page = rep.make_report(root, tmp_path / "out").read_text(encoding="utf-8")
    section = page[page.index("<h2>Learning alarms</h2>"):page.index("<h2>Plots</h2>")]
    assert "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt; &amp; more" in section
    assert "<script>" not in page
    assert section.count("no alarms") == 1 and "no_signal" in section
    assert section.index("2024-grpo-s0") < section.index("no_signal") < section.index("2024-grpo-s1")


# ---- the trainer --------------------------------------------------------------------------------------
def test_trainer_step_row_gets_the_alert_once(tokenizer, tiny_model):
    import copy as _copy

    from test_complementary import ScriptedEngine
    from tests_helpers import CoinEnv, coin_config

    from crl_bench.env_api import register_env
    from crl_bench.experience.embedding import HashEmbedder
    from crl_bench.trainer.loop import Trainer

    register_env("test-coin", CoinEnv)
    tr = Trainer(coin_config("static", alarms={"parse_rate": 0.5}), model=tiny_model, tokenizer=tokenizer,
                 embedder=HashEmbedder(64), extractor_model=_copy.deepcopy(tiny_model))
    try:
        ex = tr.experience.extractor
        ex.engine = ScriptedEngine(tr.experience.engine, "no operation in this reply", ex.prompts.prefill)
        m1 = tr.train_step().metrics
        assert m1["episodes/guided"] == 4 and m1["episodes/free"] == 4
        assert m1["extractions_step"] >= 1 and m1["extractions_parse_rate"] == 0.0
        assert [a["alarm"] for a in m1["alerts"]] == ["extractor_parse"]
        assert tr.state_dict()["alarms"]["active"]["extractor_parse"] is True
        m2 = tr.train_step().metrics
        assert m2["extractions_parse_rate"] == 0.0 and "alerts" not in m2      # still failing: no repeat
    finally:
        tr.close()


@pytest.mark.parametrize("fails", [False, True])
def test_fold_merge_pass_reports_its_writes(tokenizer, tiny_model, fails):
    from test_released_mechanisms import _fold_reply, _seed, _trainer
    from tests_helpers import CoinEnv

    from crl_bench.env_api import register_env

    register_env("test-coin", CoinEnv)
    reply = (lambda text: "<ops>\n<op>ADD</op><title></title>") if fails else _fold_reply(1)
    tr = _trainer(tokenizer, tiny_model, reply=reply, experience={"merge": {"every": 1, "mode": "fold"}})
    try:
        _seed(tr.experience.bank, "test-coin", 7)
        m = tr.experience.before_rollout(1)
        # 7 entries in chunks of 5: two calls; folded, the env's entries are rewritten as one lesson
        assert m["merge_pass"] == 1 and m["merge_pass_calls"] == 2
        assert m["merge_pass_writes"] == (0 if fails else 1)
    finally:
        tr.close()
