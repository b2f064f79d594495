"""Cold-start SFT: next-token NLL on chain-of-thought traces (a share in the short direct-answer style)."""

from __future__ import annotations

import flax.linen as nn
import jax
import ml_collections
import numpy as np

from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
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


def run_sft(config: ml_collections.ConfigDict) -> dict:
    """Trains the policy; returns the final evaluation. Resumes from `config.workdir` when it holds a checkpoint."""
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    tok = builders.tokenizer(config)
    train = builders.prompt_source(config, config.task.train_split, tok)
    test = builders.prompt_source(config, config.task.test_split, tok)
    stop_tokens = builders.stop_ids(config, tok)
    verifier = rewards.make_verifier(config.task.name)  # default +1 / -1: only pass@1 is reported
    if config.model.hf_path:
        cfg, hf_vars = load_hf_checkpoint(config.model.hf_path)
        cfg = builders.with_compute_options(cfg, config)
    else:
        cfg, hf_vars = builders.model_config(config, len(tok)), None
    model = CausalLM(cfg)
    tx = make_optimizer(config.optim)
    P, R = config.task.max_prompt_len, config.task.max_response_len

    def init(shardings):
        if hf_vars is not None:
            return jax.device_put(rt_lib.model_state_to_dict(init_model_state(hf_vars["params"], tx)), shardings)
        fresh = lambda: rt_lib.model_state_to_dict(  # noqa: E731
            init_model_state(init_params(model, jax.random.PRNGKey(config.seed))["params"], tx))
        return jax.jit(fresh, out_shardings=shardings)()  # initialized in place on the devices

    layout = rt_lib.model_state_to_dict(rt_lib.abstract_model_state(model, tx))
    ckpt, state, restored_meta, start = rt_lib.restore_or_init_state(rt, config, layout, init)
    state = rt_lib.model_state_from_dict(state)
    shardings = jax.tree.map(lambda x: x.sharding, state)

    loss_fn = sft_loss_fn(model, chunk=config.task.max_response_len)
    with rt.context():
        step_fn = jit_training(
            lambda s, b: train_epochs(s, b, jax.random.PRNGKey(0), loss_fn, tx, num_epochs=1, num_minibatches=1),
            in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)
    sampler = sampler_from_config(model, config.sampling, max_new_tokens=R, eos_id=stop_tokens,
                                  pad_id=tok.pad_token_id, greedy=True)
    meta = {"stage": "sft", "model_config": builders.model_config_to_json(cfg), "done": False,
            "provenance": stage_meta.provenance(config, restored_meta)}
    correct = 1.0
    last_eval: dict = {}

    def run_eval(step):
        nonlocal last_eval
        last_eval = evaluate(sampler, state.params, test, tok, verifier, num_prompts=config.eval_prompts,
                             batch_size=min(config.eval_prompts, config.batch_size), max_prompt_len=P,
                             correct=correct, rng=jax.random.PRNGKey(config.seed), io=rt)
        logger.write(step, last_eval)

    logger = rt_lib.StepLogger(config, total=config.num_steps, initial=start, desc="sft", show=("sft/loss",))
    timer = Timer()
    rows = rt.local_rows(config.batch_size)  # this process's rows of each batch
    try:
        with ckpt_lib.preemption_guard() as guard, rt.context():
            for step in range(start, config.num_steps):
                with timer.section("data"):
                    idx = batch_indices(len(train), config.batch_size, step, config.seed)
                    records = train.get_batch(idx)
                    direct = use_direct_style(idx, config.seed, direct_fraction(config, step))
                    targets = [r["direct"] if d and "direct" in r else r["cot"] for r, d in zip(records, direct)]
                    enc = encode_sft(tok, [r["prompt"] for r in records], targets, P, R, truncate=True,
                                     add_special_tokens=not train.prompts_have_special_tokens, end_id=stop_tokens[-1])
                    if config.pad_to_multiple:  # before the row split: every process keeps the same columns
                        enc = trim_sft_padding(enc, config.pad_to_multiple)
                    num_tokens = int(enc["attention_mask"].sum())
                    enc = {k: v[rows] for k, v in enc.items()}
                    batch = rt.place_batch({"tokens": enc["tokens"], "attn_mask": enc["attention_mask"] > 0,
                                            "response_mask": enc["response_mask"].astype(np.float32)})
                with timer.section("update"):
                    state, m = step_fn(state, batch)
                    m = rt.fetch(m)
                logger.count_nonfinite(step, float(m["train/nonfinite"]))
                m["sft/lr"] = float(learning_rate(config.optim, step))
                m.update(timer.summary(num_tokens=num_tokens))
                logger.log(step + 1, m)
                done = step + 1 == config.num_steps
                if (step + 1) % config.eval_every == 0 or done:
                    run_eval(step + 1)
                stop = guard.should_stop_any()  # collective: every host saves the same step
                if done or (step + 1) % config.save_every == 0 or stop:
                    ckpt.save(step + 1, rt_lib.model_state_to_dict(state), dict(meta, done=done, eval=last_eval),
                              force=True)
                if stop:
                    logger.print(f"preempted: saved step {step + 1}")
                    break
            if start >= config.num_steps and not last_eval:
                run_eval(start)
    finally:
        ckpt.wait()
        ckpt.close()
        logger.close()
    return last_eval
