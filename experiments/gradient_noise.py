"""How much of one RL step's policy gradient is signal? Real rewards against the shuffled-reward control, measured
at a run's starting policy.

The control's rewards are permuted across the batch, so a response's group-relative advantage is independent of
the response and averages to zero over the permutations: the control's expected gradient is exactly zero, and all
it does to the policy is the noise of a batch-sized gradient estimate. With real rewards one step's gradient is
g = mu + noise, mu the expected gradient. From the gradients g_1..g_K of K independent batches at the same
parameters (the batches of steps 0..K-1 of the run: its prompts, sampling keys and, for the control, its reward
permutations), with G[i, j] = g_i . g_j,

  signal  ||mu||^2   ~ the mean of G's off-diagonal entries (independent batches: E[g_i . g_j] = ||mu||^2)
  total   E||g||^2   ~ the mean of G's diagonal
  noise              = total - signal

and a sum of n steps' gradients has n^2 signal against n noise, so `steps_to_even` = noise / signal steps of this
batch size make signal and noise equal. The standard errors are jackknife (leave one batch out).

  python experiments/gradient_noise.py --config=configs/smollm2.py:grpo --batches=8 \\
      --out=experiments/results/real_model/gradient_noise.json

The gradient is the actor loss's (`rl.actor_loss_fn`, on-policy: the clip is inactive) over the step's whole batch,
computed `num_minibatches` rows at a time. Needs a config without a critic (advantage 'group').
"""

import functools
import json
import pathlib
import time

import jax
import numpy as np
from absl import app, flags
from jax.flatten_util import ravel_pytree
from ml_collections import config_flags

import provenance
from vcppo_jax import builders, rl, rl_loop, stage_meta
from vcppo_jax import config as config_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax.rollout import shuffle_rewards
from vcppo_jax.sampling import sampler_from_config

FLAGS = flags.FLAGS
ARMS = ("rewards", "shuffled")  # the verifier's rewards; the shuffled-reward control's


def gram_stats(gram: np.ndarray) -> dict[str, float]:
    """Signal and noise of a batch gradient from the Gram matrix [K, K] of K >= 3 independent batches' gradients.

    Returns signal (||mu||^2), total (E||g||^2), noise (total - signal), signal_fraction (signal / total),
    steps_to_even (noise / signal: steps whose summed gradient has as much signal as noise; inf when the signal
    estimate is not positive), mean_cosine (over pairs), and the jackknife standard errors signal_se,
    signal_fraction_se."""
    gram = np.asarray(gram, np.float64)
    k = len(gram)
    if gram.shape != (k, k) or k < 3:
        raise ValueError(f"need a square Gram matrix of at least 3 gradients, got shape {gram.shape}")

    def estimate(g: np.ndarray) -> tuple[float, float]:
        n = len(g)
        total = float(np.trace(g) / n)
        return float((g.sum() - np.trace(g)) / (n * (n - 1))), total

    signal, total = estimate(gram)
    loo = np.array([estimate(np.delete(np.delete(gram, i, 0), i, 1)) for i in range(k)])  # [K, 2]

    def jackknife_se(values: np.ndarray) -> float:
        return float(np.sqrt((k - 1) / k * ((values - values.mean()) ** 2).sum()))

    norms = np.sqrt(np.diag(gram))
    cos = gram / np.outer(norms, norms)
    return {"signal": signal, "total": total, "noise": total - signal, "signal_fraction": signal / total,
            "steps_to_even": (total - signal) / signal if signal > 0 else float("inf"),
            "mean_cosine": float((cos.sum() - k) / (k * (k - 1))),
            "signal_se": jackknife_se(loo[:, 0]), "signal_fraction_se": jackknife_se(loo[:, 0] / loo[:, 1])}


def gram_matrix(vectors: list[np.ndarray], block: int = 1 << 20) -> np.ndarray:
    """[K, K] dot products of K flat float32 vectors, accumulated in float64 one block of coordinates at a time (a
    float32 dot of 1e8 terms loses digits that a small signal fraction needs)."""
    gram = np.zeros((len(vectors), len(vectors)))
    for start in range(0, len(vectors[0]), block):
        part = np.stack([v[start:start + block] for v in vectors]).astype(np.float64)
        gram += part @ part.T
    return gram


def batch_gradient(grad_fn, params, experience: rl.Experience, *, num_chunks: int, agg_mode: str) -> np.ndarray:
    """The flat gradient [num_params] of the loss over the whole batch, from `grad_fn(params, rows)` on
    `num_chunks` equal row chunks, each weighted by its share of what `agg_mode` averages over."""
    mask = np.asarray(experience.response_mask)
    rows = len(mask) // num_chunks
    # token-mean divides by the valid tokens, the seq-mean modes by the non-empty rows, the constant-norm mode by
    # the rows (losses.aggregate).
    counts = {"token-mean": mask.sum(axis=1), "seq-mean-token-sum-norm": np.ones(len(mask))}.get(
        agg_mode, (mask.sum(axis=1) > 0).astype(np.float64))
    total = None
    for c in range(num_chunks):
        chunk = slice(c * rows, (c + 1) * rows)
        weight = counts[chunk].sum() / max(counts.sum(), 1)
        part = jax.tree.map(lambda x, chunk=chunk: x[chunk], experience)
        flat = np.asarray(ravel_pytree(grad_fn(params, part))[0], np.float32) * np.float32(weight)
        total = flat if total is None else total + flat
    return total


def measure(config, num_batches: int, log=print) -> dict:
    """Gradients of `num_batches` steps' batches at the config's starting policy, for the rewards and the control:
    `gram_stats` per arm, and per batch its reward mean, mean response length and groups with a nonzero
    advantage."""
    if config_lib.has_critic(config):
        raise app.UsageError("gradient_noise measures configs without a critic (advantage 'group')")
    config = config.copy_and_resolve_references()
    config.shuffle_rewards = False  # the collector's batches carry the real rewards; the control is derived below
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    sft_meta = stage_meta.finished_meta(config.sft_dir, "sft")
    models = rl_loop.Models.from_config(config, builders.model_config_from_json(sft_meta["model_config"], config))
    tok, verifier = builders.tokenizer(config), builders.verifier(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    policy = builders.load_policy(config.sft_dir, rt.target(rt_lib.abstract_params(models.actor)))
    state = rl_loop.init_state(policy, None, jax.random.PRNGKey(config.seed), models, kl_coef=config.kl_coef)
    hp = rl.RLHparams.from_config(config)
    sampler = sampler_from_config(models.actor, config.sampling, max_new_tokens=config.task.max_response_len,
                                  eos_id=builders.stop_ids(config, tok), pad_id=tok.pad_token_id)
    collect = rl_loop.rollout_collector(config, sampler, train, tok, verifier, rt)
    experience_fn = jax.jit(rl.make_experience_fn(hp, models.actor, None))
    loss_fn = rl.actor_loss_fn(hp, models.actor)
    grad_fn = jax.jit(lambda params, mb: jax.grad(lambda p: loss_fn(p, mb)[0])(params))
    gradient = functools.partial(batch_gradient, grad_fn, state.actor.params, num_chunks=config.num_minibatches,
                                 agg_mode=config.loss_agg)
    grads = {arm: [] for arm in ARMS}
    batches = []
    for step in range(num_batches):
        start = time.perf_counter()
        _, rollout, _ = collect(state.actor.params, step)
        control = shuffle_rewards(rollout, np.random.default_rng([config.seed, step]), rt.local_rows(
            config.prompts_per_step * config.group_size), rt)
        info = {"step": step, "reward_mean": float(np.mean(rollout.seq_rewards)),
                "response_length_mean": float(np.asarray(rollout.response_mask).sum(axis=1).mean())}
        for arm, r in zip(ARMS, (rollout, control)):
            experience, _ = experience_fn(state, rt.place_batch(r))
            groups = np.asarray(r.seq_rewards).reshape(-1, config.group_size)
            info[f"{arm}/groups_with_signal"] = int((groups.std(axis=1) > 0).sum())
            grads[arm].append(gradient(experience))
        info["seconds"] = round(time.perf_counter() - start, 1)
        log(json.dumps(info))
        batches.append(info)
    out = {"batches": batches}
    for arm in ARMS:
        out[arm] = gram_stats(gram_matrix(grads[arm]))
    return out


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    if FLAGS.batches < 3:
        raise app.UsageError(f"--batches must be at least 3, got {FLAGS.batches}")
    config, start = FLAGS.config, time.perf_counter()
    result = measure(config, FLAGS.batches)
    result = {"policy": config.sft_dir, "algorithm": config.algorithm, "batch_responses":
              config.prompts_per_step * config.group_size, "group_size": config.group_size,
              "num_batches": FLAGS.batches, **result, "seconds": round(time.perf_counter() - start),
              "provenance": provenance.record()}
    for arm in ARMS:
        print(arm, json.dumps(result[arm]))
    if FLAGS.out:
        path = pathlib.Path(FLAGS.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=1))


def define_flags() -> None:
    """The command line (defined here, not at import, so tests can import the statistics)."""
    config_flags.DEFINE_config_file("config", None, "An RL config without a critic (its policy, task, batch).",
                                    lock_config=False)
    flags.DEFINE_integer("batches", 8, "Independent batches (steps 0.. of the run) per arm; at least 3.")
    flags.DEFINE_string("out", None, "Write the result here (JSON).")


if __name__ == "__main__":
    define_flags()
    app.run(main)
