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

  python experiments/plot_results.py --out runs/reproduce [--results experiments/results]

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
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from vcppo_jax.metrics import METRICS_FILE, read_metrics  # noqa: E402

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


def _save(fig, axes, path: pathlib.Path, title: str, zero_line: bool = False) -> pathlib.Path:
    for ax in axes:
        if zero_line:
            ax.axhline(0.0, color="k", lw=0.5)
        ax.grid(alpha=0.3)
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


def learning_table(tree: Tree) -> dict[str, Any]:
    """Per method and seed: each `LEARNING_KEYS` metric at step 0 (the SFT policy) and at the last evaluation, and
    the gain in greedy pass@1; per method, the gain's mean and std over seeds."""
    methods = {}
    for method, label in LEARNING_METHODS.items():
        per_seed = {}
        for seed, records in sorted(tree.get(method, {}).items()):
            row: dict[str, Any] = {}
            for name, key in LEARNING_KEYS.items():
                first, last = first_value(records, key), final_value(records, key)
                if first is not None and first[0] == 0:
                    row[f"{name}_step0"] = first[1]
                if last is not None:
                    row[f"{name}_last"], row["last_step"] = last[1], last[0]
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


def plot_learning(tree: Tree, path: pathlib.Path) -> pathlib.Path | None:
    """Greedy pass@1, sampled training accuracy, KL to the SFT policy and per-iteration policy movement vs step."""
    present = {m: lab for m, lab in LEARNING_METHODS.items() if tree.get(m)}
    if not present:
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    panels = [("eval/pass@1", 1, "greedy pass@1 (test split)", "(a) test accuracy, greedy"),
              ("rollout/accuracy", SMOOTH, "accuracy of the training rollouts",
               f"(b) sampled accuracy ({SMOOTH}-step trailing mean)"),
              ("probe/kl_to_sft", 1, "KL(policy || SFT) per token", "(c) drift from the SFT policy (probe prompts)"),
              ("policy/approx_kl", SMOOTH, "KL(before || after) per token",
               f"(d) movement per iteration ({SMOOTH}-step trailing mean)")]
    for ax, (key, smooth, ylabel, title) in zip(axes.flat, panels):
        for i, (m, label) in enumerate(present.items()):
            _band(ax, tree[m], key, label, f"C{i}", smooth=smooth)
        ax.set(xlabel="RL step", ylabel=ylabel, title=title)
    return _save(fig, list(axes.flat), path, "Does RL learn? mean ± std over seeds (tiny model, synthetic task)")


def make_learning_report(out_dir: str | pathlib.Path, results_dir: str | pathlib.Path) -> list[pathlib.Path]:
    """learning.json, learning.md and fig_learning.png from a `reproduce.py --learning` tree."""
    out_dir, results_dir = pathlib.Path(out_dir), pathlib.Path(results_dir)
    tree = load_tree(out_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    table = learning_table(tree)
    js, md = results_dir / "learning.json", results_dir / "learning.md"
    js.write_text(json.dumps(table, indent=2) + "\n")
    md.write_text(learning_markdown(table))
    fig = plot_learning(tree, results_dir / "fig_learning.png")
    return [p for p in (fig, js, md) if p is not None]


def make_runs_report(runs: dict[str, str | pathlib.Path], results_dir: str | pathlib.Path, name: str,
                     title: str, notes: dict[str, str] | None = None) -> list[pathlib.Path]:
    """Single runs side by side ({label: workdir}): `<name>.json` (every evaluation of each run, and `notes`, e.g.
    the command that made it) and `<name>.png` (greedy pass@1, sampled probe pass@1 and KL to the SFT policy vs
    step)."""
    results_dir = pathlib.Path(results_dir)
    results_dir.mkdir(parents=True, exist_ok=True)
    records = {label: read_metrics(workdir) for label, workdir in runs.items()}
    evals = {label: [{k: v for k, v in r.items() if k == "step" or k.startswith(("eval/", "probe/"))}
                     for r in recs if "eval/pass@1" in r] for label, recs in records.items()}
    js = results_dir / f"{name}.json"
    js.write_text(json.dumps({"evaluations": evals, "notes": notes or {}}, indent=2) + "\n")
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.4))
    keys = (("eval/pass@1", "greedy pass@1 (test split)"), ("probe/pass@1", "sampled pass@1 (same prompts)"),
            ("probe/kl_to_sft", "KL(policy || SFT) per token"))
    for i, (label, recs) in enumerate(records.items()):
        for ax, (key, _) in zip(axes, keys):
            steps, values = series(recs, key)
            ax.plot(steps, values, marker=".", color=f"C{i % 10}", label=label)
    for ax, (key, ylabel) in zip(axes, keys):
        ax.set(xlabel="RL step", ylabel=ylabel, title=ylabel)
    fig_path = _save(fig, list(axes), results_dir / f"{name}.png", title)
    return [fig_path, js]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="runs/reproduce", help="the study's run directory")
    parser.add_argument("--results", default=str(pathlib.Path(__file__).resolve().parent / "results"),
                        help="where figures and tables go")
    args = parser.parse_args(argv)
    if not pathlib.Path(args.out).is_dir():
        sys.exit(f"error: --out={args.out!r} is not a directory")
    for path in make_report(args.out, args.results):
        print(path)


if __name__ == "__main__":
    main()
