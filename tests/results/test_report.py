"""HTML report (crl_bench/results/report.py) over synthetic run folders: plots, page content, escaping, Chromium."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import yaml

from crl_bench.config import RunConfig
from crl_bench.experience.bank import ExperienceBank
from crl_bench.experience.embedding import HashEmbedder
from crl_bench.experience.types import Operation as Op
from crl_bench.results import report as rep
from crl_bench.results.run_folder import RENAMED_METRIC_KEYS, current_metric_keys, read_metrics

REPO = Path(__file__).resolve().parents[2]
ENVS = ("sokoban", "webshop")
STEPS = 6
EVIL_TITLE = "<script>x</script>"


def _eval(rate: float, envs=ENVS) -> dict:
    return {"success_rate": rate, "steps_mean": 7.5, "invalid_action_rate": 0.1, "episodes": 8 * len(envs),
            "per_env": {e: {"success_rate": min(1.0, rate + 0.1 * i), "episodes": 8} for i, e in enumerate(envs)}}


def write_run(root: Path, method: str, seed: int, mix: str = ",".join(ENVS), steps: int = STEPS,
              bank: bool | None = None, old_eval: bool = False) -> Path:
    """A run folder as ``crl-bench run`` writes it (config, metrics with one eval row, eval.json, bank)."""
    run_id = f"2024-{method}-s{seed}"
    d = root / run_id
    d.mkdir(parents=True)
    envs = [e.split(":")[0] for e in mix.split(",")]
    experience = method in ("static", "complementary")
    (d / "config.yaml").write_text(yaml.safe_dump({
        "method": method, "run_id": run_id, "rollout": {"mix": mix}, "train": {"seed": seed, "steps": steps},
        "model": {"name": "tiny"}}))
    rng = np.random.default_rng(seed + 17 * len(method))
    rows, kinds = [], {"ADD": 0, "UPDATE": 0, "MERGE": 0, "NONE": 0}
    for step in range(1, steps + 1):
        base = min(1.0, 0.1 * step + rng.uniform(0, 0.1))
        row = {"step": step, "success_rate": base, "invalid_action_rate": max(0.0, 0.5 - 0.07 * step),
               "reply_entropy": 1.2 - 0.1 * step + 0.05 * seed,
               "lesson_follow": 0.1 + 0.03 * step, "lesson_follow_wrong": 0.1 + 0.02 * step,
               "lesson_follow_none": 0.12,
               "steps_mean": 9.0 - step * 0.5, "reward_mean": base}
        if len(envs) > 1:
            row.update({f"success_rate/{e}": min(1.0, base + 0.05 * i) for i, e in enumerate(envs)})
        if experience:
            kinds["ADD"] += 2
            kinds["NONE"] += 1
            kinds["UPDATE"] += step % 2
            kinds["MERGE"] += int(step == 4)
            row.update({"success_rate/guided": min(1.0, base + 0.1), "success_rate/free": base,
                        "bank_size": kinds["ADD"] - kinds["MERGE"], "ops_applied": sum(kinds.values()),
                        "ops_rejected": step // 3, "op_kinds": dict(kinds), "merges": int(step >= 4)})
            if step % 2 == 0:
                row.update({"extractor_reward_mean": 0.2 * step - 0.5, "extractor_loss": 0.01,
                            "extractor_update": step // 2})
        rows.append(row)
        if step == steps // 2:
            rows.append({"step": step, "eval": _eval(0.3, envs)})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    ev = {"step": steps, "protocol": {"split": "test", "episodes": 8}, "free": _eval(0.4, envs)}
    if experience:
        ev["guided"] = _eval(0.6, envs)
    (d / "eval.json").write_text(json.dumps(ev["free"] | {"step": steps} if old_eval else ev))
    if bank if bank is not None else experience:
        b = ExperienceBank(d / "experience.sqlite", HashEmbedder(64))
        try:
            ids = []
            for title, content in ((EVIL_TITLE, "a & b <b>bold</b>"), (f"push boxes s{seed}", "never corner a box"),
                                   ("search first", "use the search box before clicking")):
                res = b.apply([Op("ADD", title, content)], env_id=envs[0], step=1, extraction_id="x1",
                              extractor_version=0)
                assert not res.rejected, res.rejected
                ids.append(res.applied[0][1])
            b.record_retrieval([ids[1], ids[1], ids[1], ids[0]], when=1.0)
            b.record_outcome([ids[1]], True)
        finally:
            b.close()
    return d


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    """A sweep folder: grpo and complementary, two seeds each."""
    root = tmp_path_factory.mktemp("sweep")
    (root / "sweep.yaml").write_text("name: test\n")
    for method in ("grpo", "complementary"):
        for seed in (0, 1):
            write_run(root / "runs", method, seed)
    return root


@pytest.fixture(scope="module")
def built(sweep, tmp_path_factory) -> Path:
    import pandas as pd

    out = tmp_path_factory.mktemp("report")
    table = pd.DataFrame({"method": ["complementary", "grpo"], "success": [0.6, 0.4],
                          "note": ["<i>best</i>", "baseline"]})
    return rep.make_report([sweep], out, table=table, title="Sweep <test>")


def _check_image(path: Path) -> np.ndarray:
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG", path
        rgb = np.asarray(im.convert("RGB"), dtype=np.float32)
    assert rgb.std() > 1.0, f"{path.name} is blank (one colour)"
    assert (rgb < 250).any(axis=2).mean() > 0.005, f"{path.name} is (almost) all white"
    return rgb


def _saturated_fraction(rgb: np.ndarray) -> float:
    """Share of pixels with clear colour (not grey/white/black): plot lines, not text or table lines."""
    return float(((rgb.max(axis=2) - rgb.min(axis=2)) > 60).mean())


# ----------------------------------------------------------------------------------------- find/load
def test_find_runs_sweep_run_folder_and_errors(sweep, tmp_path):
    runs = rep.find_runs(sweep)
    assert [p.name for p in runs] == sorted(p.name for p in (sweep / "runs").iterdir())
    assert len(runs) == 4
    one = runs[0]
    assert rep.find_runs([one, sweep]) == [one] + [p for p in runs if p != one]   # each run once
    assert rep.find_runs(str(one)) == [one]
    assert rep.find_runs(tmp_path) == []
    with pytest.raises(FileNotFoundError, match="does not exist"):
        rep.find_runs(tmp_path / "nope")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(NotADirectoryError):
        rep.find_runs(tmp_path / "f.txt")


def test_load_run_reads_config_metrics_and_evals(sweep):
    r = rep.load_run(sweep / "runs" / "2024-complementary-s1")
    assert (r.method, r.seed, r.run_id, r.mix, r.model, r.steps_configured) == (
        "complementary", 1, "2024-complementary-s1", "sokoban,webshop", "tiny", STEPS)
    assert r.envs == list(ENVS)
    assert [row["step"] for row in r.train] == list(range(1, STEPS + 1))       # eval row kept apart
    assert all("eval" not in row for row in r.train)
    assert [e["step"] for e in r.evals] == [STEPS // 2]
    assert r.evals[0]["free"]["success_rate"] == 0.3 and r.evals[0]["guided"] is None
    assert r.final_eval["guided"]["success_rate"] == 0.6 and r.final_eval["free"]["success_rate"] == 0.4
    assert r.bank_path is not None and r.last_step == STEPS
    g = rep.load_run(sweep / "runs" / "2024-grpo-s0")
    assert g.bank_path is None and g.final_eval["guided"] is None


def test_single_env_run_uses_overall_success_and_old_eval_format(tmp_path):
    d = write_run(tmp_path, "grpo", 3, mix="sokoban", old_eval=True)
    r = rep.load_run(d)
    assert r.envs == ["sokoban"]
    series = rep._series(r, rep._env_getter(r, "sokoban"))
    assert series == {row["step"]: row["success_rate"] for row in r.train}
    assert r.final_eval["free"]["success_rate"] == 0.4 and r.final_eval["guided"] is None
    assert rep._eval_success(r.final_eval["free"], r, "sokoban") == 0.4


@pytest.mark.parametrize("guided", [True, False], ids=["guided", "free"])
def test_old_flat_eval_is_read_as_the_summary_reads_it(tmp_path, guided):
    """An old flat eval.json carries a ``guided`` flag: the report puts it in the block the summary
    (and so the leaderboard) puts it in, instead of refusing the flag as a block or calling a guided
    evaluation free."""
    from test_summary import make_run

    from crl_bench.results.summary import build_summary

    rates = {"sokoban": 0.5, "minihack-room": 0.25}
    d = make_run(tmp_path, "old", method="static", old_format=True, **({"guided": rates} if guided else {}))
    final = rep.load_run(d).final_eval
    summary = build_summary(d)["runs"][0]["eval"]
    for mode in ("free", "guided"):
        got, want = final[mode], summary[mode]
        assert (got is None) == (want is None), mode
        if want is not None:
            assert got["success_rate"] == pytest.approx(want["success_rate"]) == pytest.approx(0.375)
    assert (final["guided"] is not None) is guided


def test_metrics_keys_renamed_since_a_run_are_read_under_their_current_names(tmp_path):
    """Runs that log the earlier key names ``distill_pending`` and ``extractor_generation``
    (``results/sweeps/cpu`` among them): every reader sees ``distill_backlog`` and ``extractor_version``."""
    d = write_run(tmp_path, "complementary", 0)
    lines = (d / "metrics.jsonl").read_text().splitlines()
    old = json.loads(lines[1]) | {"distill_pending": 3, "extractor_generation": 2}
    lines[1] = json.dumps(old)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    r = rep.load_run(d)
    row = r.train[1]
    assert row["distill_backlog"] == 3 and row["extractor_version"] == 2
    assert "distill_pending" not in row and "extractor_generation" not in row
    assert list(row) == [RENAMED_METRIC_KEYS.get(k, k) for k in old]                  # same places
    assert read_metrics(d)[1] == row
    assert current_metric_keys({"distill_pending": 1, "distill_backlog": 5}) == {"distill_backlog": 5}
    committed = REPO / "results" / "sweeps" / "cpu" / "runs" / "static-s0"
    if committed.is_dir():
        train = rep.load_run(committed).train
        assert train and all("distill_backlog" in t and "distill_pending" not in t for t in train)


@pytest.mark.parametrize("content, match", [
    ('{"step": 1, "success_rate": 0.5}\nnot json\n', r"metrics\.jsonl:2: not valid JSON"),
    ('{"success_rate": 0.5}\n', "non-integer 'step'"),
    ('[1, 2]\n', "expected a JSON object"),
])
def test_bad_metrics_give_clear_errors(tmp_path, content, match):
    d = write_run(tmp_path, "grpo", 0)
    (d / "metrics.jsonl").write_text(content)
    with pytest.raises(ValueError, match=match):
        rep.load_run(d)
    with pytest.raises(ValueError, match=match):
        rep.make_report(d, tmp_path / "out")


def test_bad_config_and_missing_files(tmp_path):
    d = write_run(tmp_path, "grpo", 0)
    (d / "config.yaml").write_text("train: {seed: 0}\n")
    with pytest.raises(ValueError, match="no 'method'"):
        rep.load_run(d)
    (d / "metrics.jsonl").unlink()
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        rep.load_run(d)
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):        # a run folder, damaged: named
        rep.make_report(tmp_path, tmp_path / "out")
    (d / "config.yaml").unlink()
    with pytest.raises(ValueError, match="no run folder"):
        rep.make_report(tmp_path, tmp_path / "out")
    d2 = write_run(tmp_path / "b", "grpo", 1)
    with pytest.raises(TypeError, match="DataFrame"):
        rep.make_report(d2, tmp_path / "out", table=[{"a": 1}])


def test_aggregate_mean_and_min_max_band():
    agg = rep._aggregate([{1: 0.0, 2: 1.0}, {1: 0.5, 3: 2.0}])
    assert agg.steps.tolist() == [1, 2, 3]
    np.testing.assert_allclose(agg.mean, [0.25, 1.0, 2.0])
    np.testing.assert_allclose(agg.lo, [0.0, 1.0, 2.0])
    np.testing.assert_allclose(agg.hi, [0.5, 1.0, 2.0])
    assert agg.n.tolist() == [2, 1, 1]
    assert rep._aggregate([{}, {}]) is None


def test_read_bank_top_entries_sorted_by_use(sweep):
    entries, stats = rep.read_bank(sweep / "runs" / "2024-complementary-s0" / "experience.sqlite")
    assert [e.title for e in entries] == ["push boxes s0", EVIL_TITLE, "search first"]
    assert (entries[0].times_retrieved, entries[0].times_success) == (3, 1)
    assert stats["count"] == 3 and stats["applied"]["ADD"] == 3
    assert len(rep.read_bank(sweep / "runs" / "2024-complementary-s0" / "experience.sqlite", limit=1)[0]) == 1
    with pytest.raises(FileNotFoundError):
        rep.read_bank(sweep / "nope.sqlite")


# ----------------------------------------------------------------------------------------- the report
def test_every_plot_is_a_non_blank_png(built):
    assert built.name == "report.html" and built.is_file()
    for name in rep.PLOT_FILES.values():
        path = built.parent / name
        assert path.is_file(), name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        rgb = _check_image(path)
        assert _saturated_fraction(rgb) > 0.001, f"{name} has no coloured curve"


def test_html_is_self_contained_and_complete(built, sweep):
    page = built.read_text(encoding="utf-8")
    uris = re.findall(r"src='data:image/png;base64,([A-Za-z0-9+/=]+)'", page)
    assert len(uris) == len(rep.PLOT_FILES)
    embedded = {base64.b64decode(u) for u in uris}
    for name in rep.PLOT_FILES.values():
        assert (built.parent / name).read_bytes() in embedded, f"{name} is not embedded"
    # nothing loaded from elsewhere, no scripts
    assert "<script" not in page.lower()
    assert not re.search(r"""(src|href)=['"](?!data:)""", page)
    assert "http://" not in page and "https://" not in page
    for run in rep.find_runs(sweep):
        assert run.name in page
    assert "push boxes s0" in page and "push boxes s1" in page
    assert "never corner a box" in page
    assert "&lt;script&gt;x&lt;/script&gt;" in page
    assert "a &amp; b &lt;b&gt;bold&lt;/b&gt;" in page
    assert "Sweep &lt;test&gt;" in page
    # leaderboard, escaped
    assert "Leaderboard" in page and "&lt;i&gt;best&lt;/i&gt;" in page and "<i>best</i>" not in page
    assert "min" in page and "max over seeds" in page                     # the band is named


def test_bank_entries_listed_most_used_first(built):
    page = built.read_text(encoding="utf-8")
    section = page[page.index("2024-complementary-s0 <span"):]
    assert section.index("push boxes s0") < section.index("&lt;script&gt;") < section.index("search first")


def test_grpo_only_runs_skip_experience_plots_with_a_note(tmp_path):
    root = tmp_path / "runs"
    for seed in (0, 1):
        write_run(root, "grpo", seed)
    html_path = rep.make_report(root, tmp_path / "out")
    page = html_path.read_text(encoding="utf-8")
    for key in ("guided_free", "extractor", "bank"):
        assert not (tmp_path / "out" / rep.PLOT_FILES[key]).exists()
        assert f"{rep.PLOT_FILES[key]} not drawn" in page
    for key in ("success", "invalid", "entropy", "lesson_follow"):
        _check_image(tmp_path / "out" / rep.PLOT_FILES[key])
    assert page.count("data:image/png;base64,") == 4
    assert "No run has an experience bank" in page
    assert "Leaderboard" not in page


def test_a_formula_in_a_name_is_text_and_one_failing_figure_leaves_the_others(tmp_path, monkeypatch):
    """A `$...$` in a method name is drawn as itself (matplotlib's mathtext would fail on it and, with
    it, the whole report); a figure that raises is named in the page and the others are drawn."""
    root = tmp_path / "runs"
    write_run(root, "grpo$\\badcmd$", 0)
    page = rep.make_report(root, tmp_path / "out").read_text(encoding="utf-8")
    for key in ("success", "invalid", "entropy", "lesson_follow"):
        _check_image(tmp_path / "out" / rep.PLOT_FILES[key])

    def boom(runs, path):
        path.write_bytes(b"half")
        raise RuntimeError("boom")

    monkeypatch.setattr(rep, "_plot_success", boom)
    page = rep.make_report(root, tmp_path / "out2").read_text(encoding="utf-8")
    assert f"{rep.PLOT_FILES['success']} not drawn: drawing failed (RuntimeError: boom)" in page
    assert not (tmp_path / "out2" / rep.PLOT_FILES["success"]).exists()
    for key in ("invalid", "entropy", "lesson_follow"):
        _check_image(tmp_path / "out2" / rep.PLOT_FILES[key])


def test_report_values_follow_the_metrics(tmp_path):
    """The plotted mean must come from the runs: a change in one run's metrics changes the PNG."""
    a = write_run(tmp_path / "a", "grpo", 0)
    first = rep.make_report(a, tmp_path / "o1").parent / rep.PLOT_FILES["invalid"]
    rows = [json.loads(x) for x in (a / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        if "eval" not in r:
            r["invalid_action_rate"] = 0.9
    (a / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    second = rep.make_report(a, tmp_path / "o2").parent / rep.PLOT_FILES["invalid"]
    assert first.read_bytes() != second.read_bytes()


def test_runs_of_one_method_with_other_settings_are_separate_curves(tmp_path):
    """As the leaderboard never pools runs of one method with different training settings, the
    report draws them as separate curves, named by the settings that differ (a key a config lacks reads
    as its default); seeds still pool."""
    runs = [write_run(tmp_path / "a", "complementary", s) for s in (0, 1)]
    runs += [write_run(tmp_path / "b", "complementary", s) for s in (0, 1)]
    for d in runs[2:]:
        cfg = yaml.safe_load((d / "config.yaml").read_text())
        cfg["experience"] = {"rerank": "utility"}
        (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    loaded = [rep.load_run(d) for d in runs]
    rep.label_groups(loaded)
    default = f"complementary · experience.rerank={RunConfig().experience.rerank}"
    assert [r.group for r in loaded] == [default] * 2 + ["complementary · experience.rerank=utility"] * 2
    assert {k: len(v) for k, v in rep._group(loaded).items()} == {
        default: 2, "complementary · experience.rerank=utility": 2}
    alone = [rep.load_run(d) for d in runs[:2]]
    rep.label_groups(alone)
    assert [r.group for r in alone] == ["complementary", "complementary"]
    html_text = rep.make_report([tmp_path], tmp_path / "out").read_text()
    assert "experience.rerank=utility" in html_text


# ----------------------------------------------------------------------------------------- Chromium
CHROMIUM_TIMEOUT_S = 120


@pytest.mark.slow
def test_report_renders_in_headless_chromium(built, tmp_path):
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("chromium is not installed: install Debian's chromium (apt-get install chromium) "
                    "to check that the report renders")
    shot = tmp_path / "shot.png"
    cmd = [exe, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
           f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,2000",
           built.resolve().as_uri()]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=CHROMIUM_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"chromium did not finish within {CHROMIUM_TIMEOUT_S} s: {' '.join(cmd)}")
    assert shot.is_file(), f"no screenshot (rc {res.returncode}): {res.stderr[-2000:]}"
    rgb = _check_image(shot)
    assert rgb.shape[:2] == (2000, 1200)
    assert len(np.unique(rgb.reshape(-1, 3), axis=0)) > 50, "screenshot has too few colours"
    assert _saturated_fraction(rgb) > 0.001, "no plot (coloured pixels) visible in the screenshot"


def test_bank_plot_leaves_out_operation_kinds_never_applied(tmp_path, monkeypatch):
    # the runs apply ADD, UPDATE, MERGE and NONE; UPVOTE and DOWNVOTE stay 0 at every step
    runs = [rep.load_run(write_run(tmp_path, "complementary", seed)) for seed in (0, 1)]
    drawn: list[str] = []
    real_draw = rep._draw

    def draw(ax, agg, colour, label, **kw):
        drawn.append(label)
        real_draw(ax, agg, colour, label, **kw)

    monkeypatch.setattr(rep, "_draw", draw)
    assert rep._plot_bank(runs, tmp_path / "bank.png") is None
    assert drawn == ["complementary (n=2)", "ADD", "UPDATE", "MERGE", "NONE"]
    _check_image(tmp_path / "bank.png")
