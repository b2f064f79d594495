"""The whole pipeline on a tiny model and task: sharded RL step, resume, stage reuse, input errors, halting.

The stages run once into a module-scoped directory (VC-PPO runs SFT and value pretraining itself, PPO then trains
its reward model, GRPO reuses the SFT run) and every test builds on those checkpoints. The loops jit fresh closures
on each call, so a repeated run (resume, fallback, ...) would compile the same programs again; the session's
persistent compilation cache (conftest.py) lets it load them instead (compiling the update dominates on CPU).
"""

import json
import logging
import math
import os
import pathlib
import shutil
import signal
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from testutil import random_params
import config_files
import gradient_noise
from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import rl
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stage_meta
from vcppo_jax import stages
from vcppo_jax import value_train
from vcppo_jax.config import ConfigError
from vcppo_jax.metrics import METRICS_FILE
from vcppo_jax.models import CausalLM, ValueModel
from vcppo_jax.optim import init_model_state, learning_rate, make_optimizer
from vcppo_jax.rl_loop import run_rl
from vcppo_jax.sft import run_sft

REPO = pathlib.Path(__file__).resolve().parents[1]
ALGORITHMS = ("vcppo", "ppo", "grpo")
MESH = dict(data=2, fsdp=2, tensor=2)  # 8 fake CPU devices (conftest)
KNOBS = dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2, num_train=64, num_test=16)
CRITIC_STAGE = {"vcppo": "value_pretrain", "ppo": "reward_model", "grpo": None, "drgrpo": None, "dapo": None,
                "vapo": "value_pretrain"}
TRAIN_KEYS = ("rollout/response_length_mean", "rollout/accuracy", "policy/clipfrac", "policy/approx_kl",
              "policy/entropy", "policy/grad_norm", "policy/lr", "perf/tokens_per_s", "perf/step_time_s",
              "diag/adv_early_bias", "rollout/sampler_logp_gap")
CRITIC_KEYS = ("value/loss", "value/explained_var", "diag/value_pos00")
EVAL_KEYS = ("eval/pass@1", "eval/response_length_mean", "probe/pass@1", "probe/response_length_mean")


def tiny_config(algorithm: str, root, **overrides) -> ml_collections.ConfigDict:
    """configs/<algorithm>.py shrunk to seconds; earlier stages live beside it in `root` (and are shrunk too)."""
    root = pathlib.Path(root)
    c = config_files.load(algorithm)
    c.workdir = str(root / algorithm)
    c.sft_dir = str(root / "sft")
    c.critic_dir = str(root / CRITIC_STAGE[algorithm]) if CRITIC_STAGE[algorithm] else ""
    c.mesh = ml_collections.ConfigDict(MESH)
    c.model.update(hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2, num_kv_heads=2,
                   max_position_embeddings=64)
    c.task.update(max_prompt_len=12, max_response_len=16, knobs=ml_collections.ConfigDict(KNOBS))
    c.update(dict(num_steps=2, prompts_per_step=4, group_size=2, num_minibatches=2, eval_prompts=8, diag_buckets=4,
                  diag_early_tokens=4, logprob_chunk=8, save_every=1, progress_bar=False, tensorboard=False))
    c.stage_overrides.sft.update(dict(num_steps=3, batch_size=8))
    for stage in ("value_pretrain", "reward_model"):
        c.stage_overrides[stage].update(dict(max_steps=2, min_steps=1, prompts_per_step=4, group_size=2))
    c.update(overrides)
    return c


def with_fields(config: ml_collections.ConfigDict, **fields) -> ml_collections.ConfigDict:
    """A copy of `config` with top-level fields replaced (paths as str)."""
    c = ml_collections.ConfigDict(config.to_dict())
    c.update({k: str(v) if isinstance(v, pathlib.Path) else v for k, v in fields.items()})
    return c


def read_metrics(workdir) -> list[dict]:
    with open(pathlib.Path(workdir) / METRICS_FILE) as f:
        return [json.loads(line) for line in f]


def saved_steps(workdir) -> list[int]:
    with ckpt_lib.Checkpointer(workdir) as ckpt:
        return ckpt.all_steps()


def model_config(workdir):
    return builders.model_config_from_json(ckpt_lib.read_meta(workdir)["model_config"])


def load(workdir, model: nn.Module, key: str):
    """The params subtree `key` of the newest checkpoint in `workdir`, as numpy."""
    target = nn.unbox(rt_lib.abstract_params(model))
    return jax.device_get(ckpt_lib.load_params(workdir, target, key=key))


def assert_trees_close(got, want, **tol):
    jax.tree.map(lambda g, w: np.testing.assert_allclose(np.asarray(g), np.asarray(w), **tol), got, want)


def assert_same_rl_state(workdir, reference):
    cfg = model_config(reference)
    for model, key in ((CausalLM(cfg), "actor/params"), (ValueModel(cfg), "critic/critic_params")):
        assert_trees_close(load(workdir, model, key), load(reference, model, key), rtol=0, atol=1e-6)


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("pipeline")


@pytest.fixture(scope="module")
def runs(root) -> dict:
    """{algorithm: (config, returned evaluation)} after one `run_stage` call each, in pipeline order."""
    out = {}
    for algorithm in ALGORITHMS:
        config = tiny_config(algorithm, root)
        out[algorithm] = (config, stages.run_stage(config))
    return out


# ---------------------------------------------------------------------------------------------------------------
# End to end: every stage completes, logs the documented metrics and is reused by the next call.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_pipeline_completes_and_logs_documented_metrics(runs, algorithm):
    config, result = runs[algorithm]
    records = read_metrics(config.workdir)
    train = [r for r in records if "policy/clipfrac" in r]
    evals = [r for r in records if "eval/pass@1" in r]
    assert [r["step"] for r in train] == [1, 2] and [r["step"] for r in evals] == [0, 2]
    has_critic = algorithm != "grpo"
    for r in train:
        for k in TRAIN_KEYS + (CRITIC_KEYS if has_critic else ()):
            assert isinstance(r.get(k), float) and math.isfinite(r[k]), (k, r.get(k))
        assert has_critic or not any(k in r for k in CRITIC_KEYS)  # GRPO has no critic to report
        # The lr of the iteration's last optimizer update: the schedule counts minibatch updates, not RL steps.
        updates = r["step"] * config.num_epochs * config.num_minibatches
        assert r["policy/lr"] == pytest.approx(learning_rate(config.actor_optim, updates - 1), rel=1e-6)
    for r in evals:
        for k in EVAL_KEYS:
            assert 0 <= r[k] <= (1 if k == "eval/pass@1" else config.task.max_response_len), (k, r[k])
    assert result == {k: v for k, v in evals[-1].items() if k != "step"}
    # Step 0 evaluates the SFT policy itself: its sampled drift from the SFT policy is zero.
    assert abs(evals[0]["probe/kl_to_sft"]) < 1e-5 and math.isfinite(evals[-1]["probe/kl_to_sft"])

    meta = ckpt_lib.read_meta(config.workdir)
    assert meta["done"] and meta["algorithm"] == algorithm and saved_steps(config.workdir) == [1, 2]
    assert ckpt_lib.read_meta(config.sft_dir)["stage"] == "sft"
    if has_critic:
        critic_meta = ckpt_lib.read_meta(config.critic_dir)
        assert critic_meta["done"] and critic_meta["stage"] == CRITIC_STAGE[algorithm]


def test_dr_grpo_is_grpo_without_its_two_normalizations_and_runs(runs, root):
    grpo, drgrpo = config_files.load("grpo"), config_files.load("drgrpo")
    differ = {k for k in grpo.keys() if k != "workdir" and grpo[k] != drgrpo[k]}
    assert differ == {"algorithm", "grpo_normalize_std", "loss_agg"} and drgrpo.loss_agg == "seq-mean-token-sum-norm"
    config = tiny_config("drgrpo", root)  # the tiny pipeline's SFT policy (built by `runs`)
    stages.run_stage(config)
    train = [r for r in read_metrics(config.workdir) if "policy/clipfrac" in r]
    assert [r["step"] for r in train] == [1, 2]
    assert all(math.isfinite(r["policy/approx_kl"]) and math.isfinite(r["policy/grad_norm"]) for r in train)
    assert ckpt_lib.read_meta(config.workdir)["algorithm"] == "drgrpo" and config.workdir != runs["grpo"][0].workdir


def test_dapo_trains_on_filtered_shaped_groups_and_reports_the_verifiers_rewards(runs, root):
    grpo, dapo = config_files.load("grpo"), config_files.load("dapo")
    differ = {k for k in grpo.keys() if k != "workdir" and grpo[k] != dapo[k]}
    assert differ == {"algorithm", "clip_high", "kl_coef", "group_filter", "reward_shaping", "overlong_buffer"}
    config = tiny_config("dapo", root, overlong_buffer=4)
    stages.run_stage(config)
    train = [r for r in read_metrics(config.workdir) if "policy/clipfrac" in r]
    assert [r["step"] for r in train] == [1, 2]
    for r in train:
        rounds, filled = r["rollout/sampling_rounds"], r["rollout/groups_filled"]
        assert rounds in (1, 2, 3) and (filled == 0 or rounds == config.max_sampling_rounds)
        # Stats are of the verifier's +-1 rewards, not the shaped ones the update trained on.
        assert r["rollout/reward_mean"] == pytest.approx(2 * r["rollout/accuracy"] - 1, abs=1e-6)


def test_vapo_is_vcppo_with_its_three_changes_and_runs(runs, root):
    vcppo, vapo = config_files.load("vcppo"), config_files.load("vapo")
    differ = {k for k in vcppo.keys() if k != "workdir" and vcppo[k] != vapo[k]}
    assert differ == {"algorithm", "adaptive_lambda", "clip_high", "nll_coef"}
    config = tiny_config("vapo", root)  # value pretraining of the tiny pipeline (built by `runs`)
    stages.run_stage(config)
    train = [r for r in read_metrics(config.workdir) if "policy/clipfrac" in r]
    assert [r["step"] for r in train] == [1, 2] and all(math.isfinite(r["policy/nll_loss"]) for r in train)


def test_gradient_noise_measures_the_runs_own_batches(runs, root, tmp_path):
    """experiments/gradient_noise.py on the tiny GRPO run's config: its batch 0 is the run's first rollout (same
    policy, prompts and sampling key); its scratch gradients are deleted once the statistics are read."""
    # The policy-gradient term alone; the tiny policy never answers right, so its groups differ only in the
    # length penalty of 'overlong' shaping. Neither changes what it samples: the batches are the run's.
    config = tiny_config("grpo", root, kl_coef=0.0, reward_shaping="overlong", overlong_buffer=4)
    setup = gradient_noise.Setup(config)
    got = gradient_noise.measure_arm(setup, "rewards", 3, str(tmp_path), log=lambda line: None)
    first = read_metrics(runs["grpo"][0].workdir)[1]  # [0] is the evaluation at step 0
    assert first["step"] == 1 and [b["step"] for b in got["batches"]] == [0, 1, 2]
    assert got["batches"][0]["reward_mean"] == pytest.approx(first["rollout/reward_mean"], abs=1e-6)
    assert got["batches"][0]["response_length_mean"] == pytest.approx(first["rollout/response_length_mean"])
    assert all(0 <= b["groups_with_gradient"] <= config.prompts_per_step for b in got["batches"])
    for metric in gradient_noise.METRICS:
        assert got[metric]["noise"] > 0 and math.isfinite(got[metric]["signal_fraction_se"])
    assert list(tmp_path.iterdir()) == []  # the group gradients are gone


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_second_call_reuses_finished_stages(runs, algorithm):
    config, result = runs[algorithm]
    dirs = [config.sft_dir, config.workdir] + ([config.critic_dir] if config.critic_dir else [])
    snapshot = lambda: {d: (saved_steps(d), len(read_metrics(d))) for d in dirs}  # noqa: E731
    before = snapshot()
    assert stages.run_stage(config) == result
    assert snapshot() == before


# ---------------------------------------------------------------------------------------------------------------
# Sharded vs single-device RL step.
# ---------------------------------------------------------------------------------------------------------------


def random_rollout(rs: np.random.RandomState, batch: int, prompt_len: int, resp_len: int, vocab: int) -> dict:
    """A rollout in the shared layout: left-padded prompts, right-padded responses, +-1 at the last token."""
    p_len = rs.randint(1, prompt_len + 1, size=batch)
    r_len = rs.randint(1, resp_len + 1, size=batch)
    prompt_mask = np.arange(prompt_len)[None] >= (prompt_len - p_len)[:, None]
    resp_mask = np.arange(resp_len)[None] < r_len[:, None]
    attn = np.concatenate([prompt_mask, resp_mask], 1)
    seq_rewards = np.where(rs.rand(batch) > 0.5, 1.0, -1.0).astype(np.float32)
    rewards = np.zeros((batch, resp_len), np.float32)
    rewards[np.arange(batch), r_len - 1] = seq_rewards
    return rl.Rollout(tokens=(rs.randint(1, vocab, size=attn.shape) * attn).astype(np.int32), attn_mask=attn,
                      response_mask=resp_mask.astype(np.float32), rewards=rewards, seq_rewards=seq_rewards)


def test_sharded_rl_step_matches_single_device(runs):
    """make_experience + update on the (data=2, fsdp=2, tensor=2) mesh, jitted with the shardings `run_rl` uses,
    equal the single-device run. Tolerances: experience and metrics atol 1e-5 / rtol 1e-4 (float32 sums reduced in
    another order across shards; seen <= 1.5e-6). Params atol 2e-6, under a tenth of the ~lr (>= 3e-5) that each
    Adam step moves them (seen <= 3e-8), except the key-projection bias: softmax is invariant to it, so its gradient
    is pure rounding noise that Adam rescales to up to lr per step; there the bound is Adam's own, steps * lr.
    """
    config, _ = runs["vcppo"]
    hp = rl.RLHparams.from_config(config)
    cfg = builders.model_config_from_json(ckpt_lib.read_meta(config.sft_dir)["model_config"], config)
    actor, critic = CausalLM(cfg), ValueModel(cfg)
    # No warmup here: every update moves every weight by ~lr, far above the sharded-vs-single tolerance.
    actor_optim = ml_collections.ConfigDict(dict(config.actor_optim.to_dict(), warmup_steps=0))
    actor_tx, critic_tx = make_optimizer(actor_optim), make_optimizer(config.critic_optim)
    state = rl.RLState(actor=init_model_state(random_params(actor, 0)["params"], actor_tx),
                       critic=init_model_state(random_params(critic, 1)["params"], critic_tx), ref_params=None,
                       rng=jax.random.PRNGKey(config.seed), step=jnp.zeros((), jnp.int32))
    rollout = random_rollout(np.random.RandomState(0), config.prompts_per_step * config.group_size,
                             config.task.max_prompt_len, config.task.max_response_len, cfg.vocab_size)
    initial = jax.device_get(state)  # device_put may alias these buffers, which the sharded update donates
    make_experience = rl.make_experience_fn(hp, actor, critic)
    update = rl.make_update_fn(hp, actor, critic, actor_tx, critic_tx)

    exp_1, m_exp_1 = jax.jit(make_experience)(state, rollout)
    state_1, m_up_1 = jax.device_get(jax.jit(update)(state, exp_1))

    rt = rt_lib.make_runtime(config)
    replicated = jax.sharding.NamedSharding(rt.mesh, jax.sharding.PartitionSpec())
    shardings = lambda model, tx: jax.tree.map(  # noqa: E731
        lambda t: t.sharding, rt.target(rt_lib.abstract_model_state(model, tx)))
    state_sh = rl.RLState(actor=shardings(actor, actor_tx), critic=shardings(critic, critic_tx), ref_params=None,
                          rng=replicated, step=replicated)
    with rt.context():
        exp_8, m_exp_8 = jax.jit(make_experience, in_shardings=(state_sh, None))(
            jax.device_put(state, state_sh), rt.place_batch(rollout))
        state_8, m_up_8 = jax.jit(update, in_shardings=(state_sh, None), out_shardings=(state_sh, None),
                                  donate_argnums=0)(jax.device_put(state, state_sh), exp_8)
    # The mesh really splits the state: some actor param is sharded over both 'fsdp' and 'tensor'.
    specs = {tuple(x.sharding.spec) for x in jax.tree.leaves(state_8.actor.params)}
    assert any("fsdp" in s and "tensor" in s for s in specs), specs
    assert exp_8.advantages.sharding.spec[0] == ("data", "fsdp")

    tol = dict(atol=1e-5, rtol=1e-4)
    assert_trees_close(jax.device_get(exp_8), jax.device_get(exp_1), **tol)
    assert_trees_close(jax.device_get(m_exp_8), jax.device_get(m_exp_1), **tol)
    assert_trees_close(jax.device_get(m_up_8), m_up_1, **tol)
    state_8 = jax.device_get(state_8)
    for net, lr in (("actor", actor_optim.lr), ("critic", config.critic_optim.lr)):
        before, single, sharded = (jax.tree_util.tree_flatten_with_path(getattr(s, net).params)[0]
                                   for s in (initial, state_1, state_8))
        for (path, p0), (_, p1), (_, p8) in zip(before, single, sharded):
            name = jax.tree_util.keystr(path)
            degenerate = "k_proj" in name and "bias" in name
            np.testing.assert_allclose(p8, p1, rtol=0, atol=2 * hp.num_minibatches * lr if degenerate else 2e-6,
                                       err_msg=f"{net} {name}")
            if not degenerate:  # the comparison is not vacuous: every other tensor moved by ~lr
                assert np.abs(p1 - p0).max() > 0.5 * lr, (net, name)
    assert int(state_8.actor.step) == int(state_1.actor.step) == hp.num_minibatches


# ---------------------------------------------------------------------------------------------------------------
# Resume and checkpoint fallback.
# ---------------------------------------------------------------------------------------------------------------


def test_rl_resume_matches_uninterrupted_run(root, runs):
    """Killed after step 1 (a 1-step run), resumed to step 2: same params and step-2 metrics as one 2-step run."""
    config, _ = runs["vcppo"]
    workdir = root / "vcppo_resumed"
    run_rl(with_fields(config, workdir=workdir, num_steps=1))
    assert saved_steps(workdir) == [1]
    result = run_rl(with_fields(config, workdir=workdir, num_steps=2))
    assert saved_steps(workdir) == [1, 2]
    assert_same_rl_state(workdir, config.workdir)
    assert result == runs["vcppo"][1]
    step2 = lambda d: {k: v for r in read_metrics(d) if r["step"] == 2 and "policy/clipfrac" in r  # noqa: E731
                       for k, v in r.items() if not k.startswith("perf/")}
    assert step2(workdir) == step2(config.workdir)


def test_sft_resume_matches_uninterrupted_run(root, runs):
    config, _ = runs["vcppo"]
    sft = stages.derived_config(config, "sft", str(root / "sft_resumed"))
    run_sft(with_fields(sft, num_steps=2))
    run_sft(with_fields(sft, num_steps=3))
    assert saved_steps(sft.workdir) == [2, 3]
    model = CausalLM(model_config(config.sft_dir))
    assert_trees_close(load(sft.workdir, model, "params"), load(config.sft_dir, model, "params"), rtol=0, atol=1e-6)


def test_sigterm_saves_the_finished_step_and_stops(root, runs, monkeypatch):
    """SIGTERM (TPU preemption) during a run: the loop saves the step it finished and exits; a rerun completes it
    with the same params as the uninterrupted run."""
    config, _ = runs["vcppo"]
    workdir = root / "vcppo_preempted"
    log = rt_lib.StepLogger.log

    def log_then_sigterm(self, step, metrics, **kw):
        log(self, step, metrics, **kw)
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(rt_lib.StepLogger, "log", log_then_sigterm)
    run_rl(with_fields(config, workdir=workdir, save_every=100))  # no periodic save: step 1 is the guard's
    assert saved_steps(workdir) == [1] and not ckpt_lib.read_meta(workdir)["done"]
    monkeypatch.undo()
    run_rl(with_fields(config, workdir=workdir, save_every=100))
    assert saved_steps(workdir) == [1, 2]
    assert_same_rl_state(workdir, config.workdir)


def test_fresh_start_refuses_a_workdir_with_checkpoints(runs):
    """resume=False on a finished run's workdir fails up front and leaves its checkpoints as they were."""
    config, _ = runs["vcppo"]
    before = saved_steps(config.workdir)
    with pytest.raises(FileExistsError, match="already holds checkpoints"):
        run_rl(with_fields(config, resume=False))
    assert saved_steps(config.workdir) == before


def test_corrupt_latest_checkpoint_falls_back_to_previous(root, runs, caplog):
    config, _ = runs["vcppo"]
    workdir = root / "vcppo_corrupt"
    shutil.copytree(config.workdir, workdir)
    files = [f for f in (workdir / "2" / "state").rglob("*") if f.is_file()]
    assert files
    for f in files:
        f.write_bytes(b"not a checkpoint")
    with caplog.at_level(logging.WARNING):
        run_rl(with_fields(config, workdir=workdir))
    assert "checkpoint step 2" in caplog.text and "unreadable" in caplog.text
    assert [p.name.split(".")[0] for p in (workdir / ckpt_lib.CORRUPT_SUBDIR).iterdir()] == ["2"]
    assert saved_steps(workdir) == [1, 2]  # step 2 recomputed from step 1
    assert_same_rl_state(workdir, config.workdir)


# ---------------------------------------------------------------------------------------------------------------
# Provenance: a finished stage built for another run is never used silently.
# ---------------------------------------------------------------------------------------------------------------


def test_each_stage_records_what_it_was_built_from(runs):
    config, _ = runs["vcppo"]
    sft, vpt, rl = (ckpt_lib.read_meta(d)["provenance"] for d in (config.sft_dir, config.critic_dir, config.workdir))
    assert sft["upstream"] == {} and len({sft["run_id"], vpt["run_id"], rl["run_id"]}) == 3
    assert vpt["upstream"] == {"sft": sft["run_id"]}
    assert rl["upstream"] == {"sft": sft["run_id"], "value_pretrain": vpt["run_id"]}
    assert rl["settings"] == sft["settings"] == stage_meta.settings(config)
    assert ckpt_lib.read_meta(config.workdir, step=1)["provenance"] == rl  # the same run id at every step


@pytest.fixture(scope="module")
def other_sft(root, runs):
    """A second SFT run of the same settings: same data and model, another run id."""
    sft = stages.derived_config(runs["vcppo"][0], "sft", str(root / "sft_other"))
    run_sft(sft)
    return sft.workdir


def test_critic_of_another_sft_policy_is_refused_or_rebuilt(root, runs, other_sft):
    """A value-pretrained critic fit on samples of SFT run A, used with SFT run B: without run_missing_stages an
    error naming both before anything runs; with it, the critic is moved aside (kept) and value pretraining reruns
    on B's samples."""
    config, _ = runs["vcppo"]
    critic = root / "critic_of_a"
    shutil.copytree(config.critic_dir, critic)
    ids = {d: ckpt_lib.read_meta(d)["provenance"]["run_id"] for d in (config.sft_dir, other_sft)}
    rl = with_fields(config, workdir=root / "vcppo_on_b", sft_dir=other_sft, critic_dir=critic,
                     run_missing_stages=False)
    with pytest.raises(ValueError, match=rf"value_pretrain in {critic} was not built for this run: it was built "
                                         rf"from sft run {ids[config.sft_dir]}, but {other_sft} holds run "
                                         rf"{ids[other_sft]}"):
        stages.run_stage(rl)
    assert not (root / "vcppo_on_b").exists() and stages.stage_done(str(critic))
    stages.run_stage(with_fields(rl, run_missing_stages=True))
    moved = root / "critic_of_a.stale-{}".format(ckpt_lib.read_meta(config.critic_dir)["provenance"]["run_id"])
    assert stages.stage_done(str(moved))  # the stale critic is kept, not deleted
    assert ckpt_lib.read_meta(critic)["provenance"]["upstream"] == {"sft": ids[other_sft]}
    assert ckpt_lib.read_meta(root / "vcppo_on_b")["provenance"]["upstream"]["sft"] == ids[other_sft]


def test_changed_task_settings_make_finished_stages_stale(root, runs):
    config, _ = runs["grpo"]
    changed = with_fields(config, workdir=root / "grpo_new_task", run_missing_stages=False)
    changed.task.knobs.num_test = KNOBS["num_test"] + 8
    with pytest.raises(ValueError, match=r"sft in .* was not built for this run: its task settings .*num_test"):
        stages.run_stage(changed)


def test_other_length_caps_make_the_critic_stale_not_the_sft_policy(root, runs):
    """A critic fit to responses cut at another cap (a shrunken smoke run's) is not this run's critic; the SFT
    policy, trained on whole records, still is."""
    config, _ = runs["vcppo"]
    shorter = with_fields(config, workdir=root / "vcppo_shorter", run_missing_stages=False)
    shorter.task.max_response_len = config.task.max_response_len - 4
    with pytest.raises(ValueError, match=r"^value_pretrain in .* was not built for this run: its task settings "
                                         r".*'max_response_len': 16"):
        stages.run_stage(shorter)
    assert [s for s, _, _ in stages.stale_stages(shorter)] == ["value_pretrain"]


def test_a_critic_recorded_without_length_caps_is_not_held_to_them():
    want = {"task": {"name": "synthetic", "max_prompt_len": 12, "max_response_len": 16}, "model": {"layers": 1}}
    old = {"task": {"name": "synthetic"}, "model": {"layers": 1}}  # written before the caps were recorded
    assert stage_meta.settings_differ(old, want) == []
    assert stage_meta.settings_differ({**old, "task": {"name": "synthetic", "max_response_len": 8}}, want) == ["task"]
    assert stage_meta.settings_differ({**old, "model": {"layers": 2}}, want) == ["model"]


def test_resuming_on_another_upstream_run_is_refused(root, runs, other_sft):
    config, _ = runs["grpo"]
    workdir = root / "grpo_moved_sft"
    shutil.copytree(config.workdir, workdir)
    with pytest.raises(ValueError, match=rf"{workdir} was started from sft run .*, but sft in {other_sft} is now "
                                         r"run .*: resuming would mix the two"):
        stages.run_stage(with_fields(config, workdir=workdir, sft_dir=other_sft))


# ---------------------------------------------------------------------------------------------------------------
# Bad input fails before anything compiles.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ["vcppo", "ppo"])
def test_missing_critic_checkpoint_names_the_stage(root, runs, algorithm):
    workdir = root / f"{algorithm}_no_critic"
    config = with_fields(runs[algorithm][0], workdir=workdir, critic_dir=root / "nowhere", run_missing_stages=False)
    stage = CRITIC_STAGE[algorithm]
    with pytest.raises(FileNotFoundError, match=f"no finished {stage} checkpoint .*train the {stage} stage there"):
        stages.run_stage(config)
    assert not workdir.exists()


@pytest.mark.parametrize("fields,message", ids=["rollout_batch", "minibatch", "eval_batch"], argvalues=[
    (dict(prompts_per_step=3, group_size=2, num_minibatches=1),
     r"prompts_per_step\*group_size=6 is not divisible by data\*fsdp=8"),
    (dict(prompts_per_step=8, group_size=2, num_minibatches=4),
     r"prompts_per_step\*group_size/num_minibatches=4 is not divisible by data\*fsdp=8"),
    (dict(prompts_per_step=4, group_size=2, num_minibatches=1, eval_prompts=4),
     r"min\(eval_prompts, prompts_per_step\*group_size\)=4 is not divisible by data\*fsdp=8"),
])
def test_mesh_batch_mismatch_fails_before_any_stage_runs(tmp_path, fields, message):
    config = tiny_config("vcppo", tmp_path, mesh=ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1)),
                         **fields)
    with pytest.raises(ValueError, match=message):
        stages.run_stage(config)
    assert list(tmp_path.iterdir()) == []  # not even SFT started


@pytest.mark.parametrize("fields,message", ids=["range", "choice", "divisibility"], argvalues=[
    (dict(lambda_actor=1.5), r"config\.lambda_actor=1\.5 is invalid: must be in \[0\.0, 1\.0\]"),
    (dict(critic_init="none"), r"config\.critic_init='none' is invalid: must be one of \('value_pretrain', "),
    (dict(num_minibatches=3), r"config\.num_minibatches=3 must divide .*=8"),
])
def test_config_errors(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        stages.run_stage(tiny_config("vcppo", tmp_path, **fields))
    assert list(tmp_path.iterdir()) == []


def test_cli_reports_bad_config_in_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(REPO / "experiments/train.py"), f"--config={REPO}/configs/vcppo.py",
                           "--config.lambda_actor=1.5"], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1
    assert "error: config.lambda_actor=1.5 is invalid" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == []


def test_bad_stage_override_fails_before_sft_runs(tmp_path):
    config = tiny_config("vcppo", tmp_path)
    config.stage_overrides.value_pretrain.min_steps = 5  # > max_steps = 2
    with pytest.raises(ConfigError, match=r"config\.min_steps=5 is invalid: must be <= config\.max_steps=2"):
        stages.run_stage(config)
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------------------------
# Non-finite steps halt the loop.
# ---------------------------------------------------------------------------------------------------------------


def test_step_logger_halts_after_max_bad_steps_in_a_row(tmp_path):
    config = ml_collections.ConfigDict(dict(workdir=str(tmp_path), tensorboard=False, log_every=1, max_bad_steps=3,
                                            progress_bar=False))
    logger = rt_lib.StepLogger(config, total=8, initial=0, desc="test", show=())
    for step, nonfinite in enumerate([2.0, 1.0, 0.0, 1.0, 4.0]):  # a good step resets the count
        logger.count_nonfinite(step, nonfinite)
    assert logger.bad_in_a_row == 2
    with pytest.raises(FloatingPointError, match=r"3 steps in a row .*max_bad_steps=3"):
        logger.count_nonfinite(5, 1.0)
    logger.close()


def test_nonfinite_rl_steps_halt_without_saving(root, runs):
    """A diverged (NaN) critic makes every update non-finite: the run halts at the `max_bad_steps`-th bad step in a
    row without saving it (step 1 was saved by save_every=1 after one bad, skipped update)."""
    config, _ = runs["vcppo"]
    cfg = model_config(config.critic_dir)
    nan_critic = jax.tree.map(lambda x: np.full_like(x, np.nan), load(config.critic_dir, ValueModel(cfg),
                                                                      "critic_params"))
    with ckpt_lib.Checkpointer(root / "value_pretrain_nan") as ckpt:
        ckpt.save(1, {"critic_params": nan_critic}, ckpt_lib.read_meta(config.critic_dir), force=True)
    workdir = root / "vcppo_nan"
    with pytest.raises(FloatingPointError, match="max_bad_steps=2"):
        run_rl(with_fields(config, workdir=workdir, critic_dir=root / "value_pretrain_nan", num_steps=4,
                           max_bad_steps=2))
    assert saved_steps(workdir) == [1]
    model = CausalLM(cfg)  # the saved step holds the SFT policy: its one update was skipped, not applied
    assert_trees_close(load(workdir, model, "actor/params"), load(config.sft_dir, model, "params"), rtol=0, atol=0)
    assert [r["step"] for r in read_metrics(workdir) if "policy/clipfrac" in r] == [1]
    assert read_metrics(workdir)[-1]["train/nonfinite"] > 0


# ---------------------------------------------------------------------------------------------------------------
# Value training: targets and the convergence rule.
# ---------------------------------------------------------------------------------------------------------------


def mc_returns_reference(rewards: np.ndarray, mask: np.ndarray, gamma: float) -> np.ndarray:
    out = np.zeros_like(rewards)
    for b in range(rewards.shape[0]):
        g = 0.0
        for t in reversed(range(rewards.shape[1])):
            if mask[b, t]:
                g = rewards[b, t] + gamma * g
                out[b, t] = g
    return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_value_targets_monte_carlo_returns(gamma):
    rs = np.random.RandomState(1)
    lengths = np.array([0, 1, 3, 6, 6])
    mask = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
    rewards = rs.randn(5, 6).astype(np.float32)  # dense, and garbage after EOS (must be ignored)
    seq_rewards = jnp.asarray(rs.randn(5).astype(np.float32))
    targets, weights = value_train.value_targets(jnp.asarray(rewards), seq_rewards, jnp.asarray(mask), gamma=gamma,
                                                 eos_only=False)
    np.testing.assert_allclose(np.asarray(targets), mc_returns_reference(rewards, mask, gamma), atol=1e-5)
    np.testing.assert_array_equal(np.asarray(weights), mask)


def test_value_targets_eos_only():
    lengths = np.array([0, 1, 4, 6])
    mask = (np.arange(6)[None] < lengths[:, None]).astype(np.float32)
    seq = np.array([0.5, -1.0, 1.0, 2.0], np.float32)
    targets, weights = value_train.value_targets(jnp.zeros((4, 6)), jnp.asarray(seq), jnp.asarray(mask), gamma=1.0,
                                                 eos_only=True)
    want_w = np.zeros((4, 6), np.float32)
    for b, n in enumerate(lengths):
        if n:
            want_w[b, n - 1] = 1.0
    np.testing.assert_array_equal(np.asarray(weights), want_w)
    np.testing.assert_allclose(np.asarray(targets), want_w * seq[:, None])


@pytest.mark.parametrize("losses,evs,want", ids=["short", "falling", "plateau", "ev_moving", "in_tolerance", "zero"],
                         argvalues=[
    ([0.5, 0.4, 0.3], [0.1, 0.1, 0.1], False),  # fewer than 2 windows
    ([0.5, 0.4, 0.30, 0.29], [0.0] * 4, False),  # loss still falling: 0.45 -> 0.295
    ([9.0, 0.30, 0.29, 0.30, 0.29], [0.0] * 5, True),  # plateau; only the last two windows count
    ([0.30, 0.29, 0.31, 0.30], [0.10, 0.10, 0.14, 0.14], False),  # explained variance moved 0.04 > atol
    ([0.30, 0.29, 0.31, 0.30], [0.10, 0.10, 0.11, 0.11], True),  # 0.305 vs 0.295: 3.4% < rtol; ev 0.01 < atol
    ([0.0, 0.0, 0.0, 0.0], [1.0] * 4, True),  # zero loss: the relative tolerance does not divide by zero
])
def test_converged_rule(losses, evs, want):
    assert value_train.converged(losses, evs, window=2, rtol=0.05, atol=0.02) is want
