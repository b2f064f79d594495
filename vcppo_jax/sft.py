"""Cold-start SFT: next-token NLL on chain-of-thought traces (a share in the short direct-answer style)."""

from __future__ import annotations

from typing import Callable, NamedTuple

import flax.linen as nn
import jax
import ml_collections
import numpy as np
import optax

from vcppo_jax import builders
from vcppo_jax import config as config_lib
from vcppo_jax import losses
from vcppo_jax import rewards
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stage_meta
from vcppo_jax.compile_options import jit_training
from vcppo_jax.data.batching import batch_indices, encode_sft, trim_sft_padding
from vcppo_jax.metrics import Timer
from vcppo_jax.models import CausalLM, init_params, load_hf_checkpoint
from vcppo_jax.optim import init_model_state, learning_rate, make_optimizer, train_epochs
from vcppo_jax.rl import policy_logprobs
from vcppo_jax.rollout import evaluate
from vcppo_jax.sampling import sampler_from_config
from vcppo_jax.stage_run import stage_run


def use_direct_style(indices: np.ndarray, seed: int, fraction: float) -> np.ndarray:
    """Whether record i is taught in the direct (answer-only) style: a fixed pseudo-random choice per record."""
    h = (indices.astype(np.uint64) * np.uint64(2654435761) + np.uint64(seed) * np.uint64(97)) % np.uint64(10007)
    return h < np.uint64(round(fraction * 10007))


def direct_fraction(config: ml_collections.ConfigDict, step: int) -> float:
    """Share of direct-style traces at SFT `step`: `late_direct_fraction` over the last `late_steps` steps."""
    late = config.late_steps and step >= config.num_steps - config.late_steps
    return config.late_direct_fraction if late else config.direct_fraction


def sft_loss_fn(model: nn.Module, *, chunk: int):
    """NLL of the response tokens; batch: tokens / attn_mask [B, P+R], response_mask [B, R]. P is read from the
    shapes (static under jit), so a batch trimmed of padding (`trim_sft_padding`) needs no other function."""

    def loss_fn(params, batch):
        prompt_len = batch["tokens"].shape[1] - batch["response_mask"].shape[1]
        logp, _ = policy_logprobs(model, params, batch["tokens"], batch["attn_mask"], prompt_len=prompt_len,
                                  chunk=chunk)
        mask = batch["response_mask"]
        nll = losses.nll_loss(logp, mask)
        return nll, {"sft/loss": nll}

    return loss_fn


class Programs(NamedTuple):
    """The jitted programs of an SFT run."""
    step: Callable  # (state, batch) -> (state, metrics); donates the state
    greedy: Callable  # (params, prompt tokens [B, P], prompt mask [B, P], rng) -> SampleOutput: evaluation


def programs(config: ml_collections.ConfigDict, model: CausalLM, tx: optax.GradientTransformation, state_shardings,
             tok, *, backend: str | None = None) -> Programs:
    """The run's programs over a state placed on `state_shardings`. backend: whose training compiler options
    (`compile_options`; default: this host's)."""
    loss_fn = sft_loss_fn(model, chunk=config.task.max_response_len)
    step = jit_training(
        lambda s, b: train_epochs(s, b, jax.random.PRNGKey(0), loss_fn, tx, num_epochs=1, num_minibatches=1),
        backend=backend, in_shardings=(state_shardings, None), out_shardings=(state_shardings, None),
        donate_argnums=0)
    greedy = sampler_from_config(model, config.sampling, max_new_tokens=config.task.max_response_len,
                                 eos_id=builders.stop_ids(config, tok), pad_id=tok.pad_token_id, greedy=True)
    return Programs(step=step, greedy=greedy)


def sft_batch(config: ml_collections.ConfigDict, train, tok, step: int, rows: slice) -> tuple[dict, int]:
    """(this process's rows of step's batch: tokens / attn_mask [B, P+R], response_mask [B, R]; the whole batch's
    real tokens). Each record is taught in the direct style or as a chain of thought (`use_direct_style`)."""
    P, R = config.task.max_prompt_len, config.task.max_response_len
    idx = batch_indices(len(train), config.batch_size, step, config.seed)
    records = train.get_batch(idx)
    direct = use_direct_style(idx, config.seed, direct_fraction(config, step))
    targets = [r["direct"] if d and "direct" in r else r["cot"] for r, d in zip(records, direct)]
    enc = encode_sft(tok, [r["prompt"] for r in records], targets, P, R, truncate=True,
                     add_special_tokens=not train.prompts_have_special_tokens,
                     end_id=builders.stop_ids(config, tok)[-1])
    if config.pad_to_multiple:  # before the row split: every process keeps the same columns
        enc = trim_sft_padding(enc, config.pad_to_multiple)
    num_tokens = int(enc["attention_mask"].sum())
    enc = {k: v[rows] for k, v in enc.items()}
    return {"tokens": enc["tokens"], "attn_mask": enc["attention_mask"] > 0,
            "response_mask": enc["response_mask"].astype(np.float32)}, num_tokens


def run_sft(config: ml_collections.ConfigDict) -> dict:
    """Trains the policy; returns the final evaluation. Resumes from `config.workdir` when it holds a checkpoint."""
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    tok = builders.tokenizer(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    test = builders.prompt_source(config, config.task.test_split, tok)
    verifier = rewards.make_verifier(config.task.name)  # default +1 / -1: only pass@1 is reported
    cfg = builders.policy_model_config(config)
    model, tx = CausalLM(cfg), make_optimizer(config.optim)
    layout = rt_lib.model_state_to_dict(rt_lib.abstract_model_state(model, tx))
    progs = programs(config, model, tx, rt_lib.model_state_from_dict(
        jax.tree.map(lambda x: x.sharding, rt.target(layout))), tok)

    def init(shardings):
        if config.model.hf_path:
            params = load_hf_checkpoint(config.model.hf_path)[1]["params"]
            return jax.device_put(rt_lib.model_state_to_dict(init_model_state(params, tx)), shardings)
        fresh = lambda: rt_lib.model_state_to_dict(  # noqa: E731
            init_model_state(init_params(model, jax.random.PRNGKey(config.seed))["params"], tx))
        return jax.jit(fresh, out_shardings=shardings)()  # initialized in place on the devices

    def evaluate_policy(state) -> dict:
        return evaluate(progs.greedy, state.params, test, tok, verifier, num_prompts=config.eval_prompts,
                        batch_size=min(config.eval_prompts, config.batch_size),
                        max_prompt_len=config.task.max_prompt_len, correct=1.0,
                        rng=jax.random.PRNGKey(config.seed), io=rt,
                        extract_answer=rewards.answer_extractor(config.task.name))

    timer, rows = Timer(), rt.local_rows(config.batch_size)
    with stage_run(config, rt, layout, init, total=config.num_steps, desc="sft", show=("sft/loss",)) as (run, state):
        state = rt_lib.model_state_from_dict(state)
        meta = {"stage": "sft", "model_config": builders.model_config_to_json(cfg), "done": False, "eval": {},
                "provenance": stage_meta.provenance(config, run.meta)}
        for step in range(run.start, config.num_steps):
            with timer.section("data"):
                batch, num_tokens = sft_batch(config, train, tok, step, rows)
                batch = rt.place_batch(batch)
            with timer.section("update"):
                state, m = progs.step(state, batch)
                m = rt.fetch(m)
            m["sft/lr"] = float(learning_rate(config.optim, step))
            m.update(timer.summary(num_tokens=num_tokens))
            run.log(step + 1, m)
            done = step + 1 == config.num_steps
            if (step + 1) % config.eval_every == 0 or done:
                meta["eval"] = run.logger.write(step + 1, evaluate_policy(state))
            if run.save(step + 1, rt_lib.model_state_to_dict(state), dict(meta, done=done), done=done):
                break
        if run.start >= config.num_steps:
            meta["eval"] = run.logger.write(run.start, evaluate_policy(state))
    return meta["eval"]
