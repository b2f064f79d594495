"""`--config.dry_run=True`: will this stage fit? Compiles its programs against abstract inputs and reads XLA's plan.

Builds the mesh, the model config (`config.model`, or the `config.json` of `model.hf_path`: no weights are read),
the stage's abstract train state with its shardings, then lowers and compiles each jitted program of the stage
ahead of time against `jax.ShapeDtypeStruct`s (no weights, no data, no earlier stage needed): the sampler, and the
SFT step / the value step / the RL experience and update steps. For each it prints XLA's per-device memory
(`compiled.memory_analysis()`: arguments, outputs, temporaries, donated buffers) and the peak a device needs while
it runs with the whole train state resident, and whether the largest peak fits the device's memory
(`memory_stats()['bytes_limit']`; on CPU, which reports none, the host's RAM shared by its local devices;
`dry_run_device_memory_gib` overrides both).

The programs are built by the same functions the loops call (`rl.make_experience_fn`, `rl.make_update_fn`,
`value_train.make_value_step`, `sft.sft_loss_fn`, `sampling.make_sampler`) with the loops' shapes and shardings.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vcppo_jax import builders
from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import runtime as rt_lib
from vcppo_jax import sharding
from vcppo_jax.compile_options import jit_training
from vcppo_jax.models import CausalLM, ModelConfig, ValueModel
from vcppo_jax.models.hf import is_hf_checkpoint
from vcppo_jax.optim import ModelState, make_optimizer, train_epochs
from vcppo_jax.sampling import make_sampler
from vcppo_jax.sft import sft_loss_fn
from vcppo_jax.value_train import make_value_step

MIB = 2 ** 20


def model_config(config: ml_collections.ConfigDict) -> ModelConfig:
    """The stage's model from its config alone: the config.json of `model.hf_path` or of an HF folder `sft_dir`,
    or the from-scratch fields."""
    folder = config.model.hf_path or (config.get("sft_dir", "") if is_hf_checkpoint(config.get("sft_dir", "")) else "")
    if folder:
        path = os.path.join(folder, "config.json")
        if not os.path.exists(path):
            raise FileNotFoundError(f"dry run: {path} not found (model.hf_path must be a HF model folder)")
        with open(path) as f:
            return builders.with_compute_options(ModelConfig.from_hf_dict(json.load(f)), config)
    return builders.model_config(config, len(builders.tokenizer(config)))


def _abstract_state(model: nn.Module, tx, rt) -> ModelState:
    return rt.target(rt_lib.abstract_model_state(model, tx))


def _abstract_params(model: nn.Module, rt) -> Any:
    return rt.target(rt_lib.abstract_params(model))


def _batch(rt, **leaves: tuple[tuple[int, ...], Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract global batch arrays split on their leading dim, as `Runtime.place_batch` lays them out."""
    sh = sharding.batch_sharding(rt.mesh)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for k, (shape, dtype) in leaves.items()}


def _replicated(rt, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(rt.mesh,
                                                                                      jax.sharding.PartitionSpec()))


def _sampler_program(actor: CausalLM, config, rt, batch: int, tok, temperature: float):
    """(name, jitted sampler, abstract args) for `batch` prompts of task.max_prompt_len."""
    s = config.sampling
    fn = make_sampler(actor, max_new_tokens=config.task.max_response_len, eos_id=builders.stop_ids(config, tok),
                      pad_id=tok.pad_token_id, temperature=temperature, top_k=s.top_k, top_p=s.top_p,
                      kv_cache_dtype=s.kv_cache_dtype)
    P = config.task.max_prompt_len
    prompts = _batch(rt, tokens=((batch, P), jnp.int32), mask=((batch, P), jnp.int32))
    key = _replicated(rt, jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    return "sampler", fn.__wrapped__, (_abstract_params(actor, rt), prompts["tokens"], prompts["mask"], key)


def programs(config: ml_collections.ConfigDict, rt, cfg: ModelConfig) -> tuple[list, Any]:
    """[(name, jitted fn, abstract args)] of the stage's programs, and its abstract resident state."""
    tok = builders.tokenizer(config)
    P, R = config.task.max_prompt_len, config.task.max_response_len
    actor = CausalLM(cfg)
    key = _replicated(rt, jax.eval_shape(lambda: jax.random.PRNGKey(0)))
    if config.stage == "sft":
        tx = make_optimizer(config.optim)
        state = _abstract_state(actor, tx, rt)
        loss_fn = sft_loss_fn(actor, chunk=R)
        step = jit_training(lambda s, b: train_epochs(s, b, jax.random.PRNGKey(0), loss_fn, tx, num_epochs=1,
                                                      num_minibatches=1), donate_argnums=0)
        b = config.batch_size
        batch = _batch(rt, tokens=((b, P + R), jnp.int32), attn_mask=((b, P + R), bool),
                       response_mask=((b, R), jnp.float32))
        return [_sampler_program(actor, config, rt, min(config.eval_prompts, b), tok, 0.0),
                ("sft_step", step, (state, batch))], state
    b = config.prompts_per_step * config.group_size
    rollout = rl.Rollout(**_batch(rt, tokens=((b, P + R), jnp.int32), attn_mask=((b, P + R), bool),
                                  response_mask=((b, R), jnp.float32), rewards=((b, R), jnp.float32),
                                  seq_rewards=((b,), jnp.float32), sample_logp=((b, R), jnp.float32)))
    sampler = _sampler_program(actor, config, rt, b, tok, config.sampling.temperature)
    if config.stage in ("value_pretrain", "reward_model"):
        critic, tx = ValueModel(cfg), make_optimizer(config.optim)
        state = _abstract_state(critic, tx, rt)
        step = jit_training(make_value_step(critic, tx, prompt_len=P, gamma=config.gamma,
                                            eos_only=config.stage == "reward_model",
                                            num_minibatches=config.num_minibatches,
                                            truncated_fraction=config.truncated_fraction,
                                            truncated_reward=config.reward_wrong), donate_argnums=0)
        # The sampling policy's params stay resident beside the critic's state.
        return [sampler, ("value_step", step, (state, rollout, key))], (state, sampler[2][0])
    hp = rl.RLHparams.from_config(config)
    critic = ValueModel(cfg) if hp.has_critic else None
    actor_tx = make_optimizer(config.actor_optim)
    critic_tx = make_optimizer(config.critic_optim) if hp.has_critic else None
    state = rl.RLState(actor=_abstract_state(actor, actor_tx, rt),
                       critic=_abstract_state(critic, critic_tx, rt) if hp.has_critic else None,
                       ref_params=_abstract_params(actor, rt) if config.kl_coef > 0 else None,
                       rng=key, step=_replicated(rt, jax.ShapeDtypeStruct((), jnp.int32)))
    experience_fn = jit_training(rl.make_experience_fn(hp, actor, critic))
    with rt.context():
        experience, _ = jax.eval_shape(experience_fn, state, rollout)
    experience = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(rt.mesh)), experience)
    update_fn = jit_training(rl.make_update_fn(hp, actor, critic, actor_tx, critic_tx), donate_argnums=0)
    # Without a reference policy in the state, the drift probe holds a copy of the SFT params (rl_loop.run_rl).
    sft_copy = _abstract_params(actor, rt) if config.eval_kl_to_sft and state.ref_params is None else None
    return [sampler, ("experience", experience_fn, (state, rollout)), ("update", update_fn, (state, experience))], \
        (state, sft_copy)


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of an abstract sharded tree (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def device_memory_bytes(config: ml_collections.ConfigDict) -> tuple[int, str]:
    """(bytes one device may use, where that number comes from)."""
    if config.dry_run_device_memory_gib > 0:
        return int(config.dry_run_device_memory_gib * 2 ** 30), "dry_run_device_memory_gib"
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count(), f"host RAM / {jax.local_device_count()} local {device.platform} devices"


def plan(config: ml_collections.ConfigDict, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Compiles the stage's programs (module docstring); prints and returns the plan (sizes in MiB per device)."""
    config_lib.validate(config)
    rt = rt_lib.make_runtime(config)
    cfg = model_config(config)
    progs, resident = programs(config, rt, cfg)
    resident_b = _bytes_per_device(resident)
    limit, source = device_memory_bytes(config)
    out: dict[str, Any] = {"stage": config.stage, "params": cfg.num_params, "resident_mib": resident_b / MIB,
                           "device_memory_mib": limit / MIB, "device_memory_source": source, "programs": {}}
    mesh = dict(rt.mesh.shape)
    print_fn(f"[dry_run] {config.stage}: {cfg.model_type} {cfg.num_params / 1e6:.2f}M params, mesh {mesh} over "
             f"{rt.mesh.devices.size} {jax.devices()[0].platform} devices; resident state {resident_b / MIB:.1f} "
             f"MiB/device")
    print_fn(f"  {'program':<12} {'args':>10} {'outputs':>10} {'temps':>10} {'donated':>10} {'peak':>10}  MiB/device")
    with rt.context():
        for name, fn, args in progs:
            mem = fn.lower(*args).compile().memory_analysis()
            sizes = {"args": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                     "temps": mem.temp_size_in_bytes, "donated": mem.alias_size_in_bytes}
            # The resident state is in memory whether or not this program takes all of it as an argument.
            peak = max(resident_b, sizes["args"]) + sizes["outputs"] + sizes["temps"] - sizes["donated"]
            row = {k: v / MIB for k, v in sizes.items()} | {"peak": peak / MIB}
            out["programs"][name] = row
            print_fn(f"  {name:<12} " + " ".join(f"{row[k]:>10.1f}" for k in ("args", "outputs", "temps", "donated",
                                                                              "peak")))
    worst = max(out["programs"].items(), key=lambda kv: kv[1]["peak"])
    out["fits"] = worst[1]["peak"] * MIB <= limit
    print_fn(f"  largest peak {worst[1]['peak']:.1f} MiB/device ({worst[0]}) vs device memory {limit / MIB:.0f} MiB "
             f"({source}): {'fits' if out['fits'] else 'DOES NOT FIT'}")
    return out
