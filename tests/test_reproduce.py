"""experiments/reproduce.py planning and experiments/plot_results.py report, without training: the report runs on a
metrics tree written here with the loops' own MetricWriter, in the layout and order the loops write it (eval at step
0, train records, evals every `EVAL_EVERY` steps after the train record of that step)."""

import json
import pathlib
import sys

import numpy as np
import pytest

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"
sys.path.insert(0, str(EXPERIMENTS))

import plot_results  # noqa: E402
import reproduce  # noqa: E402
from vcppo_jax.metrics import MetricWriter  # noqa: E402

SEEDS = (0, 1, 2)
STEPS, EVAL_EVERY, BUCKETS = 6, 3, 4
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_tree(out: pathlib.Path, rng: np.random.Generator) -> dict:
    """Writes random metrics for every method and the value-pretraining stage; returns the values written:
    {method: {seed: {'eval': {step: (pass, length)}, 'step1': {key: value}}}} and {'value_pretrain': ...}."""
    truth: dict = {}
    for method in plot_results.METHODS:
        for seed in SEEDS:
            evals, step1 = {}, {}
            with MetricWriter(out / f"seed{seed}" / method, tensorboard=False) as w:
                def evaluate(step):
                    evals[step] = (float(rng.uniform()), float(rng.uniform(10, 100)))
                    w.write(step, {"eval/pass@1": evals[step][0], "eval/response_length_mean": evals[step][1]})

                evaluate(0)
                for step in range(1, STEPS + 1):
                    m = {"rollout/response_length_mean": float(rng.uniform(10, 100))}
                    m.update({f"diag/adv_pos{i:02d}": float(rng.normal()) for i in range(BUCKETS)})
                    if method != "grpo":
                        m.update({f"diag/value_pos{i:02d}": float(rng.normal()) for i in range(BUCKETS)})
                    if step == 1:
                        step1 = m
                    w.write(step, m)
                    if step % EVAL_EVERY == 0:
                        evaluate(step)
            truth.setdefault(method, {})[seed] = {"eval": evals, "step1": step1}
    for seed in SEEDS:
        with MetricWriter(out / f"seed{seed}" / "value_pretrain", tensorboard=False) as w:
            for step in range(1, 5):
                w.write(step, {"value/loss": float(rng.uniform()), "value/explained_var": float(rng.uniform())})
    return truth


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("study")
    truth = write_tree(out, np.random.default_rng(0))
    (out / "study.json").write_text(json.dumps({"max_response_len": 16}))
    results = out / "results"
    paths = plot_results.make_report(out, results)
    return truth, results, paths


def test_report_writes_every_figure_and_table(report):
    _, results, paths = report
    names = {"fig1_length_accuracy.png", "fig4_lambda_actor_sweep.png", "fig2_value_advantage_by_position.png",
             "fig6_value_pretraining.png", "results.md", "results.json"}
    assert {p.name for p in paths} == names
    for name in names:
        assert (results / name).stat().st_size > 0
        if name.endswith(".png"):
            assert (results / name).read_bytes()[:8] == PNG_MAGIC


def test_table_is_final_eval_mean_and_sample_std_over_seeds(report):
    truth, results, _ = report
    table = json.loads((results / "results.json").read_text())
    md = (results / "results.md").read_text()
    assert set(table["ours"]) == set(plot_results.METHODS)
    for method, seeds in truth.items():
        row = table["ours"][method]
        for j, key in enumerate(("eval/pass@1", "eval/response_length_mean")):
            final = [seeds[s]["eval"][STEPS][j] for s in SEEDS]
            assert row[key]["steps"] == [STEPS] * len(SEEDS)
            np.testing.assert_allclose(row[key]["per_seed"], final, rtol=1e-12)
            np.testing.assert_allclose(row[key]["mean"], sum(final) / len(final), rtol=1e-12)
            mean = sum(final) / len(final)
            std = (sum((v - mean) ** 2 for v in final) / (len(final) - 1)) ** 0.5
            np.testing.assert_allclose(row[key]["std"], std, rtol=1e-12)
        start = [seeds[s]["eval"][0][0] for s in SEEDS]
        np.testing.assert_allclose(row["eval/pass@1_step0"]["mean"], sum(start) / len(start), rtol=1e-12)
        p = row["eval/pass@1"]
        assert f"{100 * p['mean']:.1f} ± {100 * p['std']:.1f}" in md
    for method, cells in plot_results.PAPER.items():
        for t, v in cells.items():
            assert f"{t} {v:.1f}" in md
    assert table["paper"]["vcppo"]["Table 1"] == 48.8 and table["paper"]["ppo"]["Table 2"] == 5.6
    assert "Qwen2.5-32B" in md and "synthetic" in md


def test_position_profile_uses_the_first_rl_step(report):
    truth, _, _ = report
    tree = plot_results.load_tree(report[1].parent)
    for method in plot_results.FIG2_METHODS:
        for prefix in ("diag/value_pos", "diag/adv_pos"):
            rows = np.array([[truth[method][s]["step1"][f"{prefix}{i:02d}"] for i in range(BUCKETS)]
                             for s in SEEDS])
            mean, std = plot_results.position_profile(tree[method], prefix)
            np.testing.assert_allclose(mean, rows.mean(0), rtol=1e-12)
            np.testing.assert_allclose(std, rows.std(0, ddof=1), rtol=1e-12)


def test_seed_band_keeps_train_points_and_aligns_steps(report):
    tree = plot_results.load_tree(report[1].parent)
    steps, mean, std = plot_results.seed_band(tree["vcppo"], "eval/pass@1")
    assert list(steps) == [0, 3, 6]
    want = [np.mean([report[0]["vcppo"][s]["eval"][t][0] for s in SEEDS]) for t in (0, 3, 6)]
    np.testing.assert_allclose(mean, want, rtol=1e-12)
    steps, _, _ = plot_results.seed_band(tree["vcppo"], "rollout/response_length_mean")
    # read_metrics keeps one record per step (the last written); at eval steps that is the eval record.
    assert set(steps) <= set(range(1, STEPS + 1)) and {1, 2, 4, 5} <= set(steps)


def test_empty_tree_still_writes_the_table(tmp_path):
    paths = plot_results.make_report(tmp_path / "missing", tmp_path / "results")
    assert [p.name for p in paths] == ["results.md", "results.json"]
    assert json.loads((tmp_path / "results" / "results.json").read_text())["ours"] == {}


def test_study_plan_shares_stages_and_sets_each_method(tmp_path):
    plan = reproduce.build_plan(tmp_path, [0, 1], list(reproduce.RECIPES), reproduce.PROFILES["full"])
    assert set(reproduce.RECIPES) == set(plot_results.METHODS)
    per_seed = [[r for r in plan if r.seed == s] for s in (0, 1)]
    for seed, runs in zip((0, 1), per_seed):
        names = [r.name for r in runs]
        assert names == ["sft", "value_pretrain", "reward_model", *reproduce.RECIPES]  # stages first, each once
        by = {r.name: r.config for r in runs}
        sft_dir = str(tmp_path.resolve() / f"seed{seed}" / "sft")
        assert {c.sft_dir for n, c in by.items() if n != "sft"} == {sft_dir} and by["sft"].workdir == sft_dir
        assert all(c.seed == seed for c in by.values())
        assert len({c.task.data_dir for c in by.values()}) == 1
        lam = {n: (by[n].lambda_actor, by[n].lambda_critic, by[n].critic_init) for n in reproduce.RECIPES}
        assert lam["ppo"] == (0.95, 0.95, "reward_model") and by["ppo"].critic_dir == by["reward_model"].workdir
        assert lam["vcppo"] == (0.95, 1.0, "value_pretrain") and by["vcppo"].critic_dir == by["value_pretrain"].workdir
        assert lam["vcppo_no_vpt"] == (0.95, 1.0, "actor")
        assert lam["vcppo_no_dgae"] == (0.95, 0.95, "value_pretrain")
        assert by["grpo"].algorithm == "grpo" and by["grpo"].critic_init == "none"
        assert [lam[f"vcppo_la{x}"][:2] for x in ("0.9", "0.99", "1.0")] == [(0.9, 1.0), (0.99, 1.0), (1.0, 1.0)]
    full = reproduce.build_plan(tmp_path, [0, 1, 2], list(reproduce.RECIPES), reproduce.PROFILES["full"])
    assert sum(reproduce.estimate_seconds(r) for r in full) < 2 * 3600
    quick = reproduce.PROFILES["quick"]
    qplan = reproduce.build_plan(tmp_path, [0], list(quick.methods), quick)
    assert sum(reproduce.estimate_seconds(r, quick.step_scale) for r in qplan) < 11 * 60
    assert {r.config.model.hidden_size for r in qplan} == {64}  # profile sizes reach the derived stages too


def test_plan_rejects_unknown_methods(tmp_path):
    with pytest.raises(ValueError, match="unknown"):
        reproduce.build_plan(tmp_path, [0], ["vcppo", "ppo2"], reproduce.PROFILES["full"])


def test_run_plan_skips_done_runs_and_dependents_of_failures_and_stops_when_preempted(tmp_path, monkeypatch):
    plan = reproduce.build_plan(tmp_path, [0], ["ppo", "vcppo", "grpo"], reproduce.PROFILES["full"])
    by = {r.name: r.workdir for r in plan}
    done, calls = {by["sft"]}, []

    def fake_run(config):  # value pretraining fails; every other run finishes
        calls.append(config.workdir)
        if config.stage == "value_pretrain":
            raise FloatingPointError("non-finite")
        done.add(config.workdir)

    monkeypatch.setattr(reproduce.stages, "stage_done", lambda workdir: workdir in done)
    monkeypatch.setattr(reproduce.stages, "run_stage", fake_run)
    bad, stopped = reproduce.run_plan(plan)
    assert calls == [by["value_pretrain"], by["reward_model"], by["ppo"], by["grpo"]]  # sft done, vcppo skipped
    assert [r.name for r in bad] == ["value_pretrain", "vcppo"] and not stopped

    calls.clear()
    monkeypatch.setattr(reproduce.stages, "run_stage", lambda config: calls.append(config.workdir))  # preempted
    bad, stopped = reproduce.run_plan(plan)
    assert calls == [by["value_pretrain"]] and stopped and bad == []
