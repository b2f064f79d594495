"""The paper's comparisons on the synthetic long-CoT task, on CPU, over several seeds, in one resumable command.

  python experiments/reproduce.py                       # the study: 3 seeds x 8 methods (~2.4 h, 2 CPU cores)
  python experiments/reproduce.py --quick               # ~11 min: 1 seed, 4 methods, a smaller model and task
  python experiments/reproduce.py --learning            # does RL learn: VC-PPO, GRPO, shuffled-reward controls
  python experiments/reproduce.py --mechanism           # PPO's length collapse under a biased critic: 12 arms x 3 seeds
  python experiments/reproduce.py --mechanism --quick   # its collapse vs no-collapse contrast, 1 seed (<15 min)
  python experiments/reproduce.py --mechanism --long    # the contrast on 130-320-token responses, 3 seeds (GPU: 8 min)
  python experiments/reproduce.py --only ppo,vcppo --seeds 1 --out runs/mine
  python experiments/reproduce.py --only ppo,vcppo --set actor_optim.lr=1e-4 --stages-from runs/reproduce \
      --out runs/reproduce_lr1e-4 --results experiments/results/lr1e-4   # a variant: other RL fields, same stages

Methods (configs/<file>.py plus the overrides in `RECIPES`): `ppo` (one lambda 0.95, critic from the outcome reward
model), `vcppo`, `vcppo_no_vpt` (critic_init='actor'), `vcppo_no_dgae` (value-pretrained critic, lambda_actor =
lambda_critic = 0.95), `grpo`, and the lambda_actor sweep `vcppo_la0.9`, `vcppo_la0.99`, `vcppo_la1.0` (its 0.95 point
is `vcppo`); the mechanism study's arms are described beside their entries in `RECIPES` and in the `mechanism`
profile. As in the paper, every method starts from one cold-start policy: a single SFT run (`<out>/sft`, trained
with the first seed) is shared by all seeds and methods. Each seed then has its own value-pretraining and reward-model
run under `<out>/seed<k>/` (their samples and updates depend on the seed), shared by that seed's methods through
`sft_dir` / `critic_dir`, and its own RL runs; the task data (fixed, seed-independent) lives in `<out>/tfds`.
A run whose checkpoint meta says `done` is skipped, an unfinished one resumes, so rerunning the command continues the
study. At the end `plot_results.make_report` writes the figures and tables to `experiments/results/` (for --quick:
`<out>/results/`).

Size and runtime (the study, 2 CPU cores): RL runs are 60 steps of 64 responses, with a greedy evaluation every 15.
Per-step times (2-core machine, other jobs running): SFT ~0.45 s on batches trimmed to their longest row (the
default, `pad_to_multiple=1`; ~0.9-1.05 s untrimmed, as the mechanism profiles run), value pretraining ~1.4-1.5 s
(the reward model shares that loop), RL 3.6 (GRPO) to 4.7 s (VC-PPO); ~40 s of compile and setup per run and ~3 s
per 64-prompt evaluation. `estimate_seconds` computes an upper bound from these (RL at 4.0 s, critic stages at their
step cap) and the command prints it, counting only unfinished runs: ~2.4 h for the full study, ~1.4 h for --learning
(3 SFTs; it ran in 63 min); the persistent compilation cache (`<out>/jax_cache`) serves repeated programs.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import pathlib
import sys
import time
import traceback
from typing import Any, Sequence


import ml_collections

import config_files
import plot_results
from vcppo_jax import config as config_lib
from vcppo_jax import runtime
from vcppo_jax import stage_meta
from vcppo_jax import stages

RESULTS_DIR = pathlib.Path(__file__).resolve().parent / "results"

# method -> (config file, fields set on it). Display labels and the paper's numbers live in plot_results.METHODS.
RECIPES: dict[str, tuple[str, dict[str, Any]]] = {
    "ppo": ("ppo", {}),
    "vcppo": ("vcppo", {}),
    "vcppo_no_vpt": ("vcppo", {"critic_init": "actor"}),
    "vcppo_no_dgae": ("vcppo", {"lambda_actor": 0.95, "lambda_critic": 0.95}),
    "grpo": ("grpo", {}),
    "vcppo_la0.9": ("vcppo", {"lambda_actor": 0.9}),
    "vcppo_la0.99": ("vcppo", {"lambda_actor": 0.99}),
    "vcppo_la1.0": ("vcppo", {"lambda_actor": 1.0}),
    # Drift controls: trained on rewards permuted across each batch. GRPO's is signal-free; VC-PPO's still starts
    # from a critic pretrained on the true rewards (README, "Does RL learn?").
    "grpo_shuffled": ("grpo", {"shuffle_rewards": True}),
    "vcppo_shuffled": ("vcppo", {"shuffle_rewards": True}),
    # The mechanism study: the critic's initial calibration as the factor. In its profile the reward model is the
    # pessimistic one (trained with truncated responses as failures) and value pretraining starts from it, so `ppo`
    # is PPO from a pessimistic critic and `vcppo_no_dgae` PPO from a calibrated one (value-pretrained, 0.95/0.95).
    "vcppo_rm_critic": ("vcppo", {"critic_init": "reward_model"}),  # VC-PPO w/o value pretraining: 0.95/1.0
    # PPO (0.95/0.95) from the calibrated critic shifted by a constant: the initial-bias map.
    "ppo_bias-2": ("ppo", {"critic_init": "value_pretrain", "critic_init_bias": -2.0}),
    "ppo_bias-1": ("ppo", {"critic_init": "value_pretrain", "critic_init_bias": -1.0}),
    "ppo_bias+1": ("ppo", {"critic_init": "value_pretrain", "critic_init_bias": 1.0}),
    "vcppo_bias-2": ("vcppo", {"critic_init_bias": -2.0}),  # does lambda_critic 1.0 alone recover in time?
    # Long responses (README): with a policy whose short mode is nearly always wrong, how large a bias collapses it?
    "ppo_bias-6": ("ppo", {"critic_init": "value_pretrain", "critic_init_bias": -6.0}),
}
STAGE_ORDER = ("sft", "reward_model", "value_pretrain")


@dataclasses.dataclass(frozen=True)
class Profile:
    """A study size. `fields` holds flattened (dotted) config fields per group: 'common' (every RL config, and so
    every stage through `stages.derived_config`), 'rl', 'sft', 'value' (value pretraining and reward model).
    `step_scale` scales the measured default-size step times in the runtime estimate."""

    seeds: int
    methods: tuple[str, ...]
    fields: dict[str, dict[str, Any]]  # groups: 'common', 'rl', 'sft', 'value', and a stage name for that stage
    step_scale: float = 1.0
    shared_sft: bool = True  # one SFT policy for every seed (as in the paper); False: each seed trains its own.
    # 'study': the paper's figures and tables; 'learning': learning.json and its curves; 'mechanism': mechanism.json
    # and its figures.
    report: str = "study"


# The cold start the mechanism studies were measured on: the SFT's earlier default of 450 steps (400 main + 50 late)
# on untrimmed batches, kept so their committed results stay reproducible. The default is now 650 steps (README, "Where
# this recipe failed") on batches trimmed to their longest row (`pad_to_multiple`, which changes the float rounding).
SFT_450 = {"num_steps": 450, "optim.decay_steps": 430, "pad_to_multiple": 0}

PROFILES = {
    # Does RL learn? The config files' recipe exactly (the main job's), VC-PPO and GRPO beside their shuffled-reward
    # controls, each seed from its own SFT policy so the seeds also cover the cold start.
    "learning": Profile(seeds=3, methods=("vcppo", "grpo", "vcppo_shuffled", "grpo_shuffled"), fields={},
                        shared_sft=False,
                        report="learning"),
    # The mechanism study (README, "Why PPO collapses"): the config files' recipe, one shared SFT policy, a
    # pessimistic reward model (half its training responses cut at a random point and labelled failures) from which
    # PPO's critic and VC-PPO's value pretraining start, 40 RL steps. Arms: PPO from the pessimistic / calibrated
    # / optimistic (+1) critic, VC-PPO, VC-PPO without value pretraining, GRPO, the lambda_actor sweep, and PPO's
    # initial-bias map (-2, -1, 0 = calibrated, +1).
    "mechanism": Profile(seeds=3, methods=("ppo_bias-2", "vcppo_bias-2", "vcppo_no_dgae", "ppo_bias+1", "ppo", "vcppo",
                                           "vcppo_rm_critic", "grpo", "ppo_bias-1", "vcppo_la0.9", "vcppo_la0.99",
                                           "vcppo_la1.0"),
                         report="mechanism", fields={
        "sft": SFT_450,
        "rl": {"num_steps": 40, "eval_every": 10, "save_every": 20},
        "reward_model": {"truncated_fraction": 0.5},
        "value_pretrain": {"critic_init": "reward_model"},
    }),
    # The mechanism study's contrast in one seed: PPO from the calibrated critic - 2 (pessimistic) beside VC-PPO,
    # 20 RL steps (the pessimistic critic holds PPO in short answers for about that long). Value pretraining starts
    # from the actor, so no reward model is trained.
    "mechanism_quick": Profile(seeds=1, methods=("ppo_bias-2", "vcppo"), report="mechanism", fields={
        "sft": SFT_450,
        "rl": {"num_steps": 20, "eval_every": 10, "save_every": 10},
    }),
    # Where reward decay bites (README, "Long responses"): 5-9 two-digit terms, chains of thought of 130-320 tokens
    # (0.95^T < 0.002), and an SFT policy that keeps its chain of thought (30% direct answers throughout, no late
    # phase). 450 SFT steps left this policy at 0/64 greedy (README), so it trains for 3000 (trimmed batches).
    # 3 seeds, 40 RL steps: PPO (0.95/0.95) and VC-PPO (0.95/1.0) from the pessimistic critic (value-pretrained - 2),
    # VC-PPO, and PPO from the calibrated critic. Value pretraining starts from the actor (no reward model).
    # step_scale 4: RL steps here took 4-6x the default's on a shared 2-core machine; it ran on a GPU (README).
    "mechanism_long": Profile(seeds=3, methods=("ppo_bias-2", "vcppo_bias-2", "vcppo", "vcppo_no_dgae"),
                              report="mechanism", step_scale=4.0, fields={
        "common": {"task.knobs.min_terms": 5, "task.knobs.max_terms": 9, "task.max_prompt_len": 32,
                   "task.max_response_len": 336},
        # pad_to_multiple 32: at most 12 batch shapes (each one a compile; 1 would give ~100 here).
        "sft": {"num_steps": 3000, "optim.decay_steps": 2980, "late_steps": 0, "eval_every": 500,
                "save_every": 500, "pad_to_multiple": 32},
        "rl": {"num_steps": 40, "eval_every": 10, "save_every": 20},
    }),
    # The config files' model, task and batch sizes (where the per-step times were measured), 60 RL steps.
    "full": Profile(seeds=3, methods=("ppo", "vcppo", "vcppo_no_vpt", "vcppo_no_dgae", "grpo", "vcppo_la0.9",
                                      "vcppo_la0.99", "vcppo_la1.0"), fields={
        "rl": {"num_steps": 60, "eval_every": 15, "save_every": 30}}),
    # Smaller model and shorter chains of thought (2 two-digit terms); fewer steps. step_scale is a guess (not
    # measured): 2 layers of width 64 over ~90-token sequences vs 4 of width 128 over ~136.
    "quick": Profile(seeds=1, methods=("ppo", "vcppo", "vcppo_no_dgae", "grpo"), step_scale=0.35, fields={
        "common": {"model.hidden_size": 64, "model.intermediate_size": 192, "model.num_layers": 2,
                   "model.num_heads": 4, "model.num_kv_heads": 2, "task.knobs.max_terms": 2,
                   "task.max_response_len": 64},
        "rl": {"num_steps": 40, "eval_every": 10, "save_every": 20},
        "sft": {"num_steps": 300, "optim.decay_steps": 280, "eval_every": 100},
        "value": {"max_steps": 30, "min_steps": 10},
    }),
    # Wiring check in seconds of compute (tests / development): nothing learns. Every batch and RL minibatch is a
    # multiple of 8, so it also runs on 8 (fake) devices.
    "tiny": Profile(seeds=1, methods=("vcppo",), step_scale=0.05, fields={
        "common": {"model.hidden_size": 32, "model.intermediate_size": 64, "model.num_layers": 2,
                   "model.num_heads": 2, "model.num_kv_heads": 2, "model.max_position_embeddings": 64,
                   "task.max_prompt_len": 12, "task.max_response_len": 16, "task.knobs.max_terms": 2,
                   "task.knobs.min_digits": 1, "task.knobs.num_train": 64, "task.knobs.num_test": 16,
                   "progress_bar": False, "tensorboard": False},
        "rl": {"num_steps": 2, "eval_every": 2, "save_every": 1, "prompts_per_step": 8, "group_size": 2,
               "num_minibatches": 2, "eval_prompts": 8, "diag_buckets": 4, "diag_early_tokens": 4,
               "logprob_chunk": 8},
        "sft": {"num_steps": 3, "batch_size": 8, "eval_every": 3, "eval_prompts": 8, "optim.warmup_steps": 1,
                "optim.decay_steps": 2},
        "value": {"max_steps": 2, "min_steps": 1, "prompts_per_step": 8, "group_size": 2, "logprob_chunk": 8},
    }),
}

# Runtime model (seconds, 2 CPU cores, default sizes; see the module docstring).
STEP_S = {"rl": 4.0, "sft": 0.5, "sft_untrimmed": 1.05, "value_pretrain": 1.5, "reward_model": 1.5}
SETUP_S = 40.0
EVAL_S = 3.0


@dataclasses.dataclass(frozen=True)
class Run:
    name: str  # a method of RECIPES or a stage of STAGE_ORDER
    seed: int
    config: ml_collections.ConfigDict
    needs: tuple[str, ...]  # workdirs that must be finished first

    @property
    def workdir(self) -> str:
        return self.config.workdir


def _apply(c: ml_collections.ConfigDict, fields: dict[str, Any]) -> ml_collections.ConfigDict:
    """Sets dotted fields; each must exist (ConfigDict.update_from_flattened_dict would add a misspelt one)."""
    for field in fields:
        node = c
        for part in field.split("."):
            if not isinstance(node, ml_collections.ConfigDict) or part not in node:
                raise ValueError(f"config field {field!r} does not exist in the {c.get('stage', '?')} config")
            node = node[part]
    if fields:
        c.update_from_flattened_dict(dict(fields))
    return c


def rl_config(method: str, seed: int, out: pathlib.Path, profile: Profile, rl_set: dict[str, Any] | None = None,
              stages_from: pathlib.Path | None = None) -> ml_collections.ConfigDict:
    """configs/<file>.py + the method's fields + the profile's sizes + `rl_set`; the RL run lives in
    out/seed<k>/<method>, the stages it needs in (stages_from or out)/sft and .../seed<k>/."""
    if method not in RECIPES:
        raise ValueError(f"method={method!r} is unknown; choose from {tuple(RECIPES)}")
    file, fields = RECIPES[method]
    stage_root = stages_from or out
    c = _apply(config_files.load(file), fields)
    c.seed = seed
    c.workdir = str(out / f"seed{seed}" / method)
    c.sft_dir = str(stage_root / "sft" if profile.shared_sft else stage_root / f"seed{seed}" / "sft")
    c.critic_dir = (str(stage_root / f"seed{seed}" / c.critic_init) if config_lib.has_critic(c)
                    and c.critic_init in ("value_pretrain", "reward_model") else "")
    c.task.data_dir = str(stage_root / "tfds")
    _apply(c, profile.fields.get("common", {}))
    _apply(c, profile.fields.get("rl", {}))
    try:
        _apply(c, rl_set or {})
    except (ValueError, TypeError) as e:
        raise ValueError(f"--set: {e}") from None
    return config_lib.validate(c)


def build_plan(out: str | pathlib.Path, seeds: Sequence[int], methods: Sequence[str], profile: Profile,
               rl_set: dict[str, Any] | None = None, stages_from: str | pathlib.Path | None = None) -> list[Run]:
    """Seed by seed: the stages the chosen methods need that no earlier seed planned (the shared SFT comes with the
    first seed), then the methods' RL runs. With `stages_from` (an earlier study's --out) the RL runs start from
    that study's finished stages instead, and none are planned: a variant (`rl_set`, e.g. another learning rate)
    then differs from it in the RL runs alone."""
    out = pathlib.Path(out).resolve()
    stages_from = pathlib.Path(stages_from).resolve() if stages_from else None
    methods = list(dict.fromkeys(methods))
    unknown = [m for m in methods if m not in RECIPES]
    if unknown or not methods:
        raise ValueError(f"--only={','.join(methods)!r}: unknown or empty; choose from {','.join(RECIPES)}")
    if not seeds or any(s < 0 for s in seeds):
        raise ValueError(f"seeds={list(seeds)} must be a non-empty list of integers >= 0")
    plan: list[Run] = []
    planned: set[str] = set()  # stage workdirs
    for seed in seeds:
        rl_runs = [rl_config(m, seed, out, profile, rl_set, stages_from) for m in methods]
        stage_cfgs: dict[str, ml_collections.ConfigDict] = {}
        for c in rl_runs:
            todo = list(stage_meta.prerequisites(c))
            while todo:  # a stage's own prerequisites too (value pretraining may start from the reward model)
                stage, workdir = todo.pop(0)
                if stages_from is not None:
                    if not stages.stage_done(workdir):
                        raise ValueError(f"--stages-from={stages_from}: no finished {stage} in {workdir}; run that "
                                         "study first")
                elif stage not in stage_cfgs and workdir not in planned:
                    sc = stages.derived_config(c, stage, workdir)
                    if stage == "sft" and profile.shared_sft:
                        sc.seed = 0  # the one shared SFT policy is seed 0's, whichever seeds this plan holds
                    _apply(sc, profile.fields.get("sft" if stage == "sft" else "value", {}))
                    _apply(sc, profile.fields.get(stage, {}))
                    if stage == "value_pretrain" and sc.critic_init == "reward_model":
                        sc.critic_dir = str(pathlib.Path(workdir).parent / "reward_model")
                    stage_cfgs[stage] = config_lib.validate(sc)
                    todo += stage_meta.prerequisites(sc)
        for stage in STAGE_ORDER:
            if stage in stage_cfgs:
                sc = stage_cfgs[stage]
                planned.add(sc.workdir)
                plan.append(Run(stage, sc.seed, sc, tuple(w for _, w in stage_meta.prerequisites(sc))))
        plan += [Run(m, seed, c, tuple(w for _, w in stage_meta.prerequisites(c))) for m, c in zip(methods, rl_runs)]
    return plan


def check_meshes(plan: Sequence[Run]) -> None:
    """Every run's batches divide its mesh (ValueError naming the field otherwise): checked for the whole study up
    front, so a bad size fails before the first run starts rather than hours into the study."""
    for run in plan:
        runtime.make_runtime(run.config)


def _num_evals(steps: int, every: int, at_start: bool) -> int:
    return int(at_start) + steps // every + int(steps % every != 0)


def estimate_seconds(run: Run, step_scale: float = 1.0) -> float:
    """Upper-bound wall time of one run on 2 CPU cores (value stages counted at max_steps)."""
    c = run.config
    if c.stage == "rl":
        steps, evals = c.num_steps, _num_evals(c.num_steps, c.eval_every, True)
    elif c.stage == "sft":
        steps, evals = c.num_steps, _num_evals(c.num_steps, c.eval_every, False)
    else:
        steps, evals = c.max_steps, 0
    rate = STEP_S["sft_untrimmed" if c.stage == "sft" and not c.pad_to_multiple else c.stage]
    return SETUP_S + step_scale * (steps * rate + evals * EVAL_S)


def _status(run: Run) -> str:
    return "done" if stages.stage_done(run.workdir) else "pending"


def run_plan(plan: Sequence[Run], step_scale: float = 1.0) -> tuple[list[Run], bool]:
    """Runs every unfinished run in order (each resumes from its checkpoint); a failure is reported and its
    dependents skipped, the rest continue. A run that returns unfinished was preempted (SIGTERM: it saved and
    stopped), so the study stops there too. Returns (failed or skipped runs, whether the study stopped early)."""
    failed: set[str] = set()
    bad: list[Run] = []
    for i, run in enumerate(plan):
        tag = f"[reproduce {i + 1}/{len(plan)}] seed {run.seed} {run.name}"
        if stages.stage_done(run.workdir):
            print(f"{tag}: done, skipping ({run.workdir})", flush=True)
            continue
        if any(w in failed for w in run.needs):
            print(f"{tag}: skipped, a stage it needs failed", flush=True)
            failed.add(run.workdir)
            bad.append(run)
            continue
        print(f"{tag}: running in {run.workdir} (estimate <= {estimate_seconds(run, step_scale) / 60:.1f} min)",
              flush=True)
        t0 = time.perf_counter()
        try:
            stages.run_stage(run.config)
        except Exception:  # noqa: BLE001 - one bad run (e.g. halted on non-finite losses) must not end the study
            traceback.print_exc()
            print(f"{tag}: FAILED after {time.perf_counter() - t0:.0f} s", flush=True)
            failed.add(run.workdir)
            bad.append(run)
            continue
        if not stages.stage_done(run.workdir):
            print(f"{tag}: stopped unfinished (preempted); rerun the command to resume", flush=True)
            return bad, True
        print(f"{tag}: finished in {time.perf_counter() - t0:.0f} s", flush=True)
    return bad, False


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None,
                   help="root of the study's runs (default runs/reproduce; --learning: runs/learning)")
    p.add_argument("--seeds", default=None,
                   help="N: seeds 0..N-1 (default: the profile's, 3; --quick 1); or a comma list, e.g. 1,2 or 2, "
                        "(seed 2 alone). The shared SFT policy is always trained with seed 0, by whichever "
                        "command reaches it first: let it finish before starting other seeds in parallel")
    p.add_argument("--quick", action="store_true", help="~11 min version: 1 seed, 4 methods, smaller model/task")
    p.add_argument("--learning", action="store_true",
                   help="does RL learn: the config files' recipe, VC-PPO, GRPO and their shuffled-reward controls, "
                        "3 seeds each with its own SFT (~1.1 h); writes learning.json and its figure")
    p.add_argument("--mechanism", action="store_true",
                   help="the mechanism study: PPO's length collapse under a biased critic and VC-PPO's fix, 3 seeds "
                        "(~2.5 h); with --quick, its one-seed collapse vs no-collapse contrast (<15 min)")
    p.add_argument("--long", action="store_true",
                   help="with --mechanism: its contrast on 130-320-token chains of thought, 3 seeds (hours on 2 CPU "
                        "cores; experiments/mechanism_long_gpu.sh runs it on one GPU in minutes)")
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # seconds-sized wiring check
    p.add_argument("--only", default="", help=f"comma-separated methods out of {','.join(RECIPES)}")
    p.add_argument("--results", default=None,
                   help="figures/tables dir (default experiments/results; --quick/--tiny: <out>/results)")
    p.add_argument("--compile-cache", default=None,
                   help="persistent JAX compilation cache dir (default <out>/jax_cache; '' disables)")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override an RL config field in every RL run, e.g. --set actor_optim.lr=1e-4 (repeatable)")
    p.add_argument("--stages-from", default=None, metavar="DIR",
                   help="start the RL runs from the finished SFT / critic stages of the study in DIR (its --out)")
    p.add_argument("--dry-run", action="store_true", help="print the plan and the runtime estimate, run nothing")
    args = p.parse_args(argv)
    args.rl_set = {}
    for item in args.set:
        field, sep, text = item.partition("=")
        if not sep or not field:
            p.error(f"--set {item!r}: expected FIELD=VALUE")
        try:
            args.rl_set[field] = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            args.rl_set[field] = text  # a bare string, e.g. --set loss_agg=seq-mean-token-mean
    if args.tiny + args.learning + args.mechanism > 1 or args.quick and (args.tiny or args.learning):
        p.error("--learning, --mechanism and --tiny are exclusive, and --quick goes alone or with --mechanism")
    if args.long and (not args.mechanism or args.quick):
        p.error("--long goes with --mechanism (and not with --quick)")
    if args.out is None:
        args.out = ("runs/learning" if args.learning else "runs/mechanism_quick" if args.mechanism and args.quick
                    else "runs/mechanism_long" if args.long else "runs/mechanism" if args.mechanism
                    else "runs/reproduce")
    if args.seeds is not None:
        try:
            args.seeds = parse_seeds(args.seeds)
        except ValueError as e:
            p.error(str(e))
    return args


def parse_seeds(text: str) -> list[int]:
    """'3' -> [0, 1, 2] (a count); '1,2' -> [1, 2] and '2,' -> [2] (a list)."""
    items = [t.strip() for t in text.split(",") if t.strip()] if "," in text else [text.strip()]
    if not items or not all(t.isdigit() for t in items) or "," not in text and int(items[0]) < 1:
        raise ValueError(f"--seeds={text!r}: expected a count N >= 1 or a comma list of seeds >= 0 (e.g. 1,2 or 2,)")
    return sorted({int(t) for t in items}) if "," in text else list(range(int(items[0])))


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    runtime.configure_console(verbose=False)  # as the entrypoints: no orbax / TFDS chatter between the runs' lines
    name = ("tiny" if args.tiny else "mechanism_quick" if args.mechanism and args.quick else "quick" if args.quick
            else "mechanism_long" if args.long else "learning" if args.learning else "mechanism" if args.mechanism
            else "full")
    profile = PROFILES[name]
    out = pathlib.Path(args.out).resolve()
    methods = [m for m in args.only.split(",") if m] if args.only else list(profile.methods)
    seeds = args.seeds if args.seeds is not None else list(range(profile.seeds))
    try:
        plan = build_plan(out, seeds, methods, profile, args.rl_set, args.stages_from)
        check_meshes(plan)
    except ValueError as e:
        sys.exit(f"error: {e}")
    results = (pathlib.Path(args.results) if args.results
               else RESULTS_DIR if name in ("full", "learning", "mechanism") else out / "results")

    pending = [r for r in plan if _status(r) == "pending"]
    total = sum(estimate_seconds(r, profile.step_scale) for r in pending)
    print(f"[reproduce] profile {name}: {len(plan)} runs ({len(pending)} to do), seeds {seeds}, methods "
          f"{','.join(methods)}; estimated <= {total / 3600:.2f} h on 2 CPU cores", flush=True)
    for r in plan:
        print(f"  seed {r.seed} {r.name:15s} {_status(r):8s} {r.workdir}")
    if args.dry_run:
        return 0

    cache = str(out / "jax_cache") if args.compile_cache is None else args.compile_cache
    if cache:
        import jax  # noqa: PLC0415

        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    out.mkdir(parents=True, exist_ok=True)
    rl0 = next(r.config for r in plan if r.config.stage == "rl")
    (out / "study.json").write_text(json.dumps({
        "profile": name, "max_response_len": rl0.task.max_response_len, "diag_buckets": rl0.diag_buckets,
        "set": args.rl_set, "stages_from": str(pathlib.Path(args.stages_from).resolve()) if args.stages_from else None
    }) + "\n")

    t0 = time.perf_counter()
    bad, stopped = run_plan(plan, profile.step_scale)
    print(f"[reproduce] runs finished in {(time.perf_counter() - t0) / 60:.1f} min", flush=True)
    report = {"learning": plot_results.make_learning_report, "mechanism": plot_results.make_mechanism_report,
              "study": plot_results.make_report}[profile.report]
    for path in report(out, results):
        print(f"[reproduce] wrote {path}")
    if bad:
        print("[reproduce] failed or skipped: " + ", ".join(f"seed {r.seed} {r.name}" for r in bad), flush=True)
        return 1
    return 1 if stopped else 0


if __name__ == "__main__":
    sys.exit(main())
