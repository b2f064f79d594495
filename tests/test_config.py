"""Every experiment config builds and validates; bad values fail up front naming the field."""

import dataclasses
import json
import pathlib
import subprocess
import sys

import jax
import pytest

import config_files
from vcppo_jax import builders, stage_meta, stages
from vcppo_jax import config as config_lib
from vcppo_jax.models import ModelConfig

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.py"))


def load(name):
    return config_files.load(name)


def test_all_configs_listed():
    names = {p.stem for p in CONFIG_FILES}
    assert {"vcppo", "ppo", "grpo", "value_pretrain", "reward_model", "sft"} <= names


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.stem)
def test_every_config_validates(path):
    config_lib.validate(load(path.stem))


def test_paper_settings():
    vc, ppo, grpo = load("vcppo"), load("ppo"), load("grpo")
    assert (vc.lambda_actor, vc.lambda_critic, vc.critic_init) == (0.95, 1.0, "value_pretrain")
    assert (ppo.lambda_actor, ppo.lambda_critic, ppo.critic_init) == (0.95, 0.95, "reward_model")
    assert not config_lib.has_critic(grpo) and grpo.group_size >= 2 and grpo.advantage == "group"
    assert config_lib.has_critic(vc) and config_lib.has_critic(ppo)
    assert vc.advantage == ppo.advantage == "gae"
    assert vc.gamma == ppo.gamma == 1.0


@pytest.mark.parametrize(
    "field,value,match",
    [
        ("lambda_actor", 1.5, r"lambda_actor=1.5 .*\[0.0, 1.0\]"),
        ("lambda_critic", -0.1, r"lambda_critic"),
        ("gamma", 2.0, r"gamma"),
        ("clip_low", 0.0, r"clip_low=0.0"),
        ("clip_high", -1.0, r"clip_high"),
        ("dual_clip", 0.5, r"dual_clip"),
        ("num_minibatches", 3, r"num_minibatches=3 must divide .*=64"),
        ("loss_agg", "mean", r"loss_agg"),
        ("kl_estimator", "k4", r"kl_estimator"),
        ("algorithm", "", r"algorithm=''"),
        ("advantage", "td", r"advantage='td' .*one of \('gae', 'group'\)"),
        ("critic_init", "none", r"critic_init"),
        ("model.num_kv_heads", 3, r"num_kv_heads=3 .*must divide"),
        ("mesh.data", 0, r"mesh.data"),
        ("sampling.top_p", 0.0, r"top_p"),
        ("sampling.kv_cache_dtype", "float16", r"sampling.kv_cache_dtype='float16' .*one of \('compute', 'bfloat16'\)"),
        ("actor_optim.lr", 0.0, r"actor_optim.lr"),
        ("lambda_actor", float("nan"), r"finite"),
        ("critic_init_bias", float("inf"), r"critic_init_bias"),
        ("model.model_type", "qwen3_moe", r"model.model_type='qwen3_moe' .*one of \('qwen2', 'llama', 'qwen3'\)"),
    ],
)
def test_rl_rejects_bad_values(field, value, match):
    c = load("vcppo")
    *parents, leaf = field.split(".")
    target = c
    for p in parents:
        target = target[p]
    target[leaf] = value
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.validate(c)


def test_grpo_needs_groups():
    c = load("grpo")
    c.group_size = 1
    c.num_minibatches = 1
    with pytest.raises(config_lib.ConfigError, match="group_size=1"):
        config_lib.validate(c)


def test_value_pretrain_rejects_bad_window():
    c = load("value_pretrain")
    c.min_steps = c.max_steps + 1
    with pytest.raises(config_lib.ConfigError, match="min_steps"):
        config_lib.validate(c)


def test_train_cli_overrides_and_rejects():
    """The entrypoint parses --config.x=y overrides and rejects bad values before doing any work."""
    cmd = [sys.executable, str(ROOT / "experiments" / "train.py"), "--config=configs/vcppo.py",
           "--config.lambda_actor=1.5", "--config.num_steps=0"]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "config.lambda_actor=1.5 is invalid" in out.stderr + out.stdout


def assert_rejected(name: str, field: str, value, match: str) -> None:
    """configs/<name>.py with `field` set to `value` fails validation with a message matching `match`."""
    c = load(name)
    c[field] = value
    with pytest.raises(config_lib.ConfigError, match=match):
        config_lib.validate(c)


def test_grpo_has_no_critic_bias_and_sft_late_phase_is_checked():
    assert_rejected("grpo", "critic_init_bias", -1.0, "critic_init_bias=-1.0 .*advantage='group'")
    assert_rejected("sft", "late_direct_fraction", 1.5, "late_direct_fraction")


def test_truncated_fraction_is_the_reward_models_and_reaches_it_through_stage_overrides():
    assert load("reward_model").truncated_fraction == 0.0
    for bad in (1.0, -0.1):
        assert_rejected("reward_model", "truncated_fraction", bad, "truncated_fraction")
    assert_rejected("value_pretrain", "truncated_fraction", 0.5, "truncated_fraction=0.5 .*value pretraining")
    ppo = load("ppo")
    ppo.stage_overrides.reward_model.truncated_fraction = 0.5
    derived = stages.derived_config(ppo, "reward_model", "/tmp/rm")
    assert derived.truncated_fraction == 0.5 and derived.stage == "reward_model"
    assert stages.derived_config(load("ppo"), "reward_model", "/tmp/rm").truncated_fraction == 0.0


@pytest.mark.parametrize("field, value", [("top_k", 5), ("top_p", 0.9)])
def test_rl_rejects_filtered_sampling_that_would_be_off_policy(field, value):
    for name in ("vcppo", "ppo", "grpo"):
        c = load(name)
        c.sampling[field] = value
        with pytest.raises(config_lib.ConfigError, match=rf"sampling.{field}={value} .*off-policy"):
            config_lib.validate(c)
    vpt = load("value_pretrain")  # the critic stages have no ratio: they may sample filtered
    vpt.sampling[field] = value
    config_lib.validate(vpt)


def test_every_implemented_choice_is_selectable():
    """The allowed lists are the implementing modules' own: a mode added there is selectable here (Dr. GRPO's
    'seq-mean-token-sum-norm' was implemented in losses.py but rejected by an older copy of the list)."""
    from vcppo_jax import losses, rewards  # noqa: PLC0415

    for mode in losses.AGG_MODES:
        c = load("grpo")
        c.loss_agg = mode
        config_lib.validate(c)
    for kind in losses.KL_KINDS:
        c = load("grpo")
        c.kl_estimator = kind
        config_lib.validate(c)
    assert config_lib.TASKS is rewards.TASKS
    from vcppo_jax.models import config as model_config_lib  # noqa: PLC0415

    assert config_lib.SUPPORTED_MODEL_TYPES is model_config_lib.SUPPORTED_MODEL_TYPES
    for model_type in model_config_lib.SUPPORTED_MODEL_TYPES:
        c = load("sft")
        c.model.model_type = model_type
        config_lib.validate(c)
    import vcppo_jax.data as data  # noqa: PLC0415

    assert data.TASKS is rewards.TASKS


def test_quiet_console_hides_library_chatter_not_our_warnings(caplog, monkeypatch):
    import logging  # noqa: PLC0415

    from absl import logging as absl_logging  # noqa: PLC0415
    from vcppo_jax import runtime  # noqa: PLC0415

    root, absl = logging.getLogger(), logging.getLogger("absl")
    monkeypatch.setattr(root, "level", root.level)  # restored after the test
    monkeypatch.setattr(absl, "level", absl.level)
    root.setLevel(logging.INFO)
    absl.setLevel(logging.NOTSET)
    runtime.configure_console(verbose=True)
    assert (root.level, absl.level) == (logging.INFO, logging.NOTSET)  # verbose: untouched
    runtime.configure_console(verbose=False)
    with caplog.at_level(logging.NOTSET, logger="some.library"):
        absl_logging.warning("CheckpointManagerOptions.read_only=True, setting save_interval_steps=0.")
        logging.getLogger("jax._src.xla_bridge").info("Unable to initialize backend 'tpu'")
        logging.warning("checkpoint step 3 is unreadable; falling back")  # this project's: root logger
    assert "read_only" not in caplog.text and "backend" not in caplog.text
    assert "checkpoint step 3 is unreadable" in caplog.text


# --------------------------------------------------------------------------------------------- model settings
def test_model_families_are_fingerprinted_apart_and_saved_configs_round_trip():
    """model.model_type is part of what a finished stage was trained as (a Llama and a Qwen2 model of one size differ
    in their q/k/v biases), and the ModelConfig a checkpoint saves loads back equal."""
    c = load("sft")
    fingerprints = set()
    for model_type in ("qwen2", "llama", "qwen3"):
        c.model.model_type = model_type
        fingerprints.add(json.dumps(stage_meta.settings(c)["model"], sort_keys=True))
        cfg = builders.scratch_model_config(c, 55)
        assert builders.model_config_from_json(builders.model_config_to_json(cfg)) == cfg
    assert len(fingerprints) == 3


def test_compute_options_leave_stage_settings_unchanged():
    """dtype, remat and the attention kernel change how a model computes, not what it is: finished stages stay
    valid when they change."""
    c = load("sft")
    before = stage_meta.settings(c)
    c.model.update(dtype="bfloat16", remat=True, attention_impl="blockwise", attention_block_size=64)
    assert stage_meta.settings(c) == before


def test_config_model_maps_onto_model_config_by_name():
    c = load("sft")
    fields = {f.name for f in dataclasses.fields(ModelConfig)}
    assert set(c.model) - {"hf_path"} <= fields  # hf_path: where to load from, not a hyper-parameter
    c.model.update(model_type="qwen3", head_dim=48, num_layers=2, rms_norm_eps=1e-5, rope_theta=500.0,
                   tie_embeddings=False, max_position_embeddings=64, dtype="bfloat16", remat=True, vocab_size=99,
                   attention_impl="blockwise", attention_block_size=64)
    cfg = builders.scratch_model_config(c, 55)
    assert {k: getattr(cfg, k) for k in set(c.model) - {"hf_path"}} == {k: v for k, v in c.model.items()
                                                                       if k != "hf_path"}
    assert cfg.qk_norm and not cfg.qkv_bias
    c.model.update(vocab_size=0, head_dim=0, attention_impl="")  # 0 / '' = the tokenizer's vocabulary /
    auto = builders.scratch_model_config(c, 55)  # hidden_size // num_heads / the kernel chosen by length
    assert (auto.vocab_size, auto.head_dim, auto.attention_impl) == (55, 32, None)


@pytest.mark.skipif(jax.default_backend() == "tpu", reason="splash is this backend's kernel")
def test_splash_off_tpu_fails_before_the_mesh_is_built():
    from vcppo_jax import runtime  # noqa: PLC0415

    c = load("vcppo")
    c.model.attention_impl = "splash"
    config_lib.validate(c)  # a valid value, for a TPU
    with pytest.raises(ValueError, match="attention_impl='splash' is the TPU Pallas kernel"):
        runtime.make_runtime(c)


def _gsm8k_config(*args):
    module = config_files.load_module("vcppo_gsm8k")
    return module.get_config(*args), module.MODELS


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b"])
def test_real_model_gsm8k_recipe_configs_validate_down_to_their_stages(preset):
    c, models = _gsm8k_config(preset)
    config_lib.validate(c)
    assert c.task.name == "gsm8k" and c.model.hf_path == models[preset]
    assert len({_gsm8k_config(name)[0].workdir for name in models}) == len(models)  # presets never share runs
    sft = stages.derived_config(c, "sft", c.sft_dir)
    value = stages.derived_config(c, "value_pretrain", c.critic_dir)
    # The stages get LLM-scale learning rates through stage_overrides, not the tiny model's (configs/sft.py: 3e-3).
    assert (sft.optim.lr, value.optim.lr, c.actor_optim.lr) == (1e-5, 2e-6, 1e-6)
    assert sft.model.hf_path == c.model.hf_path and sft.task.to_dict() == c.task.to_dict()
    with pytest.raises(ValueError, match="unknown model preset"):
        _gsm8k_config("llama-7b")


def test_smollm2_presets_share_the_recipe_and_differ_only_in_the_method():
    module = config_files.load_module("smollm2")
    configs = {p: module.get_config(p) for p in module.PRESETS}
    method = ("algorithm", "advantage", "critic_init", "critic_dir", "lambda_actor", "lambda_critic", "workdir",
              "stage_overrides")
    shared = [{k: v for k, v in c.to_dict().items() if k not in method} for c in configs.values()]
    assert all(s == shared[0] for s in shared)  # prompts, sampling, steps, seed, lrs, evaluation: the same
    for preset, c in configs.items():
        config_lib.validate(c)
        assert c.task.chat_template and c.sft_dir == module.MODEL_DIR and c.kl_coef == 0
        if c.critic_init in ("value_pretrain", "reward_model"):
            stage = stages.derived_config(c, c.critic_init, c.critic_dir)
            assert stage.sft_dir == module.MODEL_DIR and stage.task.to_dict() == c.task.to_dict()
    assert stage_meta.prerequisites(configs["vcppo"]) == [("sft", module.MODEL_DIR),
                                                          ("value_pretrain", configs["vcppo"].critic_dir)]
    with pytest.raises(ValueError, match="unknown preset"):
        module.get_config("dpo")
