"""`--config.dry_run=True` on 8 fake CPU devices: every stage's programs compile against abstract inputs, nothing
is read or written, the resident state matches a hand count, and a config that cannot fit says so."""

import json
import os

import ml_collections
import numpy as np
import pytest

import config_files
from vcppo_jax import stages
from vcppo_jax.models import ModelConfig

MESH = dict(data=2, fsdp=2, tensor=2)
MODEL = dict(hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2, num_kv_heads=2,
             max_position_embeddings=64)


def tiny(name: str, tmp_path, **fields) -> ml_collections.ConfigDict:
    c = config_files.load(name)
    c.workdir = str(tmp_path / "never_written" / name)
    for k in ("sft_dir", "critic_dir"):
        if k in c and c[k]:
            c[k] = str(tmp_path / "never_written" / k)  # no earlier stage exists: a dry run needs none
    c.mesh = ml_collections.ConfigDict(MESH)
    c.model.update(MODEL)
    c.task.update(max_prompt_len=12, max_response_len=16)
    c.update(dict(dry_run=True, progress_bar=False, tensorboard=False))
    if c.stage == "rl":
        c.update(dict(prompts_per_step=4, group_size=2, num_minibatches=2, eval_prompts=8))
    c.update(fields)
    return c


@pytest.mark.parametrize("name,programs", [
    ("vcppo", {"sampler", "experience", "update"}),
    ("value_pretrain", {"sampler", "value_step"}),
])
def test_rl_and_value_stages_plan_without_reading_or_writing(tmp_path, name, programs):
    plan = stages.run_stage(tiny(name, tmp_path))
    assert set(plan["programs"]) == programs and plan["fits"]
    for row in plan["programs"].values():
        assert row["peak"] >= plan["resident_mib"] > 0 and row["temps"] >= 0
    assert not (tmp_path / "never_written").exists()


def test_resident_state_is_params_and_adam_moments_by_hand(tmp_path):
    """GRPO without KL holds the actor's params, Adam's two moments and the drift probe's copy of the SFT params
    (fp32); with data=8 every device holds all of them."""
    plan = stages.run_stage(tiny("grpo", tmp_path, kl_coef=0.0, prompts_per_step=8, mesh=ml_collections.ConfigDict(
        dict(data=8, fsdp=1, tensor=1))))
    assert set(plan["programs"]) == {"sampler", "experience", "update"}
    params = ModelConfig(vocab_size=plan_vocab(), **MODEL, tie_embeddings=True).num_params
    assert plan["params"] == params
    np.testing.assert_allclose(plan["resident_mib"], 4 * 4 * params / 2 ** 20, rtol=1e-3)


def plan_vocab() -> int:
    from vcppo_jax.tokenizer import synthetic_tokenizer  # noqa: PLC0415

    return len(synthetic_tokenizer())


def test_hf_model_from_its_config_json_alone_and_a_plan_that_does_not_fit(tmp_path, capsys):
    """A Qwen3 folder with config.json and a tokenizer but no weights plans the SFT stage; against a device memory
    smaller than its state the plan says so."""
    from vcppo_jax.tokenizer import synthetic_tokenizer  # noqa: PLC0415

    folder = tmp_path / "qwen3"
    os.makedirs(folder)
    synthetic_tokenizer().save_pretrained(folder)
    hf = ModelConfig(vocab_size=plan_vocab(), hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
                     num_kv_heads=1, head_dim=24, model_type="qwen3", tie_embeddings=True).to_hf_dict()
    (folder / "config.json").write_text(json.dumps(hf))
    c = tiny("sft", tmp_path, dry_run_device_memory_gib=1e-4)
    c.model.hf_path = str(folder)
    plan = stages.run_stage(c)
    assert plan["params"] == ModelConfig.from_hf_dict(hf).num_params and set(plan["programs"]) == {"sampler",
                                                                                                   "sft_step"}
    assert not plan["fits"] and plan["device_memory_source"] == "dry_run_device_memory_gib"
    out = capsys.readouterr().out
    assert "DOES NOT FIT" in out and "sft_step" in out
    assert not (tmp_path / "never_written").exists()


def test_flops_count_every_loop_iteration_where_xla_counts_each_body_once():
    """jaxpr_flops against closed forms: a scan of L matmuls is L * 2*M*N*K (XLA's cost_analysis: one), a cond its
    costlier branch, a shard_map's per-shard body once per shard; loop-free, it equals XLA's count of the dots."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from vcppo_jax import dry_run  # noqa: PLC0415

    m, k, n, layers = 8, 16, 32, 5
    x = jax.ShapeDtypeStruct((m, k), jnp.float32)
    w = jax.ShapeDtypeStruct((layers, k, k), jnp.float32)
    head = jax.ShapeDtypeStruct((k, n), jnp.float32)
    one = 2 * m * k * k

    def scanned(x, w, head):
        x, _ = jax.lax.scan(lambda x, w: (x @ w, None), x, w)
        return x @ head

    count = lambda f, *a: dry_run.jaxpr_flops(jax.jit(f).trace(*a).jaxpr.jaxpr)  # noqa: E731
    assert count(scanned, x, w, head) == (layers * one + 2 * m * k * n, True)
    xla = jax.jit(scanned).lower(x, w, head).compile().cost_analysis()["flops"]
    assert xla < 2 * one + 2 * m * k * n  # the scanned body once

    loop_free = lambda x, w, head: (x @ w[0] @ w[1]) @ head  # noqa: E731
    assert count(loop_free, x, w, head)[0] == jax.jit(loop_free).lower(x, w, head).compile().cost_analysis()["flops"]
    branchy = lambda p, x, w: jax.lax.cond(p, lambda: x @ w[0] @ w[1], lambda: x)  # noqa: E731
    assert count(branchy, jax.ShapeDtypeStruct((), bool), x, w) == (2 * one, True)
    looped = lambda x, w: jax.lax.while_loop(lambda c: c[0].sum() < 1, lambda c: (c[0] @ c[1], c[1]), (x, w[0]))[0]
    assert count(looped, x, w) == (one, False)  # trip count unknown: a lower bound

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    spec = jax.sharding.PartitionSpec("data")
    sharded = jax.shard_map(lambda x, w: x @ w, mesh=mesh, in_specs=(spec, jax.sharding.PartitionSpec()),
                            out_specs=spec)
    assert count(sharded, x, jax.ShapeDtypeStruct((k, k), jnp.float32)) == (one, True)  # 8 shards of m / 8 rows


def test_splash_passes_name_their_block_padding_and_the_block_that_pads_less():
    from vcppo_jax import dry_run  # noqa: PLC0415

    c = config_files.load("vcppo")
    c.task.update(max_prompt_len=256, max_response_len=1024)
    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    long_only = dry_run.splash_passes(c, cfg, "tpu")  # default kernel: splash from 1024 tokens, dense below
    assert [(p["length"], p["block"], p["padded"]) for p in long_only] == [(1280, 512, 1536)]
    assert "attention_block_size=256 pads to 1280 only" in long_only[0]["fix"]
    assert dry_run.splash_passes(c, cfg, "cpu") == []  # blockwise there
    both = dry_run.splash_passes(c, cfg.replace(attention_impl="splash", attention_block_size=200), "tpu")
    assert [(p["length"], p["block"], p["padded"]) for p in both] == [(1280, 128, 1280), (256, 128, 256)]
    assert "not a multiple of the kernel's 128 lanes" in both[0]["fix"] and both[1]["fix"] == (
        "model.attention_block_size=200 is not a multiple of the kernel's 128 lanes: blocks of 128 are used")
