"""How much of one RL step's policy gradient is signal? Real rewards against the shuffled-reward control, measured
at a run's starting policy.

The control's rewards are permuted across the batch, so a response's group-relative advantage is independent of
the response and averages to zero over the permutations: the control's expected gradient is exactly zero, and all
it does to the policy is the noise of a batch-sized gradient estimate. With real rewards a step's gradient is
g = mu + noise, mu the expected gradient, and it is a sum over the step's n prompt groups, g = h_1 + ... + h_n (GRPO's
advantages are relative to the group). Groups of different prompts are independent, so from the N = K n groups of
K steps' batches (steps 0..K-1 of the run: its prompts, sampling keys and reward permutations) at the same
parameters, with G[i, j] = h_i . h_j,

  E[h] . E[h]   ~ the mean of G over pairs of groups of different batches
  E[h . h]      ~ the mean of G's diagonal
  signal        = n^2 E[h] . E[h]                   (||mu||^2 of a batch gradient)
  noise         = n (E[h . h] - E[h] . E[h])         (its expected squared distance from mu)

A sum of s steps' gradients has s^2 signal against s noise, so `steps_to_even` = noise / signal steps of this batch
make the two equal. Groups whose rewards are all equal have a zero gradient; they count in N. Standard errors are
jackknife over batches. The result JSON keeps each arm's Gram matrices.

Two metrics: 'euclidean' (the raw gradient) and 'adam', each coordinate divided by the root mean square of the K
batch gradients there: the direction an Adam step takes early in a run (its second moment is a mean of squared
gradients), so the signal fraction of what the optimizer moves, not of what the gradient's largest coordinates hold.

  python experiments/gradient_noise.py --config=configs/smollm2.py:grpo --batches=10 \\
      --out=experiments/results/real_model/gradient_noise.json

The gradient is the actor loss's (`rl.actor_loss_fn`, on-policy: the clip is inactive) with advantage 'group' and
no entropy, KL or NLL term. Each group's gradient (the model's size in float32) is kept on disk under --scratch
until the statistics are read (removed then, or when the script stops on an error, Ctrl-C or SIGTERM): about half of
the groups have one, 0.5 GB each for SmolLM2-135M.
"""

import json
import pathlib
import signal
import sys
import tempfile
import time
from collections.abc import Iterator

import jax
import numpy as np
from absl import app, flags
from jax.flatten_util import ravel_pytree
from ml_collections import config_flags

import provenance
from vcppo_jax import builders, losses, rl, rl_loop, stage_meta
from vcppo_jax import config as config_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax.rollout import shuffle_rewards

FLAGS = flags.FLAGS
ARMS = ("rewards", "shuffled")  # the verifier's rewards; the shuffled-reward control's
METRICS = ("euclidean", "adam")


def signal_noise(gram: np.ndarray, batch_of_row: np.ndarray, num_batches: int, groups_per_batch: int
                 ) -> dict[str, float]:
    """Signal and noise of a batch gradient (module docstring) from the Gram matrix [M, M] of the M nonzero group
    gradients of `num_batches` >= 3 batches of `groups_per_batch` groups (the others are zero); `batch_of_row` [M]:
    each one's batch. E[h] . E[h] comes from pairs in different batches only: the 'adam' metric divides by a second
    moment of the batch sums, which ties groups of one batch together; it is the same for a batch's gradients and
    their negatives, so pairs across batches keep a zero mean without signal where a batch's noise is symmetric.

    Returns signal, noise, signal_fraction (signal / (signal + noise)), steps_to_even (noise / signal; inf when the
    signal estimate is not positive) and the jackknife standard errors (leave one batch out) signal_se,
    signal_fraction_se."""
    gram, batch_of_row = np.asarray(gram, np.float64), np.asarray(batch_of_row)
    m, n, k = len(gram), groups_per_batch, num_batches
    if gram.shape != (m, m) or batch_of_row.shape != (m,) or k < 3 or np.any(np.bincount(batch_of_row) > n):
        raise ValueError(f"need a square Gram matrix of at most {n} gradients from each of num_batches >= 3 "
                         f"batches, got shape {gram.shape} over {k} batches")
    if np.trace(gram) <= 0:
        raise ValueError("every gradient is zero: no group held both right and wrong answers")
    other = batch_of_row[:, None] != batch_of_row[None, :]  # [M, M] pairs in different batches

    def estimate(kept: np.ndarray) -> tuple[float, float]:
        rows, batches = kept[batch_of_row], kept.sum()
        mean_sq = np.trace(gram[np.ix_(rows, rows)]) / (batches * n)
        cross = (gram * other)[np.ix_(rows, rows)].sum() / (batches * (batches - 1) * n * n)
        return n * n * cross, n * (mean_sq - cross)

    signal, noise = estimate(np.ones(k, bool))
    loo = np.array([estimate(np.arange(k) != b) for b in range(k)])  # [K, 2]

    def jackknife_se(values: np.ndarray) -> float:
        return float(np.sqrt((k - 1) / k * ((values - values.mean()) ** 2).sum()))

    return {"signal": float(signal), "noise": float(noise), "signal_fraction": float(signal / (signal + noise)),
            "steps_to_even": float(noise / signal) if signal > 0 else float("inf"),
            "signal_se": jackknife_se(loo[:, 0]), "signal_fraction_se": jackknife_se(loo[:, 0] / loo.sum(axis=1))}


def gram_matrices(rows: np.ndarray, batch_of_row: np.ndarray, num_batches: int,
                  block: int = 1 << 20) -> dict[str, np.ndarray]:
    """{'euclidean', 'adam'}: [M, M] dot products of the group gradients `rows` [M, num_params] (float32, e.g. a
    memmap), raw and with each coordinate divided by the root mean square over the `num_batches` batch gradients
    (the sums of each batch's rows, `batch_of_row` [M]; coordinates where all are zero stay zero). Accumulated in
    float64 one block of coordinates at a time."""
    m = len(rows)
    out = {k: np.zeros((m, m)) for k in METRICS}
    for start in range(0, rows.shape[1], block):
        part = np.asarray(rows[:, start:start + block], np.float64)  # [M, block]
        sq_sum = sum(part[batch_of_row == b].sum(axis=0) ** 2 for b in range(num_batches))
        rms = np.sqrt(sq_sum / num_batches)
        white = np.divide(part, rms, out=np.zeros_like(part), where=rms > 0)
        out["euclidean"] += part @ part.T
        out["adam"] += white @ white.T
    return out


def group_gradients(grad_fn, params, experience: rl.Experience, *, group_size: int, agg_mode: str
                    ) -> Iterator[tuple[int, np.ndarray]]:
    """(group index, flat gradient [num_params]) of each group's share of the batch loss's gradient, for the groups
    whose advantages are not all zero (the others' is zero): the batch gradient is their sum. `grad_fn(params, rows)`
    is the gradient of the loss over those rows alone, weighted here by their share of the batch's aggregation
    (`losses.aggregate` with `agg_mode`: the valid tokens, the non-empty rows, or every row)."""
    mask, adv = np.asarray(experience.response_mask), np.asarray(experience.advantages)
    for j in range(len(mask) // group_size):
        rows = slice(j * group_size, (j + 1) * group_size)
        if not np.any(adv[rows] * mask[rows]):
            continue
        # The aggregation is linear in the token values: its value over the batch for ones on this group's tokens,
        # over the group's value for them, is the group's share.
        ones = np.zeros_like(mask)
        ones[rows] = mask[rows]
        weight = losses.aggregate(ones, mask, agg_mode) / losses.aggregate(mask[rows], mask[rows], agg_mode)
        part = jax.tree.map(lambda x, rows=rows: x[rows], experience)
        yield j, np.asarray(ravel_pytree(grad_fn(params, part))[0], np.float32) * np.float32(weight)


class Setup:
    """A config's starting policy, its step batches (`collect`) and the jitted experience and gradient functions."""

    def __init__(self, config):
        if config_lib.has_critic(config):
            raise app.UsageError("gradient_noise measures configs without a critic (advantage 'group')")
        if config.entropy_coef or config.kl_coef or config.nll_coef:
            raise app.UsageError("gradient_noise measures the policy-gradient term alone: set entropy_coef, "
                                 "kl_coef and nll_coef to 0")
        config = config.copy_and_resolve_references()
        config.shuffle_rewards = False  # batches carry the real rewards; the control is derived from them
        config_lib.validate(config)
        self.config, self.rt = config, rt_lib.make_runtime(config)
        sft_meta = stage_meta.finished_meta(config.sft_dir, "sft")
        models = rl_loop.Models.from_config(config,
                                            builders.model_config_from_json(sft_meta["model_config"], config))
        tok, verifier = builders.tokenizer(config), builders.verifier(config)
        train = builders.prompt_source(config, config.task.train_split, tok)
        policy = builders.load_policy(config.sft_dir, self.rt.target(rt_lib.abstract_params(models.actor)))
        self.state = rl_loop.init_state(policy, None, jax.random.PRNGKey(config.seed), models, kl_coef=0.0)
        # The run's own sampler and experience programs, so the batches are the ones its steps would train on.
        layout = rl_loop.abstract_state(config, models)
        progs = rl_loop.programs(config, models, jax.tree.map(lambda x: x.sharding, self.rt.target(layout)), tok)
        self.collect = rl_loop.rollout_collector(config, progs.sampler, train, tok, verifier, self.rt)
        self.experience = progs.experience
        loss_fn = rl.actor_loss_fn(rl.RLHparams.from_config(config), models.actor)
        self.grad = jax.jit(lambda params, mb: jax.grad(lambda p: loss_fn(p, mb)[0])(params))
        self.num_params = ravel_pytree(policy)[0].size

    def batch(self, step: int, arm: str) -> tuple[rl.Rollout, rl.Rollout]:
        """Step `step`'s batch at the starting policy: with the verifier's rewards, and as the update trains on it
        (the config's reward hooks, then for arm 'shuffled' the control's permutation)."""
        c = self.config
        rollout, train_rollout, _ = self.collect(self.state.actor.params, step)
        if arm == "shuffled":
            rows = self.rt.local_rows(c.prompts_per_step * c.group_size)
            train_rollout = shuffle_rewards(train_rollout, np.random.default_rng([c.seed, step]), rows, self.rt)
        return rollout, train_rollout


def measure_arm(setup: Setup, arm: str, num_batches: int, scratch: str, log=print) -> dict:
    """`signal_noise` of both metrics for one arm over steps 0..num_batches-1, and per batch its reward mean, mean
    response length and groups with a gradient."""
    c = setup.config
    groups = c.prompts_per_step
    with tempfile.TemporaryDirectory(dir=scratch) as tmp:
        rows = np.lib.format.open_memmap(pathlib.Path(tmp) / "rows.npy", mode="w+", dtype=np.float32,
                                         shape=(num_batches * groups, setup.num_params))
        batch_of_row, batches = [], []
        for step in range(num_batches):
            start = time.perf_counter()
            rollout, train_rollout = setup.batch(step, arm)
            experience, _ = setup.experience(setup.state, setup.rt.place_batch(train_rollout))
            found = 0
            for _, flat in group_gradients(setup.grad, setup.state.actor.params, experience,
                                           group_size=c.group_size, agg_mode=c.loss_agg):
                rows[len(batch_of_row)] = flat
                batch_of_row.append(step)
                found += 1
            info = {"arm": arm, "step": step, "reward_mean": float(np.mean(rollout.seq_rewards)),
                    "response_length_mean": float(np.asarray(rollout.response_mask).sum(axis=1).mean()),
                    "groups_with_gradient": found, "seconds": round(time.perf_counter() - start, 1)}
            log(json.dumps(info))
            batches.append(info)
        rows.flush()
        grams = gram_matrices(rows[:len(batch_of_row)], np.array(batch_of_row, int), num_batches)
        del rows
    batch_of_row = np.array(batch_of_row, int)
    out = {metric: signal_noise(grams[metric], batch_of_row, num_batches, groups) for metric in METRICS}
    return {**out, "batches": batches, "batch_of_row": batch_of_row.tolist(),
            "gram": {metric: grams[metric].tolist() for metric in METRICS}}


def markdown(results: list[dict]) -> str:
    """One table row per measurement, arm and metric: the signal fraction with its standard error, its bound at two
    standard errors above the estimate and the fewest steps to even that bound allows, groups with a gradient."""
    labels = {"rewards": "the verifier's rewards", "shuffled": "shuffled rewards (control)"}
    lines = [("| policy | responses per step (prompts x group) | steps | trained on | metric | signal fraction (%) "
              "| at most, 2 s.e. (%) | steps to even, at least | groups with a gradient |"),
             "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        shape = f"{r['batch_responses']} ({r['batch_responses'] // r['group_size']} x {r['group_size']})"
        for arm in ARMS:
            found = sum(b["groups_with_gradient"] for b in r[arm]["batches"])
            total = r["num_batches"] * r["batch_responses"] // r["group_size"]
            for metric in METRICS:
                a = r[arm][metric]
                bound = a["signal_fraction"] + 2 * a["signal_fraction_se"]
                steps = f"{(1 - bound) / bound:.0f}" if 0 < bound < 1 else "-"
                lines.append(f"| `{r['policy']}` | {shape} | {r['num_batches']} | {labels[arm]} | {metric} "
                             f"| {100 * a['signal_fraction']:.2f} ± {100 * a['signal_fraction_se']:.2f} "
                             f"| {100 * bound:.2f} | {steps} | {found} of {total} |")
    return "\n".join(lines)


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config, start = FLAGS.config, time.perf_counter()
    if FLAGS.batches < 3:
        raise app.UsageError(f"--batches must be at least 3 (the standard errors leave one out), got {FLAGS.batches}")
    if not pathlib.Path(FLAGS.scratch).is_dir():
        raise app.UsageError(f"--scratch {FLAGS.scratch!r} is not a directory")
    # SIGTERM exits through the scratch directory's cleanup instead of leaving gigabytes of gradients behind.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    setup = Setup(config)
    result = {"policy": config.sft_dir, "algorithm": config.algorithm,
              "batch_responses": config.prompts_per_step * config.group_size, "group_size": config.group_size,
              "num_batches": FLAGS.batches}
    for arm in ARMS:
        result[arm] = measure_arm(setup, arm, FLAGS.batches, FLAGS.scratch)
        print(arm, json.dumps({m: result[arm][m] for m in METRICS}), flush=True)
    result.update(seconds=round(time.perf_counter() - start), provenance=provenance.record())
    if FLAGS.out:
        path = pathlib.Path(FLAGS.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


def define_flags() -> None:
    """The command line (defined here, not at import, so tests can import the statistics)."""
    config_flags.DEFINE_config_file("config", None, "An RL config without a critic (its policy, task, batch).",
                                    lock_config=False)
    flags.DEFINE_integer("batches", 10, "Independent batches per arm: the run's steps 0.. at its starting policy.")
    flags.DEFINE_string("scratch", tempfile.gettempdir(), "Where the group gradients are kept while measuring.")
    flags.DEFINE_string("out", None, "Write the result here (JSON).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
