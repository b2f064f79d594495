"""Every experiment config builds and validates; bad values fail up front naming the field."""

import importlib.util
import pathlib
import subprocess
import sys

import pytest

from vcppo_jax import config as config_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIG_FILES = sorted((ROOT / "configs").glob("*.py"))


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


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
    assert grpo.critic_init == "none" and grpo.group_size >= 2
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
        ("algorithm", "a2c", r"algorithm"),
        ("critic_init", "none", r"critic_init"),
        ("model.num_kv_heads", 3, r"num_kv_heads=3 .*must divide"),
        ("mesh.data", 0, r"mesh.data"),
        ("sampling.top_p", 0.0, r"top_p"),
        ("actor_optim.lr", 0.0, r"actor_optim.lr"),
        ("lambda_actor", float("nan"), r"finite"),
        ("critic_init_bias", float("inf"), r"critic_init_bias"),
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


def test_grpo_has_no_critic_bias_and_sft_late_phase_is_checked():
    c = load("grpo")
    c.critic_init_bias = -1.0
    with pytest.raises(config_lib.ConfigError, match="critic_init_bias=-1.0 .*GRPO"):
        config_lib.validate(c)
    sft = load("sft")
    sft.late_direct_fraction = 1.5
    with pytest.raises(config_lib.ConfigError, match="late_direct_fraction"):
        config_lib.validate(sft)
