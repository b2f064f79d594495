"""Figures and results table of the reproduction study (`experiments/reproduce.py`), from its metrics tree.

Reads `<out>/seed<k>/<run>/metrics.jsonl` (run = a method of `METHODS`, or the `value_pretrain` stage) through
`vcppo_jax.metrics.read_metrics` and writes to `--results` (default `experiments/results/`):

  fig1_length_accuracy.png          response length and test pass@1 vs RL step, mean +- std over seeds (paper Fig. 1)
  fig4_lambda_actor_sweep.png       the same for the lambda_actor sweep (paper Table 4 runs)
  fig2_value_advantage_by_position.png  mean value / advantage per token-position bucket at the first RL step,
                                    PPO baseline vs VC-PPO (paper Fig. 2)
  fig2b_critic_diagnostics.png      early-token advantage bias and the critic's explained variance (on each fresh
                                    batch, before the update) vs RL step, for the methods with a critic
  fig6_value_pretraining.png        value-pretraining loss and explained variance vs step (paper Fig. 6)
  results.md, results.json          final eval pass@1 and response length, sampled accuracy over the last
                                    `LAST_STEPS` RL steps, per method (mean +- std over seeds), beside the paper's
                                    Tables 1, 2 and 4 (Qwen2.5-32B, AIME) -- different scale; and the critic at the
                                    first RL step (value at the first tokens, early-token advantage bias, explained
                                    variance)

`make_learning_report` (`reproduce.py --learning`) writes learning.json / .md and fig_learning.png;
`make_mechanism_report` (`reproduce.py --mechanism`) writes mechanism.json / .md (per arm and seed: greedy pass@1,
length and direct-answer fraction at step 0 and at the last evaluation, the initial critic's error against the
Monte-Carlo return, the collapse signal) and fig_mechanism*.png (length, accuracy and the collapse signal per arm;
the lambda_actor sweep; critic error by position and over RL steps; the initial-bias map; value pretraining).

  python experiments/plot_results.py --out runs/reproduce [--results experiments/results]
  python experiments/plot_results.py --out runs/mechanism --report mechanism

Std is the sample std over seeds (ddof=1); with a single seed it is reported as 0 / null.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import pathlib
import re
import sys
import warnings
from typing import Any, Sequence

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np


from vcppo_jax.metrics import (COLLAPSE_CORR, COLLAPSE_VALUE_ERR, COLLAPSE_WINDOW, METRICS_FILE,
                               read_metrics)

import provenance

Records = list[dict[str, Any]]
Tree = dict[str, dict[int, Records]]  # run name -> seed -> metrics records (sorted by step)

# Method name -> label, in display order. `vcppo` (lambda_actor 0.95) is also the sweep's 0.95 point.
METHODS = {
    "ppo": "PPO (lambda 0.95, critic from reward model)",
    "vcppo": "VC-PPO (value pretraining, lambda_actor 0.95 / lambda_critic 1.0)",
    "vcppo_no_vpt": "VC-PPO w/o value pretraining (critic from actor)",
    "vcppo_no_dgae": "VC-PPO w/o decoupled GAE (lambda 0.95 / 0.95)",
    "grpo": "GRPO (group of 8, no critic)",
    "vcppo_la0.9": "VC-PPO lambda_actor 0.9",
    "vcppo_la0.99": "VC-PPO lambda_actor 0.99",
    "vcppo_la1.0": "VC-PPO lambda_actor 1.0",
}
FIG1_METHODS = ("ppo", "vcppo", "vcppo_no_vpt", "vcppo_no_dgae", "grpo")
SWEEP = {"vcppo_la0.9": 0.9, "vcppo": 0.95, "vcppo_la0.99": 0.99, "vcppo_la1.0": 1.0}
FIG2_METHODS = ("ppo", "vcppo")
CRITIC_METHODS = ("ppo", "vcppo", "vcppo_no_vpt", "vcppo_no_dgae")
STEP1_KEYS = ("rollout/reward_mean", "diag/value_pos00", "diag/adv_pos00", "diag/adv_early_bias",
              "value/explained_var_old")
SMOOTH = 5  # trailing window (RL steps) for the per-step training curves; evaluations are drawn as they are
LAST_STEPS = 10  # sampled accuracy is averaged over this many final RL steps (32 samples each): less noisy than
# the final greedy pass@1 on 64 test prompts, where one prompt is 1.6 points.
VALUE_STAGE = "value_pretrain"

# The paper's AIME 2024 pass@1 (%) for Qwen2.5-32B (arXiv 2503.01491): Table 1 (main), Table 2 (ablation),
# Table 4 (lambda_actor sweep, lambda_critic = 1). Not comparable in scale with ours.
PAPER = {
    "ppo": {"Table 2": 5.6},
    "vcppo": {"Table 1": 48.8, "Table 2": 41.9, "Table 4": 41.3},
    "vcppo_no_dgae": {"Table 2": 29.4},
    "grpo": {"Table 1": 38.9},
    "vcppo_la0.9": {"Table 4": 34.3},
    "vcppo_la0.99": {"Table 4": 41.9},
    "vcppo_la1.0": {"Table 4": 29.4},
}
PAPER_NOTE = ("The paper's numbers are AIME 2024 pass@1 (%) of Qwen2.5-32B with a 16K context; ours "
              "are greedy pass@1 (%) on the synthetic addition task's test split of a tiny from-scratch model on "
              "2 CPU cores. Compare orderings, not values. The paper's 'w/o decoupled GAE' (29.4) equals its "
              "lambda_actor = 1.0 row, i.e. one lambda = 1.0 for both; our `vcppo_no_dgae` uses one lambda = 0.95 "
              "(issue 6), and `vcppo_la1.0` is the one-lambda-1.0 run.")
_SEED_DIR = re.compile(r"^seed(\d+)$")


# ----------------------------------------------------------------------------------------------------------------
# Reading and reducing.
# ----------------------------------------------------------------------------------------------------------------


def load_tree(out_dir: str | pathlib.Path) -> Tree:
    """{run: {seed: records}} for every `<out>/seed<k>/<run>/metrics.jsonl`."""
    tree: Tree = {}
    for seed_dir in sorted(pathlib.Path(out_dir).iterdir()) if pathlib.Path(out_dir).is_dir() else []:
        match = _SEED_DIR.match(seed_dir.name)
        if not match or not seed_dir.is_dir():
            continue
        for run_dir in sorted(seed_dir.iterdir()):
            if (run_dir / METRICS_FILE).is_file():
                tree.setdefault(run_dir.name, {})[int(match.group(1))] = read_metrics(run_dir)
    return tree


def series(records: Records, key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [n], values [n]) of the records holding a finite `key`."""
    pts = [(r["step"], r[key]) for r in records if r.get(key) is not None and math.isfinite(r[key])]
    return np.array([p[0] for p in pts], np.int64), np.array([p[1] for p in pts], np.float64)


def _std(x: np.ndarray) -> float:
    return float(np.std(x, ddof=1)) if x.size > 1 else 0.0


def seed_band(runs: dict[int, Records], key: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(steps [n], mean [n], std [n]) over seeds at every step some seed logged `key`."""
    per_step: dict[int, list[float]] = {}
    for records in runs.values():
        for s, v in zip(*series(records, key)):
            per_step.setdefault(int(s), []).append(float(v))
    steps = np.array(sorted(per_step), np.int64)
    vals = [np.array(per_step[s]) for s in steps]
    return steps, np.array([v.mean() for v in vals]), np.array([_std(v) for v in vals])


def final_value(records: Records, key: str) -> tuple[int, float] | None:
    """(step, value) of the last record holding `key`."""
    steps, values = series(records, key)
    return (int(steps[-1]), float(values[-1])) if steps.size else None


def first_value(records: Records, key: str) -> tuple[int, float] | None:
    steps, values = series(records, key)
    return (int(steps[0]), float(values[0])) if steps.size else None


def steps_mean(records: Records, key: str, n: int | None = None, *, last: bool = True) -> float | None:
    """Mean of `key` over the last (or first) `n` steps that logged it; n=None: over all of them."""
    _, values = series(records, key)
    if n is not None:
        values = values[-n:] if last else values[:n]
    return float(values.mean()) if values.size else None


def _first_rl_record(records: Records, key: str) -> dict[str, Any] | None:
    """The first record at an RL step (>= 1) that logged `key`: step 1's, computed by the initial critic on the
    first rollout, unless that step's record was replaced (read_metrics keeps one record per step)."""
    return next((r for r in records if r["step"] >= 1 and r.get(key) is not None), None)


def at_first_rl_step(records: Records, key: str) -> float | None:
    """`key` at the first RL step (step 1: computed by the initial critic on the first rollout)."""
    first = _first_rl_record(records, key)
    return None if first is None else float(first[key])


def _bucket_empty(record: dict[str, Any], i: int) -> bool:
    """Whether position bucket i held no response token. Runs that log `diag/tokens_posNN` say so; older runs
    only log means, where an empty bucket reads as exactly 0 advantage (a non-empty one essentially never does)."""
    count = record.get(f"diag/tokens_pos{i:02d}")
    return count == 0 if count is not None else record.get(f"diag/adv_pos{i:02d}") == 0.0


def position_profile(runs: dict[int, Records], prefix: str) -> tuple[np.ndarray, np.ndarray]:
    """Mean and std over seeds of `<prefix>NN` (NN = bucket) at each seed's first RL step (the first record with
    `<prefix>00` at step >= 1, i.e. computed by the initial critic), over the seeds whose responses reach bucket NN
    (NaN where none does). Returns (mean [buckets], std [buckets])."""
    profiles = []
    for records in runs.values():
        first = _first_rl_record(records, f"{prefix}00")
        if first is None:
            continue
        n = len([k for k in first if re.fullmatch(re.escape(prefix) + r"\d+", k)])
        profiles.append([np.nan if _bucket_empty(first, i) else first[f"{prefix}{i:02d}"] for i in range(n)])
    if not profiles or len({len(p) for p in profiles}) != 1:
        return np.zeros(0), np.zeros(0)
    arr = np.array(profiles, np.float64)
    seen = np.isfinite(arr).sum(0)
    with warnings.catch_warnings():  # all-NaN buckets (past every response) stay NaN: matplotlib leaves a gap.
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(arr, 0)
        std = np.where(seen > 1, np.nanstd(arr, 0, ddof=1), 0.0)
    return mean, std


def _stats(values: Sequence[float]) -> dict[str, Any]:
    arr = np.array(values, np.float64)
    return {"mean": float(arr.mean()), "std": _std(arr) if arr.size > 1 else None, "n": int(arr.size),
            "per_seed": [float(v) for v in arr]}


def _over_seeds(runs: dict[int, Records], fn) -> dict[str, Any] | None:
    values = [v for v in (fn(records) for records in runs.values()) if v is not None]
    return _stats(values) if values else None


def results_table(tree: Tree) -> dict[str, Any]:
    """Per method: final (last evaluated step) eval/pass@1 and eval/response_length_mean over seeds, pass@1 at
    step 0 (the SFT policy), sampled accuracy over the last `LAST_STEPS` RL steps, and (methods with a critic) the
    initial critic's diagnostics at step 1, with the paper's numbers beside them."""
    ours = {}
    for method in METHODS:
        runs = tree.get(method, {})
        row: dict[str, Any] = {"label": METHODS[method], "seeds": sorted(runs)}
        for key in ("eval/pass@1", "eval/response_length_mean"):
            finals = {seed: final_value(records, key) for seed, records in runs.items()}
            finals = {seed: f for seed, f in finals.items() if f is not None}
            if finals:
                row[key] = _stats([f[1] for f in finals.values()])
                row[key]["steps"] = [f[0] for f in finals.values()]
        starts = [f for f in (first_value(r, "eval/pass@1") for r in runs.values()) if f is not None and f[0] == 0]
        if starts:
            row["eval/pass@1_step0"] = _stats([f[1] for f in starts])
        cells = {f"{key}_{part}{LAST_STEPS}": functools.partial(steps_mean, key=key, n=LAST_STEPS, last=last)
                 for key in ("rollout/accuracy", "rollout/response_length_mean")
                 for part, last in (("first", False), ("last", True))}
        cells.update({f"{key}_mean": functools.partial(steps_mean, key=key)
                      for key in ("policy/approx_kl", "policy/clipfrac")})
        if method in CRITIC_METHODS:
            cells.update({f"step1/{key}": functools.partial(at_first_rl_step, key=key) for key in STEP1_KEYS})
        for name, fn in cells.items():
            stats = _over_seeds(runs, fn)
            if stats is not None:
                row[name] = stats
        if len(row) > 2:
            ours[method] = row
    return {"ours": ours, "paper": PAPER, "note": PAPER_NOTE,
            "columns": {"ours": "greedy pass@1 on the test split (a fraction here, % in results.md) and mean "
                                "response length (tokens) at the last evaluation, sampled accuracy of the "
                                f"training rollouts over the last {LAST_STEPS} RL steps, tiny model, synthetic "
                                "task, mean and sample std over seeds",
                        "paper": "AIME 2024 pass@1 (%), Qwen2.5-32B",
                        "step1": "The initial critic on the first RL rollout: the mean reward (with gamma = 1 and "
                                 "the reward at the last token, this is the Monte-Carlo return of every token: "
                                 "what a calibrated critic predicts on average), mean value and mean advantage "
                                 "(before whitening) over the first token-position bucket, early-token advantage "
                                 "bias (mean advantage of each response's first tokens minus the rest), explained "
                                 "variance of the values w.r.t. the critic's own targets (GAE(lambda_critic) "
                                 "returns: Monte-Carlo returns when lambda_critic = 1, partly bootstrapped on the "
                                 "critic itself when it is 0.95)"}}


def _fmt(stats: dict | None, scale: float = 1.0, digits: int = 1) -> str:
    if not stats:
        return "-"
    text = f"{stats['mean'] * scale:.{digits}f}"
    return text + (f" ± {stats['std'] * scale:.{digits}f}" if stats["std"] is not None else " (1 seed)")


def table_markdown(table: dict[str, Any]) -> str:
    lines = ["# Results: ours (tiny model, synthetic task) vs the paper (Qwen2.5-32B, AIME)", "",
             f"Ours: {table['columns']['ours']}. Paper: {table['columns']['paper']}.", "",
             "| method | seeds | final step | ours: pass@1 (%) | ours: response length | ours: pass@1 at step 0 (%) "
             f"| ours: sampled accuracy, last {LAST_STEPS} steps (%) | paper: AIME pass@1 (%, 32B) |",
             "|---|---|---|---|---|---|---|---|"]
    for method, label in METHODS.items():
        row = table["ours"].get(method)
        paper = " · ".join(f"{t} {v:.1f}" for t, v in table["paper"].get(method, {}).items()) or "-"
        if row is None:
            lines.append(f"| {label} | 0 | - | - | - | - | - | {paper} |")
            continue
        steps = sorted(set(row.get("eval/pass@1", {}).get("steps", [])))
        step_text = "-" if not steps else str(steps[0]) if len(steps) == 1 else f"{steps[0]}-{steps[-1]}"
        lines.append(f"| {label} | {len(row['seeds'])} | {step_text} | {_fmt(row.get('eval/pass@1'), 100)} | "
                     f"{_fmt(row.get('eval/response_length_mean'))} | "
                     f"{_fmt(row.get('eval/pass@1_step0'), 100)} | "
                     f"{_fmt(row.get(f'rollout/accuracy_last{LAST_STEPS}'), 100)} | {paper} |")
    lines += ["", table["note"], "",
              "## The critic at the first RL step", "", table["columns"]["step1"] + ".", "",
              "| method | mean reward | value, first bucket | advantage, first bucket | early-token advantage bias "
              "| explained variance |", "|---|---|---|---|---|---|"]
    for method in CRITIC_METHODS:
        row = table["ours"].get(method, {})
        cells = [_fmt(row.get(f"step1/{k}"), digits=3) for k in STEP1_KEYS]
        lines.append(f"| {METHODS[method]} | " + " | ".join(cells) + " |")
    n = LAST_STEPS
    lines += ["", "## How far RL moved the policy", "",
              f"Training rollouts: sampled accuracy and mean response length over the first and the last {n} RL "
              "steps; PPO-ratio statistics of the actor updates, averaged over all steps.", "",
              f"| method | sampled accuracy, first {n} -> last {n} steps (%) | response length, first {n} -> last {n} "
              "steps | approx. KL per update | clip fraction (%) |", "|---|---|---|---|---|"]
    for method, label in METHODS.items():
        row = table["ours"].get(method, {})
        acc = " -> ".join(_fmt(row.get(f"rollout/accuracy_{p}{n}"), 100) for p in ("first", "last"))
        length = " -> ".join(_fmt(row.get(f"rollout/response_length_mean_{p}{n}")) for p in ("first", "last"))
        kl = row.get("policy/approx_kl_mean")
        kl_text = "-" if not kl else f"{kl['mean']:.1e}" + (f" ± {kl['std']:.1e}" if kl["std"] is not None else "")
        lines.append(f"| {label} | {acc} | {length} | {kl_text} | {_fmt(row.get('policy/clipfrac_mean'), 100, 2)} |")
    return "\n".join(lines + [""])


def write_table(table: dict[str, Any], results_dir: pathlib.Path) -> list[pathlib.Path]:
    md, js = results_dir / "results.md", results_dir / "results.json"
    md.write_text(table_markdown(table))
    js.write_text(json.dumps(table, indent=2) + "\n")
    return [md, js]


# ----------------------------------------------------------------------------------------------------------------
# Figures.
# ----------------------------------------------------------------------------------------------------------------


def _color(method: str) -> str:
    return f"C{list(METHODS).index(method) % 10}" if method in METHODS else "k"


def trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    """y[t] = mean(x[max(0, t - window + 1) : t + 1]): smooths per-step noise, keeps the first point as is."""
    c = np.cumsum(np.concatenate([[0.0], x]))
    t = np.arange(1, x.size + 1)
    return (c[t] - c[np.maximum(t - window, 0)]) / np.minimum(t, window)


def _band(ax, runs: dict[int, Records], key: str, label: str, color: str, smooth: int = 1) -> bool:
    steps, mean, std = seed_band(runs, key)
    if not steps.size:
        return False
    if smooth > 1:
        mean, std = trailing_mean(mean, smooth), trailing_mean(std, smooth)
    ax.plot(steps, mean, color=color, label=f"{label} (n={len(runs)})", marker="." if steps.size < 15 else None)
    ax.fill_between(steps, mean - std, mean + std, color=color, alpha=0.2, linewidth=0)
    return True


def _save(fig, axes, path: pathlib.Path, title: str, zero_line: bool = False,
          legend_below: bool = False) -> pathlib.Path:
    for ax in axes:
        if zero_line:
            ax.axhline(0.0, color="k", lw=0.5)
        ax.grid(alpha=0.3)
    if legend_below:  # many long labels: one legend under the panels instead of over one of them
        handles, labels = axes[0].get_legend_handles_labels()
        fig.legend(handles, labels, loc="lower center", ncol=2, fontsize=8)
        fig.suptitle(title)
        fig.tight_layout(rect=(0, 0.04 + 0.025 * ((len(labels) + 1) // 2), 1, 1))
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path
    axes[1].legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_curves(tree: Tree, methods: dict[str, str], path: pathlib.Path, title: str) -> pathlib.Path | None:
    """Training response length and eval pass@1 vs RL step for `methods` ({name: label})."""
    present = {m: lab for m, lab in methods.items() if tree.get(m)}
    if not present:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for m, label in present.items():
        _band(axes[0], tree[m], "rollout/response_length_mean", label, _color(m), smooth=SMOOTH)
        _band(axes[1], tree[m], "eval/pass@1", label, _color(m))
    axes[0].set(xlabel="RL step", ylabel="mean response length (tokens)",
                title=f"(a) training response length ({SMOOTH}-step trailing mean)")
    axes[1].set(xlabel="RL step", ylabel="greedy pass@1 (test split)", title="(b) test accuracy")
    return _save(fig, axes, path, f"{title} -- mean ± std over seeds (tiny model, synthetic task)")


def plot_position(tree: Tree, path: pathlib.Path, response_len: int | None) -> pathlib.Path | None:
    """Mean value and mean (raw) advantage per response-position bucket at the first RL step (paper Fig. 2)."""
    drawn = False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in FIG2_METHODS:
        for ax, prefix in zip(axes, ("diag/value_pos", "diag/adv_pos")):
            mean, std = position_profile(tree.get(m, {}), prefix)
            if not mean.size:
                continue
            n = mean.size
            x = np.arange(n) * (response_len / n) if response_len else np.arange(n)
            ax.errorbar(x, mean, yerr=std, color=_color(m), marker="o", ms=3, capsize=2,
                        label=f"{METHODS[m]} (n={len(tree[m])})")
            drawn = True
    if not drawn:
        plt.close(fig)
        return None
    xlabel = "response token position (bucket start)" if response_len else "response token-position bucket"
    axes[0].set(xlabel=xlabel, ylabel="mean value V(s_t)", title="(a) initial critic's value by position")
    axes[1].set(xlabel=xlabel, ylabel="mean advantage (before whitening)", title="(b) advantage by position")
    return _save(fig, axes, path, "First RL step: value / advantage by token position (paper Fig. 2), mean ± std "
                 "over seeds", zero_line=True)


def plot_critic_diagnostics(tree: Tree, path: pathlib.Path) -> pathlib.Path | None:
    """Early-token advantage bias and the critic's explained variance on each fresh batch vs RL step."""
    present = [m for m in CRITIC_METHODS if tree.get(m)]
    if not present:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for m in present:
        _band(axes[0], tree[m], "diag/adv_early_bias", METHODS[m], _color(m), smooth=SMOOTH)
        _band(axes[1], tree[m], "value/explained_var_old", METHODS[m], _color(m), smooth=SMOOTH)
    axes[0].set(xlabel="RL step", ylabel="mean advantage: first tokens - rest",
                title=f"(a) early-token advantage bias ({SMOOTH}-step trailing mean)")
    axes[1].set_ylim(-1.0, 1.0)  # a rare batch with near-constant returns gives a large negative value
    axes[1].set(xlabel="RL step", ylabel="explained variance (before the update, axis from -1)",
                title="(b) critic explained variance on the fresh rollout")
    return _save(fig, axes, path, "Critic diagnostics during RL -- mean ± std over seeds (tiny model, synthetic task)",
                 zero_line=True)


def plot_value_pretraining(tree: Tree, path: pathlib.Path) -> pathlib.Path | None:
    runs = tree.get(VALUE_STAGE, {})
    if not runs:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    _band(axes[0], runs, "value/loss", "value pretraining", "C1")
    _band(axes[1], runs, "value/explained_var", "value pretraining", "C1")
    axes[0].set(xlabel="value-pretraining step", ylabel="value loss (fresh batch, before update)",
                title="(a) value loss")
    axes[1].set(xlabel="value-pretraining step", ylabel="explained variance", title="(b) explained variance")
    return _save(fig, axes, path, "Value pretraining on Monte-Carlo returns of the frozen SFT policy (paper Fig. 6)")


def make_report(out_dir: str | pathlib.Path, results_dir: str | pathlib.Path,
                response_len: int | None = None) -> list[pathlib.Path]:
    """Writes every figure that has data and the results table; returns the written paths. `response_len` (the
    runs' max_response_len) puts Fig. 2's x axis in tokens; by default it is read from `<out>/study.json`."""
    out_dir, results_dir = pathlib.Path(out_dir), pathlib.Path(results_dir)
    if response_len is None and (out_dir / "study.json").is_file():
        response_len = json.loads((out_dir / "study.json").read_text()).get("max_response_len")
    tree = load_tree(out_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    sweep = {m: f"lambda_actor {lam}" for m, lam in SWEEP.items() if tree.get(m)}
    written = [
        plot_curves(tree, {m: METHODS[m] for m in FIG1_METHODS}, results_dir / "fig1_length_accuracy.png",
                    "Response length and accuracy during RL (paper Fig. 1)"),
        # A sweep needs two points; a study of other methods (e.g. --only ppo,vcppo) only has vcppo's 0.95.
        plot_curves(tree, sweep, results_dir / "fig4_lambda_actor_sweep.png",
                    "VC-PPO lambda_actor sweep (paper Table 4)") if len(sweep) > 1 else None,
        plot_position(tree, results_dir / "fig2_value_advantage_by_position.png", response_len),
        plot_critic_diagnostics(tree, results_dir / "fig2b_critic_diagnostics.png"),
        plot_value_pretraining(tree, results_dir / "fig6_value_pretraining.png"),
    ]
    return [p for p in written if p is not None] + write_table(results_table(tree), results_dir)


# ----------------------------------------------------------------------------------------------------------------
# Does RL learn? (`reproduce.py --learning`)
# ----------------------------------------------------------------------------------------------------------------

LEARNING_METHODS = {"vcppo": METHODS["vcppo"], "grpo": METHODS["grpo"],
                    "grpo_shuffled": "control: GRPO on rewards shuffled across each batch",
                    "vcppo_shuffled": "control: VC-PPO on shuffled rewards (critic pretrained on true ones)"}
LEARNING_KEYS = {"pass@1": "eval/pass@1", "response_length": "eval/response_length_mean",
                 "direct_fraction": "eval/direct_fraction", "sampled_pass@1": "probe/pass@1",
                 "kl_to_sft": "probe/kl_to_sft"}


def step0_and_last(records: Records, keys: dict[str, str]) -> dict[str, Any]:
    """{name}_step0 (the evaluation at step 0, the SFT policy, if there is one) and {name}_last (the last
    evaluation) for each {name: metric key}, and last_step."""
    row: dict[str, Any] = {}
    for name, key in keys.items():
        first, last = first_value(records, key), final_value(records, key)
        if first is not None and first[0] == 0:
            row[f"{name}_step0"] = first[1]
        if last is not None:
            row[f"{name}_last"], row["last_step"] = last[1], last[0]
    return row


def learning_table(tree: Tree) -> dict[str, Any]:
    """Per method and seed: each `LEARNING_KEYS` metric at step 0 (the SFT policy) and at the last evaluation, and
    the gain in greedy pass@1; per method, the gain's mean and std over seeds."""
    methods = {}
    for method, label in LEARNING_METHODS.items():
        per_seed = {}
        for seed, records in sorted(tree.get(method, {}).items()):
            row = step0_and_last(records, LEARNING_KEYS)
            if "pass@1_step0" in row and "pass@1_last" in row:
                row["pass@1_gain"] = row["pass@1_last"] - row["pass@1_step0"]
            # The SFT run's best evaluated checkpoint (the RL start is its last one): RL must beat that too.
            sft_steps, sft_values = series(tree.get("sft", {}).get(seed, []), "eval/pass@1")
            if sft_values.size:
                best = int(np.argmax(sft_values))
                row["sft_best_pass@1"], row["sft_best_step"] = float(sft_values[best]), int(sft_steps[best])
                if "pass@1_last" in row:
                    row["pass@1_gain_over_best_sft"] = row["pass@1_last"] - row["sft_best_pass@1"]
            per_seed[str(seed)] = row
        stats = {k: _stats(v) if v else None for k in ("pass@1_gain", "pass@1_gain_over_best_sft")
                 for v in [[r[k] for r in per_seed.values() if k in r]]}
        methods[method] = {"label": label, "per_seed": per_seed, **stats}
    return {"methods": methods,
            "columns": "greedy pass@1 (fraction) and mean response length on the first eval_prompts test problems, "
                       "direct-answer fraction, and on the same prompts sampled at the training temperature: "
                       "pass@1 and the per-token KL(policy || SFT policy); at step 0 (the SFT policy) and at the "
                       "last evaluation; and the best greedy pass@1 of any evaluated SFT checkpoint (its step)"}


def learning_markdown(table: dict[str, Any]) -> str:
    lines = ["# Does RL learn? Greedy pass@1 on the test split, step 0 -> last step", "", table["columns"] + ".", "",
             "| method | seed | pass@1 step 0 (%) | pass@1 last (%) | gain (points) | best SFT checkpoint (%) "
             "| gain over it (points) | length step 0 -> last | direct answers step 0 -> last (%) "
             "| sampled pass@1 step 0 -> last (%) | KL to SFT, last |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda v: "-" if v is None else f"{100 * v:.1f}"  # noqa: E731
    for method, entry in table["methods"].items():
        for seed, r in entry["per_seed"].items():
            best_sft = f"{pct(r.get('sft_best_pass@1'))} (step {r.get('sft_best_step', '-')})"
            lines.append(f"| {entry['label']} | {seed} | {pct(r.get('pass@1_step0'))} | {pct(r.get('pass@1_last'))} "
                         f"| {pct(r.get('pass@1_gain'))} | {best_sft} | {pct(r.get('pass@1_gain_over_best_sft'))} "
                         f"| {r.get('response_length_step0', 0):.1f} -> {r.get('response_length_last', 0):.1f} "
                         f"| {pct(r.get('direct_fraction_step0'))} -> {pct(r.get('direct_fraction_last'))} "
                         f"| {pct(r.get('sampled_pass@1_step0'))} -> {pct(r.get('sampled_pass@1_last'))} "
                         f"| {r.get('kl_to_sft_last', float('nan')):.3f} |")
        lines.append(f"| **{entry['label']}** | mean | | | **{_fmt(entry['pass@1_gain'], 100)}** | "
                     f"| **{_fmt(entry['pass@1_gain_over_best_sft'], 100)}** | | | | |")
    return "\n".join(lines + [""])


def band_panels(tree: Tree, arms: dict[str, tuple[str, str]], panels: Sequence[tuple[str, int, str, str]],
                figsize: tuple[float, float]):
    """A 2x2 figure of seed bands vs RL step: one panel per (metric key, trailing-mean window, y label, title), one
    band per arm {run name: (label, color)}. Returns (fig, axes [2, 2]) for the caller to finish and save."""
    fig, axes = plt.subplots(2, 2, figsize=figsize)
    for ax, (key, smooth, ylabel, title) in zip(axes.flat, panels):
        for m, (label, color) in arms.items():
            _band(ax, tree[m], key, label, color, smooth=smooth)
        ax.set(xlabel="RL step", ylabel=ylabel, title=title)
    return fig, axes


def plot_learning(tree: Tree, path: pathlib.Path) -> pathlib.Path | None:
    """Greedy pass@1, sampled training accuracy, KL to the SFT policy and per-iteration policy movement vs step."""
    present = [m for m in LEARNING_METHODS if tree.get(m)]
    if not present:
        return None
    panels = [("eval/pass@1", 1, "greedy pass@1 (test split)", "(a) test accuracy, greedy"),
              ("rollout/accuracy", SMOOTH, "accuracy of the training rollouts",
               f"(b) sampled accuracy ({SMOOTH}-step trailing mean)"),
              ("probe/kl_to_sft", 1, "KL(policy || SFT) per token", "(c) drift from the SFT policy (probe prompts)"),
              ("policy/approx_kl", SMOOTH, "KL(before || after) per token",
               f"(d) movement per iteration ({SMOOTH}-step trailing mean)")]
    arms = {m: (LEARNING_METHODS[m], f"C{i}") for i, m in enumerate(present)}
    fig, axes = band_panels(tree, arms, panels, (12, 8))
    return _save(fig, list(axes.flat), path, "Does RL learn? mean ± std over seeds (tiny model, synthetic task)")


def write_json_and_markdown(table: dict[str, Any], markdown: str, results_dir: pathlib.Path,
                            name: str) -> tuple[pathlib.Path, pathlib.Path]:
    js, md = results_dir / f"{name}.json", results_dir / f"{name}.md"
    table = {**table, "provenance": table.get("provenance") or provenance.record()}
    js.write_text(json.dumps(table, indent=2) + "\n")
    md.write_text(markdown)
    return js, md


def make_learning_report(out_dir: str | pathlib.Path, results_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """learning.json, learning.md and fig_learning.png from a `reproduce.py --learning` tree."""
    out_dir, results_dir = pathlib.Path(out_dir), pathlib.Path(results_dir)
    tree = load_tree(out_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    table = learning_table(tree)
    js, md = write_json_and_markdown(table, learning_markdown(table), results_dir, "learning")
    fig = plot_learning(tree, results_dir / "fig_learning.png")
    return [p for p in (fig, js, md) if p is not None]


# ----------------------------------------------------------------------------------------------------------------
# The mechanism study (`reproduce.py --mechanism`).
# ----------------------------------------------------------------------------------------------------------------

MECHANISM_METHODS = {
    "ppo": "PPO 0.95/0.95, critic = pessimistic reward model (truncations labelled failures)",
    "vcppo_no_dgae": "PPO 0.95/0.95, calibrated critic (value-pretrained; = VC-PPO w/o decoupled GAE)",
    "ppo_bias+1": "PPO 0.95/0.95, calibrated critic + 1 (optimistic)",
    "ppo_bias-1": "PPO 0.95/0.95, calibrated critic - 1 (pessimistic)",
    "ppo_bias-2": "PPO 0.95/0.95, calibrated critic - 2 (pessimistic)",
    "ppo_bias-6": "PPO 0.95/0.95, calibrated critic - 6 (pessimistic)",
    "vcppo": "VC-PPO 0.95/1.0, value-pretrained critic",
    "vcppo_rm_critic": "VC-PPO 0.95/1.0 w/o value pretraining (critic = the reward model)",
    "vcppo_bias-2": "VC-PPO 0.95/1.0, calibrated critic - 2",
    "grpo": METHODS["grpo"],
    "vcppo_la0.9": METHODS["vcppo_la0.9"], "vcppo_la0.99": METHODS["vcppo_la0.99"],
    "vcppo_la1.0": METHODS["vcppo_la1.0"],
}
BIAS_MAP = {"ppo_bias-6": -6.0, "ppo_bias-2": -2.0, "ppo_bias-1": -1.0, "vcppo_no_dgae": 0.0, "ppo_bias+1": 1.0}
MECHANISM_KEYS = {"pass@1": "eval/pass@1", "response_length": "eval/response_length_mean",
                  "direct_fraction": "eval/direct_fraction"}
# Read at the first RL step (the initial critic on the first rollout) and averaged over the first steps.
EARLY_STEPS = 5


def first_sustained_step(records: Records, keys: Sequence[str], window: int, condition) -> int | None:
    """The first RL step at which `condition(*values of keys)` held for `window` consecutive steps that logged all
    `keys` (when a warning with that rule would be printed), or None."""
    run = 0
    for r in records:
        values = [r.get(k) for k in keys]
        if any(v is None for v in values):
            continue
        run = run + 1 if condition(*values) else 0
        if run >= window:
            return int(r["step"])
    return None


def mechanism_table(tree: Tree) -> dict[str, Any]:
    """Per arm and seed: greedy pass@1, mean response length and direct-answer fraction at step 0 (the SFT policy)
    and at the last evaluation; the initial critic's error against the Monte-Carlo return at the first token and
    over the response (step 1); the advantage-length correlation over the first `EARLY_STEPS` steps; the sampled
    response length over the first and last `EARLY_STEPS` steps. Per arm: mean and std over seeds."""
    arms = {}
    for method, label in MECHANISM_METHODS.items():
        per_seed = {}
        for seed, records in sorted(tree.get(method, {}).items()):
            row = step0_and_last(records, MECHANISM_KEYS)
            # Every evaluation: a collapse can be transient (the critic recalibrates), so the path matters.
            row["evals"] = {str(r["step"]): {name: r[key] for name, key in MECHANISM_KEYS.items() if key in r}
                            for r in records if "eval/pass@1" in r}
            row["value_err_first_step1"] = at_first_rl_step(records, "diag/value_err_first")
            row["value_step1_first"] = at_first_rl_step(records, "diag/value_pos00")
            row["reward_mean_step1"] = at_first_rl_step(records, "rollout/reward_mean")
            row["warning_step"] = first_sustained_step(
                records, ("diag/adv_length_corr", "diag/value_err_first"), COLLAPSE_WINDOW,
                lambda corr, err: corr < COLLAPSE_CORR and err < COLLAPSE_VALUE_ERR)
            # Each signal alone (the rule's threshold for 3 steps): why the warning needs both.
            row["corr_only_warning_step"] = first_sustained_step(records, ("diag/adv_length_corr",), COLLAPSE_WINDOW,
                                                                 lambda corr: corr < COLLAPSE_CORR)
            # The rule the project used before (early-token advantage bias > 0.3 for 5 steps), for comparison.
            row["early_bias_warning_step"] = first_sustained_step(records, ("diag/adv_early_bias",), 5,
                                                                  lambda bias: bias > 0.3)
            row["adv_length_corr_first"] = steps_mean(records, "diag/adv_length_corr", EARLY_STEPS, last=False)
            row["adv_early_bias_first"] = steps_mean(records, "diag/adv_early_bias", EARLY_STEPS, last=False)
            row["sampled_length_first"] = steps_mean(records, "rollout/response_length_mean", EARLY_STEPS, last=False)
            row["sampled_length_last"] = steps_mean(records, "rollout/response_length_mean", EARLY_STEPS)
            per_seed[str(seed)] = {k: v for k, v in row.items() if v is not None}
        if not per_seed:
            continue
        keys = sorted({k for r in per_seed.values() for k in r if k not in ("last_step", "evals")})
        steps = sorted({int(st) for r in per_seed.values() for st in r["evals"]})
        eval_means = {str(st): {name: float(np.mean(v)) for name in MECHANISM_KEYS
                                for v in [[r["evals"][str(st)][name] for r in per_seed.values()
                                           if name in r["evals"].get(str(st), {})]] if v}
                      for st in steps}
        arms[method] = {"label": label, "per_seed": per_seed, "eval_means": eval_means,
                        "mean": {k: _stats([r[k] for r in per_seed.values() if k in r]) for k in keys}}
    return {"arms": arms, "paper": {m: PAPER[m] for m in PAPER if m in MECHANISM_METHODS}, "note": PAPER_NOTE,
            "columns": "greedy pass@1 (fraction), mean response length (tokens) and direct-answer fraction on the "
                       "first eval_prompts test problems at step 0 (the SFT policy) and at the last evaluation; "
                       "value_err_first_step1: the initial critic's value minus the Monte-Carlo return at each "
                       "response's first token on the first rollout (< 0: pessimistic); adv_length_corr_first: "
                       f"the within-outcome correlation of first-token advantage and length over the first "
                       f"{EARLY_STEPS} steps (< 0: the advantages favour short responses); sampled_length_first / "
                       f"_last: training-rollout length over the first / last {EARLY_STEPS} steps; warning_step: the "
                       f"step at which the collapse warning fires (adv_length_corr < {COLLAPSE_CORR} and "
                       f"value_err_first < {COLLAPSE_VALUE_ERR} for {COLLAPSE_WINDOW} steps in a row), "
                       "corr_only_warning_step: when the correlation alone would have, early_bias_warning_step: "
                       "when the earlier rule (early-token advantage bias > 0.3 for 5 steps) would have; absent: "
                       "never"}


def mechanism_markdown(table: dict[str, Any]) -> str:
    lines = ["# The mechanism study: arms, step 0 -> last evaluation (mean ± std over seeds)", "",
             table["columns"] + ".", "",
             "| arm | seeds | greedy pass@1 (%) | greedy length | direct answers (%) | sampled length "
             "| critic error at token 0, step 1 | adv-length corr, first steps | collapse warning at step (per seed) "
             "| correlation alone | old early-bias rule | paper (AIME %, 32B) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    path = ["", "## Every evaluation (mean over seeds)", "",
            "| arm | steps | greedy pass@1 (%) | greedy length | direct answers (%) |", "|---|---|---|---|---|"]
    for method, entry in table["arms"].items():
        m = entry["mean"]
        arrow = lambda name, scale=1.0, d=1: (f"{_fmt(m.get(name + '_step0'), scale, d)} -> "  # noqa: E731
                                              f"{_fmt(m.get(name + '_last'), scale, d)}")
        paper = " · ".join(f"{t} {v:.1f}" for t, v in table["paper"].get(method, {}).items()) or "-"
        warned = lambda name: " · ".join(str(r.get(name, "never")) for r in entry["per_seed"].values())  # noqa: E731
        lines.append(f"| {entry['label']} | {len(entry['per_seed'])} | {arrow('pass@1', 100)} "
                     f"| {arrow('response_length')} | {arrow('direct_fraction', 100, 0)} "
                     f"| {_fmt(m.get('sampled_length_first'))} -> {_fmt(m.get('sampled_length_last'))} "
                     f"| {_fmt(m.get('value_err_first_step1'), digits=2)} "
                     f"| {_fmt(m.get('adv_length_corr_first'), digits=2)} "
                     f"| {warned('warning_step')} | {warned('corr_only_warning_step')} "
                     f"| {warned('early_bias_warning_step')} | {paper} |")
        means = entry["eval_means"]
        cells = lambda name, scale, d: " · ".join(  # noqa: E731
            f"{v[name] * scale:.{d}f}" if name in v else "-" for v in means.values())
        path.append(f"| {entry['label']} | {' · '.join(means)} | {cells('pass@1', 100, 1)} "
                    f"| {cells('response_length', 1, 1)} | {cells('direct_fraction', 100, 0)} |")
    return "\n".join(lines + path + ["", table["note"], ""])


def _arm_color(method: str) -> str:
    return f"C{list(MECHANISM_METHODS).index(method) % 10}"


def plot_mechanism(tree: Tree, path: pathlib.Path, methods: Sequence[str], title: str) -> pathlib.Path | None:
    """Greedy length, greedy pass@1, sampled length and the advantage-length correlation vs RL step."""
    present = [m for m in methods if tree.get(m)]
    if not present:
        return None
    panels = [("eval/response_length_mean", 1, "tokens", "(a) greedy response length (test prompts)"),
              ("eval/pass@1", 1, "greedy pass@1", "(b) test accuracy, greedy"),
              ("rollout/response_length_mean", SMOOTH, "tokens",
               f"(c) sampled length of the training rollouts ({SMOOTH}-step trailing mean)"),
              ("diag/adv_length_corr", SMOOTH, "correlation",
               f"(d) first-token advantage vs length, within outcome ({SMOOTH}-step mean)")]
    arms = {m: (MECHANISM_METHODS[m], _arm_color(m)) for m in present}
    fig, axes = band_panels(tree, arms, panels, (13, 9.5))
    axes[1, 1].axhline(0.0, color="k", lw=0.5)
    return _save(fig, list(axes.flat), path, f"{title} -- mean ± std over seeds (tiny model, synthetic task)",
                 legend_below=True)


def plot_critic_error(tree: Tree, path: pathlib.Path, response_len: int | None) -> pathlib.Path | None:
    """(a) the initial critic's value minus the Monte-Carlo return by position at step 1 (paper Fig. 2, as an
    error); (b) the error at the first token over RL steps: how fast each critic calibrates."""
    present = [m for m in MECHANISM_METHODS if tree.get(m) and m not in ("grpo",) and not m.startswith("vcppo_la")]
    if not present:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(13, 6))
    for m in present:
        mean, std = position_profile(tree[m], "diag/value_err_pos")
        if mean.size:
            x = np.arange(mean.size) * (response_len / mean.size) if response_len else np.arange(mean.size)
            axes[0].errorbar(x, mean, yerr=std, color=_arm_color(m), marker="o", ms=3, capsize=2,
                             label=MECHANISM_METHODS[m])
        _band(axes[1], tree[m], "diag/value_err_first", MECHANISM_METHODS[m], _arm_color(m), smooth=SMOOTH)
    axes[0].set(xlabel="response token position (bucket start)" if response_len else "position bucket",
                ylabel="V(s_t) - Monte-Carlo return",
                title="(a) initial critic error by position, step 1 (arms from one critic overlap)")
    axes[1].set(xlabel="RL step", ylabel="V(s_0) - Monte-Carlo return",
                title=f"(b) critic error at the first token during RL ({SMOOTH}-step mean)")
    return _save(fig, list(axes), path, "Critic calibration against the Monte-Carlo return", zero_line=True,
                 legend_below=True)


def plot_bias_map(table: dict[str, Any], path: pathlib.Path, mid_step: int = 20) -> pathlib.Path | None:
    """Change in greedy response length and pass@1 from step 0 vs PPO's initial critic bias, at `mid_step` (where
    a collapse shows: the critic has not yet recalibrated) and at the last evaluation."""
    pts = [(bias, table["arms"][m]["per_seed"]) for m, bias in BIAS_MAP.items() if m in table["arms"]]
    if len(pts) < 2:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2))
    for ax, name, ylabel in ((axes[0], "response_length", "greedy length - step 0 (tokens)"),
                             (axes[1], "pass@1", "greedy pass@1 - step 0")):
        for j, (when, color, dx) in enumerate(((str(mid_step), "C3", -0.06), ("last", "C0", 0.06))):
            for i, (bias, per_seed) in enumerate(pts):
                d = []
                for r in per_seed.values():
                    at = r["evals"].get(when, {}) if when != "last" else {name: r.get(f"{name}_last")}
                    if at.get(name) is not None and f"{name}_step0" in r:
                        d.append(at[name] - r[f"{name}_step0"])
                label = (f"step {when}" if when != "last" else "last evaluation") if i == 0 else None
                ax.scatter([bias + dx] * len(d), d, color=color, s=18, label=label)
                if d:
                    ax.scatter([bias + dx], [np.mean(d)], color=color, marker="_", s=400)
        ax.set(xlabel="initial critic bias (added to the value-pretrained critic)", ylabel=ylabel, title=ylabel)
    return _save(fig, list(axes), path, "PPO (lambda 0.95/0.95): the initial critic bias map (dots: seeds, bars: "
                 "means)", zero_line=True)


def make_mechanism_report(out_dir: str | pathlib.Path, results_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """mechanism.json, mechanism.md and the mechanism figures from a `reproduce.py --mechanism` tree."""
    out_dir, results_dir = pathlib.Path(out_dir), pathlib.Path(results_dir)
    response_len = None
    if (out_dir / "study.json").is_file():
        response_len = json.loads((out_dir / "study.json").read_text()).get("max_response_len")
    tree = load_tree(out_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    table = mechanism_table(tree)
    js, md = write_json_and_markdown(table, mechanism_markdown(table), results_dir, "mechanism")
    sweep = ("vcppo_la0.9", "vcppo", "vcppo_la0.99", "vcppo_la1.0")
    written = [
        plot_mechanism(tree, results_dir / "fig_mechanism.png",
                       ("ppo", "ppo_bias-6", "ppo_bias-2", "vcppo_no_dgae", "ppo_bias+1", "vcppo", "vcppo_rm_critic",
                        "vcppo_bias-2", "grpo"), "Length, accuracy and the collapse signal per critic (paper Fig. 1)"),
        plot_mechanism(tree, results_dir / "fig_mechanism_lambda_actor.png", sweep,
                       "VC-PPO lambda_actor sweep (paper Table 4)") if sum(bool(tree.get(m)) for m in sweep) > 1
        else None,
        plot_critic_error(tree, results_dir / "fig_mechanism_critic_error.png", response_len),
        plot_bias_map(table, results_dir / "fig_mechanism_bias_map.png"),
        plot_value_pretraining(tree, results_dir / "fig_mechanism_value_pretraining.png"),
    ]
    return [p for p in written if p is not None] + [js, md]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/reproduce", help="the study's run directory")
    parser.add_argument("--results", default=str(pathlib.Path(__file__).resolve().parent / "results"),
                        help="where figures and tables go")
    reports = {"study": make_report, "learning": make_learning_report, "mechanism": make_mechanism_report}
    parser.add_argument("--report", default="study", choices=tuple(reports),
                        help="which study's figures and tables (reproduce.py's default, --learning, --mechanism)")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.out).is_dir():
        sys.exit(f"error: --out={args.out!r} is not a directory")
    for path in reports[args.report](args.out, args.results):
        print(path)


if __name__ == "__main__":
    main()
