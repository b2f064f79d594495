"""The real-model study's report (SmolLM2-135M-Instruct on word problems, `configs/smollm2.py`), from its runs.

Reads `<root>/<arm>/metrics.jsonl` for each arm of `ARMS` that exists and writes to `--results`:

  real_model.json, real_model.md   per arm: greedy pass@1, answer (format) rate, clip ratio and response length at
                                   step 0 (the instruct model) and at the last evaluation, the step reached of the
                                   steps configured, the training rollouts' accuracy, length, clip ratio and
                                   entropy over the first and last 3 steps; per critic arm, the critic at RL step 1 by
                                   position bucket and, per `transformers_<arm>.json` in --results (`eval_hf.py
                                   --out`; `base`: the instruct model), transformers' greedy pass@1 on the same
                                   problems beside the run's own evaluation (the last one; step 0 for `base`);
                                   per critic stage (`CRITIC_STAGES`), how far its fit went before RL;
                                   per method of `SEEDED`, its gain on each seed run and their mean;
                                   arms with no run under --root keep their rows from the real_model.json already
                                   there (`carry_over`), marked with that report's provenance
  fig_real_model_learning.png      greedy pass@1 and the training rollouts' accuracy and length vs RL step (the
                                   runs under --root; kept, not redrawn, while an RL arm's row is carried over:
                                   `--learning-figure NAME` draws the runs here under another name)
  fig_real_model_probes.png        the same panels for the probes of the recipe (arms in a subfolder of --root)
  fig_real_model_value_by_position.png  the paper's Fig. 2 on a real backbone: at RL step 1 (the first rollout of
                                   the instruct model, the same responses for every arm), the critic's value by
                                   response position against the Monte-Carlo return, for the critic initialised
                                   from a reward model (scored only at EOS) and for the value-pretrained critic

  python experiments/real_model_report.py [--root runs/smollm2] [--results experiments/results/real_model] \
      [--learning-figure fig_real_model_learning.png]

The arms are `configs/smollm2.py`'s presets and their shuffled-reward controls, run as its docstring says;
`ppo_step1`, the ppo preset stopped after its first step (`--config.num_steps=1
--config.workdir=runs/smollm2/ppo_step1`); and the same from a shorter critic fit (8 steps at lr 3e-5 instead of
the recipe's 24 at 1e-4), `vcppo_vp8`:
  python experiments/train.py --config=configs/smollm2.py:vcppo --config.workdir=runs/smollm2/vcppo_vp8 \
      --config.critic_dir=runs/smollm2/value_pretrain_vp8 --config.stage_overrides.value_pretrain.max_steps=8 \
      --config.stage_overrides.value_pretrain.min_steps=8 --config.stage_overrides.value_pretrain.lr=3e-5
and `ppo_step1_rm8`:
  python experiments/train.py --config=configs/smollm2.py:ppo --config.num_steps=1 \
      --config.workdir=runs/smollm2/ppo_step1_rm8 --config.critic_dir=runs/smollm2/reward_model_rm8 \
      --config.stage_overrides.reward_model.max_steps=8 --config.stage_overrides.reward_model.min_steps=8 \
      --config.stage_overrides.reward_model.lr=3e-5
and the other seeds of the main arms (`SEEDED`), the same commands with `--config.seed=1` (and each seed of
`SEEDS`: `_seed2`, `_seed3`) and their own directories:
  python experiments/train.py --config=configs/smollm2.py:grpo --config.seed=1 --config.workdir=runs/smollm2/grpo_seed1
  python experiments/train.py --config=configs/smollm2.py:vcppo --config.seed=1 \
      --config.workdir=runs/smollm2/vcppo_seed1 --config.critic_dir=runs/smollm2/value_pretrain_seed1
  python experiments/train.py --config=configs/smollm2.py:grpo --config.seed=1 --config.shuffle_rewards=True \
      --config.workdir=runs/smollm2/grpo_shuffled_seed1
and probes for a recipe whose control stays flat (none found so far), each in a folder named for what it changes:
  python experiments/train.py --config=configs/smollm2.py:grpo --config.actor_optim.lr=5e-6 \
      --config.workdir=runs/smollm2/lr5e-6/grpo
  python experiments/train.py --config=configs/smollm2.py:grpo --config.shuffle_rewards=True \
      --config.actor_optim.lr=5e-6 --config.workdir=runs/smollm2/lr5e-6/grpo_shuffled
  python experiments/train.py --config=configs/smollm2.py:grpo --config.shuffle_rewards=True --config.kl_coef=1.0 \
      --config.eval_every=6 --config.workdir=runs/smollm2/kl1/grpo_shuffled
  python experiments/train.py --config=configs/smollm2.py:grpo --config.kl_coef=1.0 --config.eval_every=6 \
      --config.workdir=runs/smollm2/kl1/grpo
  python experiments/train.py --config=configs/smollm2.py:grpo --config.shuffle_rewards=True \
      --config.num_minibatches=8 --config.actor_optim.lr=2.5e-6 --config.actor_optim.warmup_steps=8 \
      --config.eval_every=6 --config.num_steps=24 --config.workdir=runs/smollm2/mb8/grpo_shuffled
  python experiments/train.py --config=configs/smollm2.py:grpo --config.num_minibatches=8 \
      --config.actor_optim.lr=2.5e-6 --config.actor_optim.warmup_steps=8 --config.eval_every=6 \
      --config.num_steps=24 --config.workdir=runs/smollm2/mb8/grpo
(the mb8 runs were run to 12 steps, then resumed with --config.num_steps=18 and 24: a resumed run continues exactly
where its checkpoint left it)
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

import config_files  # noqa: E402
import plot_results  # noqa: E402
from vcppo_jax.metrics import METRICS_FILE, read_metrics  # noqa: E402

# The seeds the main arms were run on besides seed 0 (`<arm>_seed<s>`, VC-PPO's critic in `value_pretrain_seed<s>`).
SEEDS = (1, 2, 3)
# Run directory under --root -> label. `ppo_step1`: the PPO preset stopped after one step (its critic at step 1).
ARMS = {"vcppo": "VC-PPO (value-pretrained critic, GAE 0.95 / 1.0)", "grpo": "GRPO",
        "ppo": "PPO (reward-model critic, GAE 0.95)", "ppo_step1": "PPO, first step only (reward-model critic)",
        "vcppo_shuffled": "VC-PPO on shuffled rewards (control)", "grpo_shuffled": "GRPO on shuffled rewards (control)",
        "vcppo_vp8": "VC-PPO, critic pretrained for 8 steps at lr 3e-5",
        "ppo_step1_rm8": "PPO, first step only (reward model fit for 8 steps at lr 3e-5)",
        **{arm: label for s in SEEDS for arm, label in (
            (f"grpo_seed{s}", f"GRPO, seed {s}"), (f"vcppo_seed{s}", f"VC-PPO, seed {s}"),
            (f"grpo_shuffled_seed{s}", f"GRPO on shuffled rewards, seed {s} (control)"))},
        "lr5e-6/grpo": "GRPO, lr 5e-6", "lr5e-6/grpo_shuffled": "GRPO on shuffled rewards (control), lr 5e-6",
        "kl1/grpo": "GRPO, KL to the instruct model (kl_coef 1)",
        "kl1/grpo_shuffled": "GRPO on shuffled rewards (control), KL to the instruct model (kl_coef 1)",
        "mb8/grpo": "GRPO, 8 updates per step at lr 2.5e-6, 24 steps",
        "mb8/grpo_shuffled": "GRPO on shuffled rewards (control), 8 updates per step at lr 2.5e-6, 24 steps"}
# Method -> its arms on seeds 0, 1, ...: the gains are summarised across seeds.
SEEDED = {method: (arm, *(f"{arm}_seed{s}" for s in SEEDS))
          for method, arm in (("VC-PPO", "vcppo"), ("GRPO", "grpo"),
                              ("GRPO on shuffled rewards (control)", "grpo_shuffled"))}
CRITIC_ARMS = {"ppo_step1": ("critic from the reward model", "C3"), "ppo": ("critic from the reward model", "C3"),
               "vcppo": ("value-pretrained critic", "C0"), "vcppo_vp8": ("value-pretrained critic, 8 steps", "C1"),
               "ppo_step1_rm8": ("critic from the reward model, 8 steps", "C5")}
# The critic arms' critic stages (their `critic_dir` under --root): how far each fit went before RL started.
CRITIC_STAGES = {"vcppo": "value_pretrain", "vcppo_vp8": "value_pretrain_vp8", "ppo": "reward_model",
                 "ppo_step1": "reward_model", "ppo_step1_rm8": "reward_model_rm8",
                 **{f"vcppo_seed{s}": f"value_pretrain_seed{s}" for s in SEEDS}}
EVAL_KEYS = {"pass@1": "eval/pass@1", "answer_rate": "eval/answer_rate", "clip_ratio": "eval/clip_ratio",
             "response_length": "eval/response_length_mean"}
# The training rollouts (sampled at the recipe's temperature), compared over the first and the last ROLLOUT_WINDOW
# steps: what separates learning from drift when the greedy evaluation only runs at the start and the end.
ROLLOUT_KEYS = {"accuracy": "rollout/accuracy", "length": "rollout/response_length_mean",
                "clip_ratio": "rollout/clip_ratio", "entropy": "rollout/entropy"}
ROLLOUT_WINDOW = 3
LEARNING_FIGURE = "fig_real_model_learning.png"
PROBE_FIGURE = "fig_real_model_probes.png"  # the probes' curves, kept like LEARNING_FIGURE while one is carried


def load_runs(root: pathlib.Path) -> dict[str, list[dict[str, Any]]]:
    """{arm: metrics records} for the arms with a metrics file."""
    return {arm: read_metrics(root / arm) for arm in ARMS if (root / arm / METRICS_FILE).is_file()}


def critic_at_step1(records: list[dict[str, Any]], response_len: int) -> dict[str, Any] | None:
    """The initial critic on the first rollout, per position bucket: mean value, mean Monte-Carlo return (value
    minus the logged error: both are means over the same tokens) and token count; buckets in tokens."""
    first = plot_results._first_rl_record(records, "diag/value_pos00")
    if first is None:
        return None
    n = sum(1 for k in first if k.startswith("diag/value_pos"))
    counts = [first.get(f"diag/tokens_pos{i:02d}") for i in range(n)]
    value = [first[f"diag/value_pos{i:02d}"] for i in range(n)]
    mc = [v - first[f"diag/value_err_pos{i:02d}"] for i, v in enumerate(value)]
    return {"bucket_start": [i * response_len // n for i in range(n)], "tokens": counts, "value": value,
            "mc_return": mc, "value_err_first": first.get("diag/value_err_first"),
            "explained_var": first.get("value/explained_var_old")}


def critic_stage_summary(records: list[dict[str, Any]]) -> dict[str, Any]:
    """A value-pretraining or reward-model stage's fit: steps run, value loss and explained variance at the first
    and last step, the critic's mean prediction at the last step against the mean sequence reward of the stage's
    rollouts (what a calibrated critic's mean approaches), and whether the stage's convergence test passed."""
    fit = [r for r in records if "value/loss" in r]
    rewards = [r["rollout/reward_mean"] for r in fit if "rollout/reward_mean" in r]
    first, last = fit[0], fit[-1]
    return {"steps": last["step"], "loss_first": first["value/loss"], "loss_last": last["value/loss"],
            "explained_var_last": last.get("value/explained_var"), "value_mean_last": last.get("value/mean"),
            "reward_mean": float(np.mean(rewards)) if rewards else None,
            "converged": bool(last.get("value/converged", 0.0))}


def critic_stages(root: pathlib.Path, runs: dict) -> dict[str, dict[str, Any]]:
    """{critic stage directory: `critic_stage_summary`} for the critic arms run under `root`."""
    out = {}
    for stage in sorted({CRITIC_STAGES[a] for a in runs if a in CRITIC_STAGES}):
        records = read_metrics(root / stage) if (root / stage / METRICS_FILE).is_file() else []
        if any("value/loss" in r for r in records):
            out[stage] = critic_stage_summary(records)
    return out


def independent_evaluations(runs: dict, results: pathlib.Path, eval_prompts: int) -> dict[str, dict[str, Any]]:
    """{arm or 'base': transformers' count of correct problems (`eval_hf.py --out`) and the count the run logged on
    the same problems: its last evaluation, or for `base` a step-0 evaluation (the instruct model, every arm's).
    Counts are compared only on the recipe's `eval_prompts` problems, the ones the runs evaluate."""
    out = {}
    for path in sorted(results.glob("transformers_*.json")):
        name, hf = path.stem.removeprefix("transformers_"), json.loads(path.read_text())
        if name == "base":
            firsts = (plot_results.first_value(r, "eval/pass@1") for r in runs.values())
            logged = next((f for f in firsts if f and f[0] == 0), None)
        else:
            logged = plot_results.final_value(runs[name], "eval/pass@1") if name in runs else None
        if hf["num"] != eval_prompts:
            logged = None
        out[name] = {"model": hf["model"], "num": hf["num"], "correct": hf["correct"], "pass@1": hf["pass@1"],
                     "response_length_mean": hf["response_length_mean"], "seconds": hf["seconds"],
                     "logged_step": logged and logged[0], "logged_correct": logged and round(logged[1] * hf["num"])}
    return out


def rollout_drift(records: list[dict[str, Any]]) -> dict[str, float] | None:
    """{name}_first / {name}_last for each of `ROLLOUT_KEYS`: its mean over the first / last `ROLLOUT_WINDOW` RL
    steps; None for a run shorter than two windows."""
    if len(plot_results.series(records, ROLLOUT_KEYS["accuracy"])[0]) < 2 * ROLLOUT_WINDOW:
        return None
    return {f"{name}_{end}": plot_results.steps_mean(records, key, ROLLOUT_WINDOW, last=end == "last")
            for name, key in ROLLOUT_KEYS.items() for end in ("first", "last")}


def report_table(runs: dict, recipe) -> dict[str, Any]:
    """Per arm: `EVAL_KEYS` at step 0 and at the last evaluation, the RL steps run, the training rollouts' drift,
    the critic at step 1."""
    response_len = recipe.task.max_response_len
    arms = {}
    for arm, records in runs.items():
        row = plot_results.step0_and_last(records, EVAL_KEYS)
        steps, passes = plot_results.series(records, EVAL_KEYS["pass@1"])
        row.update(label=ARMS[arm], rl_steps=max((r["step"] for r in records), default=0),
                   rollouts=rollout_drift(records), pass_at_1_by_step=dict(zip(map(str, steps), passes.tolist())))
        if "pass@1_step0" in row and "pass@1_last" in row:
            row["pass@1_gain"] = row["pass@1_last"] - row["pass@1_step0"]
        if arm in CRITIC_ARMS:
            row["critic_step1"] = critic_at_step1(records, response_len)
        arms[arm] = row
    return {"arms": arms, "seeds": seed_summary(arms),
            "recipe": {"num_steps": recipe.num_steps, "max_response_len": response_len,
                       "eval_prompts": recipe.eval_prompts},
            "columns": "greedy pass@1, answer rate (a final answer the verifier reads: \\boxed{} or 'The answer is "
                       "N'), clip ratio (responses that reached the length cap) and mean length on the first "
                       "eval_prompts test problems, at step 0 (the instruct model) and at the last evaluation"}


def seed_summary(arms: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per method of `SEEDED` with at least one finished arm: the arms run, each one's greedy pass@1 gain, and
    their mean (and sample standard deviation over two or more seeds)."""
    out = {}
    for method, names in SEEDED.items():
        done = [a for a in names if arms.get(a, {}).get("pass@1_gain") is not None]
        if not done:
            continue
        gains = [arms[a]["pass@1_gain"] for a in done]
        out[method] = {"arms": done, "gains": gains, "gain_mean": float(np.mean(gains)),
                       "gain_std": float(np.std(gains, ddof=1)) if len(gains) > 1 else None}
    return out


def _critics(table: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """{arm: its critic at step 1} for the arms that logged one."""
    return {a: r["critic_step1"] for a, r in table["arms"].items() if r.get("critic_step1")}


def _section(title: str, intro: str, columns: list[str]) -> list[str]:
    """Markdown lines opening a report section: its heading, one paragraph, a table's header row and rule."""
    return ["", f"## {title}", "", intro, "", "| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]


def report_markdown(table: dict[str, Any]) -> str:
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    lines = ["# SmolLM2-135M-Instruct, RL from the instruct model", "", table["columns"] + ".", "",
             f"The recipe: {table['recipe']['num_steps']} RL steps, responses up to "
             f"{table['recipe']['max_response_len']} tokens, {table['recipe']['eval_prompts']} test problems.", "",
             "| arm | RL steps run | pass@1 step 0 -> last (%) | gain (points) | answer rate (%) | clip ratio (%) "
             "| length |", "|---|---|---|---|---|---|---|"]
    for r in table["arms"].values():
        arrow = lambda k: f"{pct(r.get(k + '_step0'))} -> {pct(r.get(k + '_last'))}"  # noqa: E731
        length = " -> ".join("-" if r.get(k) is None else f"{r[k]:.1f}"
                             for k in ("response_length_step0", "response_length_last"))
        mark = " (*)" if r.get("carried_from") else ""
        lines.append(f"| {r['label']}{mark} | {r['rl_steps']} | {arrow('pass@1')} "
                     f"| {pct(r.get('pass@1_gain'))} | {arrow('answer_rate')} | {arrow('clip_ratio')} | {length} |")
    origins = sorted({(o["commit"], o["date"]) for r in table["arms"].values() if (o := r.get("carried_from"))})
    if origins:
        lines += ["", "(*) read from the runs of an earlier report (" + "; ".join(
            f"commit {c}, {d}" for c, d in origins) + "), whose run directories are not on this machine."]
    if table.get("seeds"):
        lines += _section("Across seeds", "The gain in greedy pass@1 (step 0 -> last evaluation) of each method's "
                          "arms on seeds 0, 1, ...; mean and sample standard deviation over the seeds run.",
                          ["method", "seeds run", "gain per seed (points)", "mean gain (points)"])
        for method, s in table["seeds"].items():
            spread = "" if s["gain_std"] is None else f" +- {pct(s['gain_std'])}"
            lines.append(f"| {method} | {len(s['arms'])} | {' / '.join(pct(g) for g in s['gains'])} "
                         f"| {pct(s['gain_mean'])}{spread} |")
    between = {r["label"]: r["pass_at_1_by_step"] for r in table["arms"].values()
               if len(r.get("pass_at_1_by_step", {})) > 2}
    if between:
        lines += _section("Greedy pass@1 at each evaluation", "The arms evaluated between step 0 and their last step.",
                          ["arm", "pass@1 (%) at step: value"])
        for label, by_step in between.items():
            lines.append(f"| {label} | " + ", ".join(f"{s}: {pct(v)}" for s, v in by_step.items()) + " |")
    drifts = {r["label"]: r["rollouts"] for r in table["arms"].values() if r.get("rollouts")}
    if drifts:
        lines += _section("The training rollouts, first steps -> last steps",
                          f"Means over the first and the last {ROLLOUT_WINDOW} RL steps of the sampled training "
                          "responses: accuracy on the true reward, length, the fraction cut at the length cap, and "
                          "the policy's per-token entropy.", ["arm", "accuracy (%)", "length", "clip ratio (%)",
                                                               "entropy"])
        fixed = lambda digits: lambda v: "-" if v is None else f"{v:.{digits}f}"  # noqa: E731
        for label, d in drifts.items():
            cell = lambda k, f: f"{f(d[k + '_first'])} -> {f(d[k + '_last'])}"  # noqa: E731
            lines.append(f"| {label} | {cell('accuracy', pct)} | {cell('length', fixed(1))} "
                         f"| {cell('clip_ratio', pct)} | {cell('entropy', fixed(2))} |")
    if table.get("independent"):
        lines += _section("The same policies evaluated by transformers alone (`experiments/eval_hf.py`)",
                          "Greedy `generate()` of the exported HF folder through its own chat template, graded by the "
                          "task's verifier, on the run's evaluation problems.",
                          ["policy", "HF folder", "problems", "transformers: correct (pass@1 %)",
                           "the run's evaluation: correct (step)", "difference (problems)", "transformers' time (s)"])
        for name, e in table["independent"].items():
            label = "the instruct model (base)" if name == "base" else ARMS.get(name, name)
            logged = "-" if e["logged_correct"] is None else f"{e['logged_correct']} (step {e['logged_step']})"
            diff = "-" if e["logged_correct"] is None else f"{e['correct'] - e['logged_correct']:+d}"
            lines.append(f"| {label} | `{e['model']}` | {e['num']} | {e['correct']} ({pct(e['pass@1'])}) | {logged} "
                         f"| {diff} | {e['seconds']:.0f} |")
    if table.get("critic_stages"):
        lines += _section("The critic stages before RL",
                          "Value loss (half the squared error to the Monte-Carlo return), explained variance, and the "
                          "critic's mean prediction against the mean sequence reward of the stage's rollouts.",
                          ["stage", "steps", "value loss first -> last", "explained variance", "mean value",
                           "mean reward", "converged"])
        num = lambda v: "-" if v is None else f"{v:+.3f}"  # noqa: E731
        for stage, c in table["critic_stages"].items():
            lines.append(f"| `{stage}` | {c['steps']} | {c['loss_first']:.3f} -> {c['loss_last']:.3f} "
                         f"| {num(c['explained_var_last'])} | {num(c['value_mean_last'])} | {num(c['reward_mean'])} "
                         f"| {'yes' if c['converged'] else 'no'} |")
    critics = _critics(table)
    if critics:
        starts = next(iter(critics.values()))["bucket_start"]
        lines += _section("The critic at RL step 1, by response position (tokens)",
                          "Mean value V(s_t) and mean Monte-Carlo return over the first rollout's tokens in each "
                          "bucket.", ["critic", *(str(s) for s in starts)])
        for arm, c in critics.items():
            label = CRITIC_ARMS[arm][0]
            lines.append(f"| {label}: value | " + " | ".join(_num(v, n) for v, n in zip(c["value"], c["tokens"]))
                         + " |")
            lines.append(f"| {label}: return | " + " | ".join(_num(v, n) for v, n in zip(c["mc_return"],
                                                                                         c["tokens"])) + " |")
    return "\n".join(lines + [""])


def _num(v: float, tokens: float | None) -> str:
    return "-" if tokens == 0 else f"{v:+.2f}"


def _is_probe(arm: str) -> bool:
    """An arm probing a change of the recipe: its run sits in a folder named for the change (`kl1/grpo`)."""
    return "/" in arm


def _in_learning_figure(arm: str) -> bool:
    """An arm whose curves the learning figure draws: not the one-step `ppo_step1*` arms (kept for their critic),
    not the probes (`PROBE_FIGURE`)."""
    return not arm.startswith("ppo_step1") and not _is_probe(arm)


def plot_learning(runs: dict, path: pathlib.Path, title: str = "SmolLM2-135M-Instruct, word problems: RL from the "
                  "instruct model (seed 0 unless the label says otherwise)") -> pathlib.Path | None:
    if not runs:
        return None
    tree = {a: {0: r} for a, r in runs.items()}
    panels = [("eval/pass@1", 1, "greedy pass@1 (test problems)", "(a) test accuracy, greedy"),
              ("rollout/accuracy", 3, "accuracy of the training rollouts", "(b) sampled accuracy (3-step mean)"),
              ("eval/answer_rate", 1, "responses with a final answer", "(c) answer (format) rate, greedy"),
              ("rollout/response_length_mean", 3, "mean length (tokens)", "(d) training response length")]
    arms = {a: (ARMS[a], f"C{i}") for i, a in enumerate(runs)}
    fig, axes = plot_results.band_panels(tree, arms, panels, (12, 8))
    return plot_results._save(fig, list(axes.flat), path, title)


def plot_value_by_position(table: dict[str, Any], path: pathlib.Path) -> pathlib.Path | None:
    critics = _critics(table)
    if not critics:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for arm, c in critics.items():
        label, color = CRITIC_ARMS[arm]
        seen = np.array([n != 0 for n in c["tokens"]])
        x = np.array(c["bucket_start"])[seen]
        value, mc = np.array(c["value"])[seen], np.array(c["mc_return"])[seen]
        axes[0].plot(x, value, color=color, marker="o", ms=3, label=f"{label}: V(s_t)")
        axes[0].plot(x, mc, color="k", ls=":", lw=1, label="Monte-Carlo return" if arm == next(iter(critics)) else None)
        axes[1].plot(x, value - mc, color=color, marker="o", ms=3, label=label)
    axes[0].set(xlabel="response token position (bucket start)", ylabel="mean over the bucket's tokens",
                title="(a) value and return by position")
    axes[1].set(xlabel="response token position (bucket start)", ylabel="V(s_t) - Monte-Carlo return",
                title="(b) critic error by position (< 0: pessimistic)")
    axes[0].legend(fontsize=7)
    return plot_results._save(fig, list(axes), path, "The critic at RL step 1 on SmolLM2-135M-Instruct (paper Fig. 2)",
                              zero_line=True)


def carry_over(table: dict[str, Any], previous: dict[str, Any], runs: dict) -> list[str]:
    """Completes `table` from `previous` (the report already in --results) for the arms with no run under --root:
    their rows, their critic stages, and the run's counts beside their independent evaluations; each carried row
    keeps `carried_from`, the provenance of the report that read its run. Rows follow `ARMS`; the seed summary is
    redone over all of them. Returns the carried arms."""
    old_arms = previous.get("arms", {})
    carried = [a for a in ARMS if a in old_arms and a not in runs]
    origin = previous.get("provenance")
    for arm in carried:
        table["arms"][arm] = {**old_arms[arm], "carried_from": old_arms[arm].get("carried_from") or origin}
    table["arms"] = {a: table["arms"][a] for a in ARMS if a in table["arms"]}
    table["seeds"] = seed_summary(table["arms"])
    for stage in sorted({CRITIC_STAGES[a] for a in carried if a in CRITIC_STAGES}):
        if stage not in table["critic_stages"] and stage in previous.get("critic_stages", {}):
            table["critic_stages"][stage] = previous["critic_stages"][stage]
    table["critic_stages"] = dict(sorted(table["critic_stages"].items()))
    for name, entry in table["independent"].items():
        old = previous.get("independent", {}).get(name)
        if name in carried and old and old["num"] == entry["num"]:
            entry.update(logged_step=old["logged_step"], logged_correct=old["logged_correct"])
    return carried


def make_report(root: pathlib.Path, results: pathlib.Path,
                learning_figure: str = LEARNING_FIGURE) -> list[pathlib.Path]:
    """The report from the runs under `root`, completed by the report already in `results` for arms whose runs are
    not here (`carry_over`). The learning figure draws runs' curves, which a carried row no longer has: with carried
    arms it is written only under another name than `LEARNING_FIGURE`, which keeps the figure of the earlier runs;
    `PROBE_FIGURE` is redrawn only while every probe's run is here."""
    runs = load_runs(root)
    if not runs:
        raise SystemExit(f"error: no run of {tuple(ARMS)} under {root}")
    results.mkdir(parents=True, exist_ok=True)
    report = results / "real_model.json"
    previous = json.loads(report.read_text()) if report.is_file() else {}
    table = report_table(runs, config_files.load("smollm2"))
    table["independent"] = independent_evaluations(runs, results, table["recipe"]["eval_prompts"])
    table["critic_stages"] = critic_stages(root, runs)
    carried = carry_over(table, previous, runs)
    js, md = plot_results.write_json_and_markdown(table, report_markdown(table), results, "real_model")
    learning = probes = None
    if learning_figure != LEARNING_FIGURE or not any(map(_in_learning_figure, carried)):
        learning = plot_learning({a: r for a, r in runs.items() if _in_learning_figure(a)}, results / learning_figure)
    else:
        print(f"[real_model_report] {LEARNING_FIGURE} kept: {', '.join(carried)} have no run under {root}; "
              "--learning-figure NAME draws the runs here")
    if not any(map(_is_probe, carried)):
        probes = plot_learning({a: r for a, r in runs.items() if _is_probe(a)}, results / PROBE_FIGURE,
                               "SmolLM2-135M-Instruct: probes of the recipe (seed 0), each beside its control")
    figs = (learning, probes, plot_value_by_position(table, results / "fig_real_model_value_by_position.png"))
    return [p for p in (*figs, js, md) if p is not None]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", default="runs/smollm2", help="the runs' parent directory (configs/smollm2.py ROOT)")
    parser.add_argument("--results", default=str(pathlib.Path(__file__).resolve().parent / "results" / "real_model"))
    parser.add_argument("--learning-figure", default=LEARNING_FIGURE,
                        help="file name of the learning figure (runs under --root only; see make_report)")
    args = parser.parse_args()
    for path in make_report(pathlib.Path(args.root), pathlib.Path(args.results), args.learning_figure):
        print(path)


if __name__ == "__main__":
    main()
