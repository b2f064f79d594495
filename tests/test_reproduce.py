"""experiments/reproduce.py planning and experiments/plot_results.py report, without training: the report runs on a
metrics tree written here with the loops' own MetricWriter, in the layout and order the loops write it (eval at step
0, train records, evals every `EVAL_EVERY` steps after the train record of that step)."""

import json
import pathlib
import shutil

import config_files
import numpy as np
import plot_results
import pytest
import real_model_report
import reproduce

from vcppo_jax.metrics import MetricWriter

EXPERIMENTS = pathlib.Path(__file__).resolve().parents[1] / "experiments"

SEEDS = (0, 1, 2)
STEPS, EVAL_EVERY, BUCKETS = 12, 4, 4  # STEPS > plot_results.LAST_STEPS
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_tree(out: pathlib.Path, rng: np.random.Generator) -> dict:
    """Writes random metrics for every method and the value-pretraining stage; returns the values written:
    {method: {seed: {'eval': {step: (pass, length)}, 'step1': {key: value}}}} and {'value_pretrain': ...}."""
    truth: dict = {}
    for method in plot_results.METHODS:
        for seed in SEEDS:
            evals, step1, train = {}, {}, {}
            with MetricWriter(out / f"seed{seed}" / method, tensorboard=False) as w:
                def evaluate(step):
                    evals[step] = (float(rng.uniform()), float(rng.uniform(10, 100)))
                    w.write(step, {"eval/pass@1": evals[step][0], "eval/response_length_mean": evals[step][1]})

                evaluate(0)
                for step in range(1, STEPS + 1):
                    m = {"rollout/response_length_mean": float(rng.uniform(10, 100)),
                         "rollout/accuracy": float(rng.uniform()), "diag/adv_early_bias": float(rng.normal()),
                         "rollout/reward_mean": float(rng.uniform(-1, 1)), "policy/approx_kl": float(rng.uniform()),
                         "policy/clipfrac": float(rng.uniform())}
                    m.update({f"diag/adv_pos{i:02d}": float(rng.normal()) for i in range(BUCKETS)})
                    if method != "grpo":
                        m.update({f"diag/value_pos{i:02d}": float(rng.normal()) for i in range(BUCKETS)})
                        m["value/explained_var_old"] = float(rng.uniform(-1, 1))
                    if step == 1:
                        step1 = m
                    train[step] = m
                    w.write(step, m)
                    if step % EVAL_EVERY == 0:
                        evaluate(step)
            truth.setdefault(method, {})[seed] = {"eval": evals, "step1": step1, "train": train}
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
             "fig2b_critic_diagnostics.png", "fig6_value_pretraining.png", "results.md", "results.json"}
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
        # Sampled accuracy: mean over the last LAST_STEPS train steps of each seed, then over seeds.
        n = plot_results.LAST_STEPS
        for key in ("rollout/accuracy", "rollout/response_length_mean"):
            for part, steps in (("first", range(1, n + 1)), ("last", range(STEPS - n + 1, STEPS + 1))):
                want = [np.mean([seeds[s]["train"][t][key] for t in steps]) for s in SEEDS]
                np.testing.assert_allclose(row[f"{key}_{part}{n}"]["per_seed"], want, rtol=1e-12)
        want = [np.mean([seeds[s]["train"][t]["policy/approx_kl"] for t in range(1, STEPS + 1)]) for s in SEEDS]
        np.testing.assert_allclose(row["policy/approx_kl_mean"]["per_seed"], want, rtol=1e-12)
        if method in plot_results.CRITIC_METHODS:
            for key in plot_results.STEP1_KEYS:
                want = [seeds[s]["step1"][key] for s in SEEDS]
                np.testing.assert_allclose(row[f"step1/{key}"]["per_seed"], want, rtol=1e-12)
        else:
            assert not any(k.startswith("step1/") for k in row)
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


def test_position_profile_skips_empty_buckets():
    """Buckets no response reached are left out of the seed mean (NaN where no seed reached them), from the
    logged token counts, or, for runs that predate them, from the exact-0 mean advantage of an empty bucket."""
    def record(values, advs, tokens=None):
        r = {"step": 1, **{f"diag/value_pos{i:02d}": v for i, v in enumerate(values)},
             **{f"diag/adv_pos{i:02d}": a for i, a in enumerate(advs)}}
        if tokens is not None:
            r.update({f"diag/tokens_pos{i:02d}": t for i, t in enumerate(tokens)})
        return [{"step": 0, "eval/pass@1": 0.5}, r]

    runs = {0: record([1.0, 2.0, 0.0, 0.0], [0.1, 0.2, 0.0, 0.0], tokens=[5, 3, 0, 0]),
            1: record([3.0, 4.0, 6.0, 0.0], [0.3, 0.4, 0.5, 0.0], tokens=[5, 4, 1, 0]),
            2: record([5.0, 0.0, 8.0, 0.0], [0.5, 0.7, 0.6, 0.0])}  # no counts: bucket 3 is empty (adv == 0)
    mean, std = plot_results.position_profile(runs, "diag/value_pos")
    np.testing.assert_allclose(mean[:3], [3.0, 2.0, 7.0])
    np.testing.assert_allclose(std[:3], [2.0, 2.0, np.std([6.0, 8.0], ddof=1)])
    assert np.isnan(mean[3]) and std[3] == 0.0
    mean, _ = plot_results.position_profile(runs, "diag/adv_pos")
    np.testing.assert_allclose(mean[:3], [0.3, 0.7 / 3 + 0.4 / 3 + 0.2 / 3, 0.55])
    assert np.isnan(mean[3])


def test_seed_band_keeps_train_points_and_aligns_steps(report):
    tree = plot_results.load_tree(report[1].parent)
    steps, mean, std = plot_results.seed_band(tree["vcppo"], "eval/pass@1")
    assert list(steps) == [0, 4, 8, 12]
    want = [np.mean([report[0]["vcppo"][s]["eval"][t][0] for s in SEEDS]) for t in (0, 4, 8, 12)]
    np.testing.assert_allclose(mean, want, rtol=1e-12)
    steps, _, _ = plot_results.seed_band(tree["vcppo"], "rollout/response_length_mean")
    # read_metrics keeps one record per step (the last written); at eval steps that is the eval record.
    assert set(steps) <= set(range(1, STEPS + 1)) and {1, 2, 3, 5} <= set(steps)


def test_empty_tree_still_writes_the_table(tmp_path):
    paths = plot_results.make_report(tmp_path / "missing", tmp_path / "results")
    assert [p.name for p in paths] == ["results.md", "results.json"]
    assert json.loads((tmp_path / "results" / "results.json").read_text())["ours"] == {}


def test_study_plan_shares_stages_and_sets_each_method(tmp_path):
    methods = list(reproduce.PROFILES["full"].methods)
    plan = reproduce.build_plan(tmp_path, [0, 1], methods, reproduce.PROFILES["full"])
    assert set(methods) == set(plot_results.METHODS)
    assert set(reproduce.RECIPES) == (set(plot_results.METHODS) | set(plot_results.LEARNING_METHODS)
                                      | set(plot_results.MECHANISM_METHODS))
    per_seed = [[r for r in plan if r.seed == s] for s in (0, 1)]
    sft_dir = str(tmp_path.resolve() / "sft")
    # One SFT for the whole study, planned with the first seed; each seed has its own critic stages.
    assert [r.name for r in per_seed[0]] == ["sft", "reward_model", "value_pretrain", *methods]
    assert [r.name for r in per_seed[1]] == ["reward_model", "value_pretrain", *methods]
    assert [r.workdir for r in plan if r.name == "sft"] == [sft_dir]
    for seed, runs in zip((0, 1), per_seed):
        by = {r.name: r.config for r in runs}
        assert {c.sft_dir for n, c in by.items() if n != "sft"} == {sft_dir}
        assert all(c.seed == seed for c in by.values())
        assert {by["value_pretrain"].workdir, by["reward_model"].workdir} == {
            str(tmp_path.resolve() / f"seed{seed}" / s) for s in ("value_pretrain", "reward_model")}
        assert len({c.task.data_dir for c in by.values()}) == 1
        lam = {n: (by[n].lambda_actor, by[n].lambda_critic, by[n].critic_init) for n in methods}
        assert lam["ppo"] == (0.95, 0.95, "reward_model") and by["ppo"].critic_dir == by["reward_model"].workdir
        assert lam["vcppo"] == (0.95, 1.0, "value_pretrain") and by["vcppo"].critic_dir == by["value_pretrain"].workdir
        assert lam["vcppo_no_vpt"] == (0.95, 1.0, "actor")
        assert lam["vcppo_no_dgae"] == (0.95, 0.95, "value_pretrain")
        assert by["grpo"].algorithm == "grpo" and not reproduce.config_lib.has_critic(by["grpo"])
        assert by["grpo"].critic_dir == ""
        assert [lam[f"vcppo_la{x}"][:2] for x in ("0.9", "0.99", "1.0")] == [(0.9, 1.0), (0.99, 1.0), (1.0, 1.0)]
        assert {by[m].num_steps for m in methods} == {60}  # the full profile's RL length
        assert not any(c.shuffle_rewards for c in by.values() if c.stage == "rl")
    # Every run's dependencies are planned before it.
    position = {r.workdir: i for i, r in enumerate(plan)}
    assert all(position[w] < position[r.workdir] for r in plan for w in r.needs)
    full = reproduce.build_plan(tmp_path, [0, 1, 2], methods, reproduce.PROFILES["full"])
    assert sum(reproduce.estimate_seconds(r) for r in full) < 2.5 * 3600
    quick = reproduce.PROFILES["quick"]
    qplan = reproduce.build_plan(tmp_path, [0], list(quick.methods), quick)
    assert sum(reproduce.estimate_seconds(r, quick.step_scale) for r in qplan) < 12 * 60
    assert {r.config.model.hidden_size for r in qplan} == {64}  # profile sizes reach the derived stages too


def test_mechanism_plan_pessimistic_reward_model_feeds_value_pretraining_and_the_arms(tmp_path):
    profile = reproduce.PROFILES["mechanism"]
    assert set(profile.methods) <= set(plot_results.MECHANISM_METHODS)
    plan = reproduce.build_plan(tmp_path, [0, 1], list(profile.methods), profile)
    root = tmp_path.resolve()
    for seed in (0, 1):
        by = {r.name: r for r in plan if r.seed == seed}
        rm, vpt = by["reward_model"].config, by["value_pretrain"].config
        assert rm.truncated_fraction == 0.5 and vpt.truncated_fraction == 0.0
        # Value pretraining starts from this seed's reward model, which is planned (and run) before it.
        assert vpt.critic_init == "reward_model" and vpt.critic_dir == rm.workdir == str(root / f"seed{seed}" /
                                                                                          "reward_model")
        assert by["value_pretrain"].needs == (str(root / "sft"), rm.workdir)
        cfg = {m: by[m].config for m in profile.methods}
        assert cfg["ppo"].critic_dir == rm.workdir and cfg["vcppo_rm_critic"].critic_dir == rm.workdir
        assert (cfg["vcppo_rm_critic"].lambda_actor, cfg["vcppo_rm_critic"].lambda_critic) == (0.95, 1.0)
        for m, bias in plot_results.BIAS_MAP.items():  # the bias map: one calibrated critic, shifted
            if m not in cfg:
                continue
            assert cfg[m].critic_init_bias == bias and cfg[m].critic_dir == vpt.workdir
            assert (cfg[m].lambda_actor, cfg[m].lambda_critic) == (0.95, 0.95)
        assert {c.num_steps for c in cfg.values()} == {40} and {c.actor_optim.lr for c in cfg.values()} == {3e-5}
    assert [r.name for r in plan].count("sft") == 1
    position = {r.workdir: i for i, r in enumerate(plan)}
    assert all(position[w] < position[r.workdir] for r in plan for w in r.needs)
    full = reproduce.build_plan(tmp_path, [0, 1, 2], list(profile.methods), profile)
    assert sum(reproduce.estimate_seconds(r) for r in full) < 2.7 * 3600


def test_long_mechanism_profile_reaches_every_stage(tmp_path):
    profile = reproduce.PROFILES["mechanism_long"]
    assert set(profile.methods) <= set(plot_results.MECHANISM_METHODS)
    plan = reproduce.build_plan(tmp_path, [0], list(profile.methods), profile)
    assert [r.name for r in plan] == ["sft", "value_pretrain", *profile.methods]
    for r in plan:  # the long task (and room for its chains of thought) in every stage, not only in RL
        assert (r.config.task.knobs.min_terms, r.config.task.knobs.max_terms) == (5, 9)
        assert (r.config.task.max_prompt_len, r.config.task.max_response_len) == (32, 336)
    by = {r.name: r.config for r in plan}
    assert by["sft"].late_steps == 0 and by["value_pretrain"].critic_init == "actor"
    assert by["ppo_bias-2"].critic_init_bias == by["vcppo_bias-2"].critic_init_bias == -2.0
    assert {by[m].num_steps for m in profile.methods} == {40}
    assert by["sft"].num_steps == 3000 and by["sft"].pad_to_multiple == 32


def test_seeds_flag_takes_a_count_or_a_list_and_the_shared_sft_is_seed_0s(tmp_path):
    assert reproduce.parse_args(["--seeds", "3"]).seeds == [0, 1, 2]
    assert reproduce.parse_args(["--seeds", "2,1"]).seeds == [1, 2]
    assert reproduce.parse_args(["--seeds", "2,"]).seeds == [2]
    for bad in ("0", "x", ",", "-1,2"):
        with pytest.raises(SystemExit):
            reproduce.parse_args(["--seeds", bad])
    profile = reproduce.PROFILES["mechanism_quick"]
    plan = reproduce.build_plan(tmp_path, [2], list(profile.methods), profile)
    by = {r.name: r for r in plan}
    assert by["sft"].config.seed == by["sft"].seed == 0 and by["sft"].workdir == str(tmp_path.resolve() / "sft")
    assert by["value_pretrain"].config.seed == by["vcppo"].config.seed == 2


def test_first_sustained_step_is_when_the_warning_rule_would_fire():
    recs = [{"step": i + 1, "c": v, "e": -1.0} for i, v in enumerate([-0.5, -0.4, 0.1, -0.5, -0.6, None, -0.7, -0.9])]
    recs[6]["e"] = 0.0
    below = lambda v: v < -0.3  # noqa: E731
    assert plot_results.first_sustained_step(recs, ("c",), 2, below) == 2
    assert plot_results.first_sustained_step(recs, ("c",), 3, below) == 7  # step 6 logged nothing: 4, 5, 7
    assert plot_results.first_sustained_step(recs, ("c",), 6, below) is None
    assert plot_results.first_sustained_step(recs, ("missing",), 1, below) is None
    both = lambda c, e: c < -0.3 and e < -0.3  # noqa: E731
    assert plot_results.first_sustained_step(recs, ("c", "e"), 2, both) == 2
    assert plot_results.first_sustained_step(recs, ("c", "e"), 3, both) is None  # step 7's critic error resets


def test_mechanism_report_reads_step0_last_and_step1_critic(tmp_path):
    rng = np.random.default_rng(2)
    truth = {}
    for method in ("ppo", "vcppo", "ppo_bias-2", "vcppo_no_dgae"):
        for seed in (0, 1):
            with MetricWriter(tmp_path / f"seed{seed}" / method, tensorboard=False) as w:
                evals = {step: {k: float(rng.uniform()) for k in plot_results.MECHANISM_KEYS.values()}
                         for step in (0, 5, 10)}
                train = {step: {"diag/value_err_first": float(rng.normal()), "diag/adv_length_corr":
                                float(rng.uniform(-1, 1)), "rollout/response_length_mean": float(rng.uniform(10, 60)),
                                **{f"diag/value_err_pos{i:02d}": float(rng.normal()) for i in range(4)},
                                **{f"diag/tokens_pos{i:02d}": 5.0 for i in range(4)}} for step in range(1, 11)}
                for step in range(11):
                    if step:
                        w.write(step, train[step])
                    if step in evals:
                        w.write(step, evals[step])
            truth[(method, seed)] = (evals, train)
    paths = plot_results.make_mechanism_report(tmp_path, tmp_path / "results")
    assert {p.name for p in paths} >= {"mechanism.json", "mechanism.md", "fig_mechanism.png",
                                       "fig_mechanism_critic_error.png", "fig_mechanism_bias_map.png"}
    table = json.loads((tmp_path / "results" / "mechanism.json").read_text())
    for (method, seed), (evals, train) in truth.items():
        row = table["arms"][method]["per_seed"][str(seed)]
        assert row["pass@1_step0"] == evals[0]["eval/pass@1"] and row["pass@1_last"] == evals[10]["eval/pass@1"]
        assert row["response_length_last"] == evals[10]["eval/response_length_mean"]
        assert row["direct_fraction_step0"] == evals[0]["eval/direct_fraction"]
        assert row["value_err_first_step1"] == train[1]["diag/value_err_first"]
        assert list(row["evals"]) == ["0", "5", "10"]
        assert row["evals"]["5"]["direct_fraction"] == evals[5]["eval/direct_fraction"]
        n = plot_results.EARLY_STEPS
        assert row["adv_length_corr_first"] == pytest.approx(
            np.mean([train[s]["diag/adv_length_corr"] for s in range(1, n + 1)]))
        assert row["sampled_length_last"] == pytest.approx(
            np.mean([train[s]["rollout/response_length_mean"] for s in range(11 - n, 11)]))
    mean = table["arms"]["ppo"]["mean"]["pass@1_last"]
    assert mean["mean"] == pytest.approx(np.mean([truth[("ppo", s)][0][10]["eval/pass@1"] for s in (0, 1)]))
    assert table["arms"]["vcppo"]["eval_means"]["5"]["pass@1"] == pytest.approx(
        np.mean([truth[("vcppo", s)][0][5]["eval/pass@1"] for s in (0, 1)]))
    assert "ppo_bias+1" not in table["arms"]  # arms without runs are left out, not reported as zeros


def test_learning_plan_trains_one_sft_per_seed_and_the_shuffled_control(tmp_path):
    profile = reproduce.PROFILES["learning"]
    plan = reproduce.build_plan(tmp_path, [0, 1], list(profile.methods), profile)
    root = tmp_path.resolve()
    for seed in (0, 1):
        by = {r.name: r.config for r in plan if r.seed == seed}
        assert list(by) == ["sft", "value_pretrain", "vcppo", "grpo", "vcppo_shuffled", "grpo_shuffled"]
        assert by["sft"].workdir == str(root / f"seed{seed}" / "sft") and by["sft"].seed == seed
        assert {by[m].sft_dir for m in ("value_pretrain", *profile.methods)} == {by["sft"].workdir}
        assert [by[m].shuffle_rewards for m in profile.methods] == [False, False, True, True]
        grpo_control = dict(by["grpo_shuffled"].to_dict(), shuffle_rewards=False, workdir=by["grpo"].workdir)
        assert grpo_control == by["grpo"].to_dict()
        # The control differs from VC-PPO in that field alone; every run keeps the config files' recipe.
        control = dict(by["vcppo_shuffled"].to_dict(), shuffle_rewards=False, workdir=by["vcppo"].workdir)
        assert control == by["vcppo"].to_dict()
        assert by["vcppo"].num_steps == config_files.load("vcppo").num_steps


def test_learning_report_is_step0_and_last_eval_per_seed(tmp_path):
    rng = np.random.default_rng(1)
    truth = {}
    for method in plot_results.LEARNING_METHODS:
        for seed in (0, 1):
            with MetricWriter(tmp_path / f"seed{seed}" / method, tensorboard=False) as w:
                evals = {}
                for step in (0, 4, 8):
                    evals[step] = {k: float(rng.uniform()) for k in plot_results.LEARNING_KEYS.values()}
                    if step:
                        w.write(step, {"rollout/accuracy": float(rng.uniform()), "policy/approx_kl": 0.01})
                    w.write(step, evals[step])
            truth[(method, seed)] = evals
    sft_pass = {seed: rng.uniform(size=4) for seed in (0, 1)}  # the SFT run's evals at steps 100..400
    for seed, values in sft_pass.items():
        with MetricWriter(tmp_path / f"seed{seed}" / "sft", tensorboard=False) as w:
            for i, v in enumerate(values):
                w.write(100 * (i + 1), {"eval/pass@1": float(v), "train/loss": 1.0})
    paths = plot_results.make_learning_report(tmp_path, tmp_path / "results")
    assert {p.name for p in paths} == {"learning.json", "learning.md", "fig_learning.png"}
    assert (tmp_path / "results" / "fig_learning.png").read_bytes()[:8] == PNG_MAGIC
    table = json.loads((tmp_path / "results" / "learning.json").read_text())
    for (method, seed), evals in truth.items():
        row = table["methods"][method]["per_seed"][str(seed)]
        assert row["pass@1_step0"] == evals[0]["eval/pass@1"] and row["pass@1_last"] == evals[8]["eval/pass@1"]
        assert row["response_length_last"] == evals[8]["eval/response_length_mean"] and row["last_step"] == 8
        assert row["kl_to_sft_last"] == evals[8]["probe/kl_to_sft"]
        assert row["pass@1_gain"] == pytest.approx(evals[8]["eval/pass@1"] - evals[0]["eval/pass@1"])
        best = int(np.argmax(sft_pass[seed]))
        assert row["sft_best_step"] == 100 * (best + 1) and row["sft_best_pass@1"] == sft_pass[seed][best]
        assert row["pass@1_gain_over_best_sft"] == pytest.approx(evals[8]["eval/pass@1"] - sft_pass[seed][best])
    gains = [truth[(m, s)][8]["eval/pass@1"] - truth[(m, s)][0]["eval/pass@1"] for m, s in truth if m == "grpo"]
    assert table["methods"]["grpo"]["pass@1_gain"]["mean"] == pytest.approx(np.mean(gains))


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
    assert calls == [by["reward_model"], by["value_pretrain"], by["ppo"], by["grpo"]]  # sft done, vcppo skipped
    assert [r.name for r in bad] == ["value_pretrain", "vcppo"] and not stopped

    calls.clear()
    monkeypatch.setattr(reproduce.stages, "run_stage", lambda config: calls.append(config.workdir))  # preempted
    bad, stopped = reproduce.run_plan(plan)
    assert calls == [by["value_pretrain"]] and stopped and bad == []


def test_tiny_study_runs_end_to_end_and_resumes_as_done(tmp_path, capsys):
    """The real loops at seconds-size: the report finds every key it reads in what they write."""
    out, results = tmp_path / "study", tmp_path / "results"
    argv = ["--tiny", "--only", "ppo,vcppo", "--out", str(out), "--results", str(results), "--compile-cache", ""]
    assert reproduce.main(argv) == 0
    table = json.loads((results / "results.json").read_text())["ours"]
    assert set(table) == {"ppo", "vcppo"}
    for method, row in table.items():
        assert row["seeds"] == [0] and row["eval/pass@1"]["steps"] == [2]
        assert 0.0 <= row["rollout/accuracy_last10"]["mean"] <= 1.0 and row["policy/approx_kl_mean"]["n"] == 1
        assert {f"step1/{k}" for k in plot_results.STEP1_KEYS} <= set(row)
    for name in ("fig1_length_accuracy.png", "fig2_value_advantage_by_position.png", "fig2b_critic_diagnostics.png",
                 "fig6_value_pretraining.png"):
        assert (results / name).read_bytes()[:8] == PNG_MAGIC
    assert not (results / "fig4_lambda_actor_sweep.png").exists()  # one lambda_actor point is not a sweep
    capsys.readouterr()
    assert reproduce.main(argv) == 0  # everything finished: skipped, report rewritten
    assert capsys.readouterr().out.count("done, skipping") == 5  # sft, value_pretrain, reward_model, ppo, vcppo


def test_mesh_mismatch_fails_before_any_run(tmp_path, monkeypatch):
    tiny = reproduce.PROFILES["tiny"]
    rl = dict(tiny.fields["rl"], prompts_per_step=3)  # 3 x 2 samples: not a multiple of the 8 test devices
    bad = reproduce.dataclasses.replace(tiny, fields=dict(tiny.fields, rl=rl))
    monkeypatch.setitem(reproduce.PROFILES, "tiny", bad)
    calls = []
    monkeypatch.setattr(reproduce.stages, "run_stage", calls.append)
    out = tmp_path / "study"
    with pytest.raises(SystemExit, match=r"prompts_per_step\*group_size=6 is not divisible"):
        reproduce.main(["--tiny", "--out", str(out), "--compile-cache", ""])
    assert calls == [] and not out.exists()


def test_variant_reuses_finished_stages_and_overrides_rl_fields(tmp_path, monkeypatch):
    base, out = tmp_path / "base", tmp_path / "variant"
    done = {str(base.resolve() / "sft")} | {str(base.resolve() / f"seed{s}" / st)
                                             for s in (0, 1) for st in ("value_pretrain", "reward_model")}
    monkeypatch.setattr(reproduce.stages, "stage_done", lambda workdir: workdir in done)
    args = reproduce.parse_args(["--set", "actor_optim.lr=1e-4", "--set", "loss_agg=seq-mean-token-mean",
                                 "--stages-from", str(base)])
    assert args.rl_set == {"actor_optim.lr": 1e-4, "loss_agg": "seq-mean-token-mean"}
    plan = reproduce.build_plan(out, [0, 1], ["ppo", "vcppo", "grpo"], reproduce.PROFILES["full"], args.rl_set,
                                args.stages_from)
    assert [(r.seed, r.name) for r in plan] == [(s, m) for s in (0, 1) for m in ("ppo", "vcppo", "grpo")]
    for r in plan:
        c = r.config
        assert c.actor_optim.lr == 1e-4 and c.loss_agg == "seq-mean-token-mean"
        assert c.workdir == str(out.resolve() / f"seed{r.seed}" / r.name)
        assert c.sft_dir == str(base.resolve() / "sft") and c.task.data_dir == str(base.resolve() / "tfds")
        assert set(r.needs) <= done and len(r.needs) == (1 if r.name == "grpo" else 2)
    with pytest.raises(ValueError, match="no finished reward_model"):
        reproduce.build_plan(out, [2], ["ppo"], reproduce.PROFILES["full"], stages_from=base)
    with pytest.raises(ValueError, match="'actor_optim.lrr' does not exist"):
        reproduce.build_plan(out, [0], ["ppo"], reproduce.PROFILES["full"], {"actor_optim.lrr": 1e-4}, base)
    with pytest.raises(SystemExit):
        reproduce.parse_args(["--set", "no_equals_sign"])


@pytest.mark.parametrize("argv, profile, out", [
    ([], "full", "runs/reproduce"), (["--quick"], "quick", "runs/reproduce"),
    (["--learning"], "learning", "runs/learning"), (["--mechanism"], "mechanism", "runs/mechanism"),
    (["--mechanism", "--quick"], "mechanism_quick", "runs/mechanism_quick"),
    (["--mechanism", "--long"], "mechanism_long", "runs/mechanism_long")])
def test_profile_flags_choose_profile_and_out(monkeypatch, argv, profile, out):
    seen = {}
    monkeypatch.setattr(reproduce, "build_plan", lambda out_dir, seeds, methods, prof, *a: seen.update(
        out=out_dir, profile=prof, seeds=seeds) or [])
    monkeypatch.setattr(reproduce, "check_meshes", lambda plan: None)
    assert reproduce.main(argv + ["--dry-run"]) == 0
    assert seen["profile"] is reproduce.PROFILES[profile] and seen["out"] == pathlib.Path(out).resolve()
    assert seen["seeds"] == list(range(reproduce.PROFILES[profile].seeds))


@pytest.mark.parametrize("argv", [["--learning", "--mechanism"], ["--quick", "--learning"], ["--tiny", "--quick"],
                                  ["--mechanism", "--tiny"], ["--long"], ["--mechanism", "--long", "--quick"]])
def test_exclusive_profile_flags(argv):
    with pytest.raises(SystemExit):
        reproduce.parse_args(argv)


def test_trailing_mean_matches_a_loop():
    x = np.random.default_rng(1).normal(size=23)
    for window in (1, 3, 5, 30):
        want = [x[max(0, t - window + 1):t + 1].mean() for t in range(x.size)]
        np.testing.assert_allclose(plot_results.trailing_mean(x, window), want, rtol=1e-12)


def test_real_model_report_reads_each_arm_and_the_step1_critic(tmp_path):
    rng = np.random.default_rng(3)
    truth = {}
    rollout = lambda s: {"rollout/accuracy": 0.1 * s, "rollout/response_length_mean": 9.0 + s}  # noqa: E731
    probe = "kl1/grpo_shuffled"  # a recipe probe, in a folder of its own, evaluated half way as well
    for arm, steps in (("vcppo", 6), ("grpo", 4), ("grpo_seed1", 4), ("ppo_step1", 1), (probe, 4)):
        with MetricWriter(tmp_path / arm, tensorboard=False) as w:
            at = (0, 2, steps) if arm == probe else (0, steps)
            evals = {s: {k: float(rng.uniform()) for k in real_model_report.EVAL_KEYS.values()} for s in at}
            step1 = rollout(1)
            if "grpo" not in arm:
                step1.update({f"diag/value_pos{i:02d}": float(rng.normal()) for i in range(4)})
                step1.update({f"diag/value_err_pos{i:02d}": float(rng.normal()) for i in range(4)})
                step1.update({f"diag/tokens_pos{i:02d}": float(i < 3) for i in range(4)})  # the last bucket empty
            w.write(0, evals[0])
            for s in range(1, steps + 1):
                w.write(s, step1 if s == 1 else rollout(s))
                if s in evals:
                    w.write(s, evals[s])
        truth[arm] = (evals, step1, steps)
    # The critic stages: value pretraining fit for 3 steps (converged at the last); the reward model has no metrics.
    fit = [{"value/loss": 0.5 - 0.1 * s, "value/explained_var": 0.1 * s, "value/mean": -0.2 * s,
            "value/converged": float(s == 3), "rollout/reward_mean": -0.5 - 0.1 * s} for s in (1, 2, 3)]
    with MetricWriter(tmp_path / "value_pretrain", tensorboard=False) as w:
        for s, m in enumerate(fit, 1):
            w.write(s, m)
    # eval_hf.py's results: the base model on the recipe's eval_prompts problems, GRPO's on as many, VC-PPO's on fewer.
    (tmp_path / "results").mkdir()
    for name, num, correct in (("base", 128, 30), ("grpo", 128, 70), ("vcppo", 64, 10)):
        hf = {"model": f"runs/{name}_hf", "num": num, "correct": correct, "pass@1": correct / num,
              "response_length_mean": 40.0, "seconds": 100.0}
        (tmp_path / "results" / f"transformers_{name}.json").write_text(json.dumps(hf))
    paths = real_model_report.make_report(tmp_path, tmp_path / "results")
    assert {p.name for p in paths} == {"real_model.json", "real_model.md", "fig_real_model_learning.png",
                                       "fig_real_model_probes.png", "fig_real_model_value_by_position.png"}
    table = json.loads((tmp_path / "results" / "real_model.json").read_text())
    assert set(table["arms"]) == {"vcppo", "grpo", "grpo_seed1", "ppo_step1", probe}  # arms without runs: left out
    for arm, (evals, step1, steps) in truth.items():
        row = table["arms"][arm]
        assert row["rl_steps"] == steps
        assert row["pass@1_step0"] == evals[0]["eval/pass@1"] and row["answer_rate_last"] == evals[steps][
            "eval/answer_rate"]
        assert row["pass@1_gain"] == pytest.approx(evals[steps]["eval/pass@1"] - evals[0]["eval/pass@1"])
        if steps < 2 * real_model_report.ROLLOUT_WINDOW:
            assert row["rollouts"] is None
        else:  # steps 1-3 against 4-6; the clip ratio and entropy were never logged
            assert row["rollouts"] == pytest.approx({"accuracy_first": 0.2, "accuracy_last": 0.5, "length_first": 11.0,
                                                     "length_last": 14.0, "clip_ratio_first": None,
                                                     "clip_ratio_last": None, "entropy_first": None,
                                                     "entropy_last": None})
        assert row["pass_at_1_by_step"] == pytest.approx({str(s): e["eval/pass@1"] for s, e in evals.items()})
        critic = row.get("critic_step1")
        if "grpo" in arm:
            assert critic is None
            continue
        assert critic["value"] == [step1[f"diag/value_pos{i:02d}"] for i in range(4)]
        value_minus_err = [step1[f"diag/value_pos{i:02d}"] - step1[f"diag/value_err_pos{i:02d}"] for i in range(4)]
        assert critic["mc_return"] == pytest.approx(value_minus_err)
        assert critic["bucket_start"] == [0, 32, 64, 96]  # configs/smollm2.py: 128-token responses
    gain = {arm: evals[steps]["eval/pass@1"] - evals[0]["eval/pass@1"] for arm, (evals, _, steps) in truth.items()}
    seeds = table["seeds"]  # VC-PPO on one seed, GRPO on two, the control on none
    assert set(seeds) == {"VC-PPO", "GRPO"}
    assert seeds["VC-PPO"] == {"arms": ["vcppo"], "gains": [pytest.approx(gain["vcppo"])],
                               "gain_mean": pytest.approx(gain["vcppo"]), "gain_std": None}
    two = [gain["grpo"], gain["grpo_seed1"]]
    assert seeds["GRPO"]["arms"] == ["grpo", "grpo_seed1"] and seeds["GRPO"]["gains"] == pytest.approx(two)
    assert seeds["GRPO"]["gain_mean"] == pytest.approx(sum(two) / 2)
    assert seeds["GRPO"]["gain_std"] == pytest.approx(abs(two[0] - two[1]) / 2 ** 0.5)  # two seeds: |a - b| / sqrt 2
    independent = table["independent"]
    assert independent["base"]["logged_step"] == 0  # any arm's step-0 evaluation: the instruct model
    assert independent["base"]["logged_correct"] == round(truth["vcppo"][0][0]["eval/pass@1"] * 128)
    assert (independent["grpo"]["logged_step"], independent["grpo"]["logged_correct"]) == (
        4, round(truth["grpo"][0][4]["eval/pass@1"] * 128))  # the last evaluation
    assert independent["vcppo"]["logged_correct"] is None  # 64 problems: not the runs' 128
    assert table["critic_stages"] == {"value_pretrain": {
        "steps": 3, "loss_first": pytest.approx(0.4), "loss_last": pytest.approx(0.2),
        "explained_var_last": pytest.approx(0.3), "value_mean_last": pytest.approx(-0.6),
        "reward_mean": pytest.approx(-0.7), "converged": True}}
    md = (tmp_path / "results" / "real_model.md").read_text()
    assert "| `value_pretrain` | 3 | 0.400 -> 0.200 | +0.300 | -0.600 | -0.700 | yes |" in md
    assert f"| GRPO | 2 | {100 * two[0]:.1f} / {100 * two[1]:.1f} | {50 * sum(two):.1f} +- " in md
    diff = 70 - independent["grpo"]["logged_correct"]
    assert f"| {diff:+d} |" in md and "| 10 (15.6) | - | - |" in md
    assert f"| {real_model_report.ARMS['vcppo']} | 20.0 -> 50.0 | 11.0 -> 14.0 | - -> - | - -> - |" in md
    assert md.count("\n| critic from the reward model: value |") == 1 and " - |" in md  # the empty bucket
    assert "(*)" not in md
    by_step = ", ".join(f"{s}: {100 * e['eval/pass@1']:.1f}" for s, e in truth[probe][0].items())
    assert f"| {real_model_report.ARMS[probe]} | {by_step} |" in md  # the one arm evaluated between 0 and its end
    assert md.count("| 0: ") == 1

    # The GRPO runs and the probe gone from the root: their rows, seeds and counts stay, marked; the learning and
    # probe figures are kept.
    results = tmp_path / "results"
    figures = {name: (results / name).read_bytes() for name in (real_model_report.LEARNING_FIGURE,
                                                                real_model_report.PROBE_FIGURE)}
    for arm in ("grpo", "grpo_seed1", probe):
        shutil.rmtree(tmp_path / arm)
    paths = real_model_report.make_report(tmp_path, results)
    assert {p.name for p in paths} == {"real_model.json", "real_model.md", "fig_real_model_value_by_position.png"}
    assert all((results / name).read_bytes() == data for name, data in figures.items())
    again = json.loads((results / "real_model.json").read_text())
    assert list(again["arms"]) == ["vcppo", "grpo", "ppo_step1", "grpo_seed1", probe]  # the order of ARMS
    for arm in ("grpo", "grpo_seed1", probe):
        assert again["arms"][arm] == {**table["arms"][arm], "carried_from": table["provenance"]}
    assert again["arms"]["vcppo"] == table["arms"]["vcppo"] and again["seeds"] == table["seeds"]
    assert again["independent"] == table["independent"] and again["critic_stages"] == table["critic_stages"]
    md = (results / "real_model.md").read_text()
    assert "| GRPO (*) | 4 |" in md and "| GRPO, seed 1 (*) | 4 |" in md and "| GRPO, seed 1 |" not in md
    assert f"(*) read from the runs of an earlier report (commit {table['provenance']['commit']}" in md
    paths = real_model_report.make_report(tmp_path, results, "fig_added.png")  # the runs here, another name
    assert "fig_added.png" in {p.name for p in paths}
    assert json.loads((results / "real_model.json").read_text())["arms"]["grpo"]["carried_from"] == table[
        "provenance"]  # carried again: still the report that read the run
    assert (tmp_path / "results" / "fig_real_model_value_by_position.png").read_bytes()[:8] == PNG_MAGIC
