"""Shared config builders and up-front validation for every entrypoint.

Experiment files in `configs/` call one of the `base_*_config()` builders and override fields; every entrypoint
calls `validate(config)` before building anything, so a bad value fails with a message naming the field and the
allowed range, never inside a compile.
"""

from __future__ import annotations

import math
import re
from typing import Any, Iterable

import ml_collections

from vcppo_jax import tpu_topology
from vcppo_jax.hooks import GROUP_FILTERS, REWARD_SHAPINGS
from vcppo_jax.losses import AGG_MODES, KL_KINDS
from vcppo_jax.models.config import ATTENTION_IMPLS, SUPPORTED_MODEL_TYPES
from vcppo_jax.rewards import TASKS
from vcppo_jax.rl import ADVANTAGE_ESTIMATORS
from vcppo_jax.sampling import ENGINES, KV_CACHE_DTYPES

STAGES = ("sft", "reward_model", "value_pretrain", "rl")
CRITIC_INITS = ("value_pretrain", "reward_model", "actor")
DTYPES = ("float32", "bfloat16")


class ConfigError(ValueError):
    """A config field holds a value outside its allowed range."""


# ----------------------------------------------------------------------------------------------------------------
# Builders (pure data; experiment files override fields).
# ----------------------------------------------------------------------------------------------------------------


def model_config() -> ml_collections.ConfigDict:
    """A tiny Qwen2-style decoder that trains on 2 CPU cores; `hf_path` loads a real checkpoint instead.

    Every field but `hf_path` is the `ModelConfig` field of the same name (`builders.model_config`).
    """
    return ml_collections.ConfigDict(dict(
        hf_path="",  # local HF folder (config.json + safetensors); '' = build from the fields below.
        model_type="qwen2",  # a SUPPORTED_MODEL_TYPES family; it decides q/k/v biases (qwen2) and q/k norms (qwen3).
        vocab_size=0,  # vocabulary size; 0 = take it from the tokenizer.
        hidden_size=128,  # width of the residual stream.
        intermediate_size=384,  # width of the SwiGLU MLP.
        num_layers=4,  # decoder layers.
        num_heads=4,  # query heads.
        num_kv_heads=2,  # key/value heads (grouped-query attention; must divide num_heads).
        head_dim=0,  # width of each attention head; 0 = hidden_size // num_heads.
        rope_theta=10000.0,  # RoPE base frequency.
        rms_norm_eps=1e-6,  # RMSNorm epsilon.
        tie_embeddings=True,  # the LM head shares the token embedding matrix.
        max_position_embeddings=1024,  # longest sequence (prompt + response) the model is built for.
        dtype="float32",  # compute dtype; parameters and optimizer state stay float32.
        remat=False,  # recompute each layer's activations in the backward pass (less memory, more compute).
        # attention_impl: '' = a memory-linear kernel from 1024 tokens (splash on TPU, blockwise elsewhere), dense
        # below; 'blockwise', 'splash' (TPU only), 'xla' or 'cudnn' always (models/config.py, ATTENTION_IMPLS).
        attention_impl="",
        attention_block_size=512,  # key/query block of the memory-linear kernels (blockwise, splash).
    ))


def task_config() -> ml_collections.ConfigDict:
    return ml_collections.ConfigDict(dict(
        name="synthetic",  # the task (rewards.TASKS): its data builder and its verifier.
        data_dir="",  # where the task's TFDS data is built or read; '' = <workdir root>/tfds.
        tokenizer_path="",  # '' = the synthetic char-level tokenizer (or model.hf_path's tokenizer when set).
        train_split="train",  # split RL, SFT and value pretraining sample prompts from.
        test_split="test",  # split the evaluations read.
        # Passed to the task loader (synthetic: see data/synthetic.py; gsm8k/math: `template`). The default synthetic
        # difficulty (2-3 two-digit terms, CoT ~40-100 tokens) trains on 2 CPU cores in minutes; raise terms/digits
        # (and max_response_len) for longer chains of thought.
        # knobs.min_terms: fewest terms in a synthetic problem.
        # knobs.max_terms: most terms in a synthetic problem.
        # knobs.min_digits: fewest digits per term.
        # knobs.max_digits: most digits per term.
        # knobs.ops: operators drawn between terms ('+' or '+-').
        # knobs.num_train: problems in the train split.
        # knobs.num_test: problems in the test split.
        # knobs.seed: seed of the generated problems (part of the data's folder name).
        knobs=ml_collections.ConfigDict(dict(min_terms=2, max_terms=3, min_digits=2, max_digits=2, ops="+",
                                             num_train=10000, num_test=500, seed=0)),
        max_prompt_len=24,  # prompt tokens (left-padded; longer prompts are refused).
        max_response_len=112,  # most tokens sampled per response.
        # chat_template: an instruct model's prompt format: each question becomes a user turn of the tokenizer's chat
        # template (after `system_prompt`), and a response also ends at the template's end-of-turn token
        # (vcppo_jax/chat.py). Applies to every stage and evaluation.
        chat_template=False,
        system_prompt="",  # the system turn with chat_template; '' = the template's default system turn, if any.
    ))


def mesh_config() -> ml_collections.ConfigDict:
    # data: devices on the data-parallel mesh axis (-1 = the devices the other axes leave).
    # fsdp: devices the parameters and optimizer state are sharded over (batches too); -1 = the rest.
    # tensor: devices the MLP, head and vocab dimensions are split over; -1 = the rest.
    return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1))


def optim_config(lr: float) -> ml_collections.ConfigDict:
    # lr: peak learning rate of AdamW.
    # warmup_steps: optimizer updates of linear warmup from 0 to lr.
    # decay_steps: 0 = constant lr after warmup; else cosine decay to 0 over that many updates.
    # weight_decay: AdamW's decoupled weight decay.
    # grad_clip: global gradient-norm clip; 0 disables it.
    # b1: Adam's first-moment decay.
    # b2: Adam's second-moment decay.
    # eps: Adam's epsilon.
    return ml_collections.ConfigDict(dict(lr=lr, warmup_steps=0, decay_steps=0, weight_decay=0.0, grad_clip=1.0,
                                          b1=0.9, b2=0.999, eps=1e-8))


def _common(stage: str, workdir: str) -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.stage = stage  # which loop runs this config (set by the builder; STAGES).
    c.seed = 0  # seeds initialization, prompt order and sampling.
    c.workdir = workdir  # checkpoints, metrics.jsonl and TensorBoard events of this run.
    c.model = model_config()
    c.task = task_config()
    c.mesh = mesh_config()
    c.resume = True  # resume from the workdir's newest checkpoint; False refuses a workdir that holds checkpoints.
    c.log_every = 1  # steps between metric records.
    c.save_every = 50  # steps between checkpoints.
    c.max_to_keep = 2  # checkpoints kept in the workdir.
    c.max_bad_steps = 3  # consecutive non-finite losses before the run halts.
    c.tensorboard = True  # also write TensorBoard events beside metrics.jsonl.
    c.progress_bar = True  # a tqdm progress bar with the step's main metrics.
    # verbose: library log lines (orbax, TFDS, absl INFO) on the console; off: progress bars, evaluations, stage lines
    # and this project's warnings only.
    c.verbose = False
    # dry_run: compile this stage's programs against abstract inputs, print XLA's per-device memory plan and whether
    # it fits, and stop (no weights, data or earlier stages needed; vcppo_jax/dry_run.py).
    c.dry_run = False
    c.dry_run_device_memory_gib = 0.0  # the dry run's device memory to fit in; 0 = the device's own memory.
    # dry_run_topology: '' = this host's devices; a TPU slice such as 'v5e:2x4' or 'v4:2x2x4' = compile with the TPU
    # compiler for that slice's devices, without a TPU (libtpu needed: vcppo_jax/tpu_topology.py), against its HBM.
    c.dry_run_topology = ""
    return c


def sampling_config() -> ml_collections.ConfigDict:
    # top_k: keep only the k most likely tokens; 0 = off (evaluation and the sampler's API only; RL refuses it).
    # top_p: nucleus sampling's probability mass; 1.0 = off (evaluation and the sampler's API only; RL refuses it).
    # decode_slots: decode slots of the 'slots' engine; 0 = the batch's rows (tail narrowing only; sampling.py).
    # temperature: sampling temperature of rollouts and sampled evaluations; 0 = greedy.
    # 0.7: at temperature 1 the tiny CPU policy garbles ~80% of its scratchpads (pass@1 ~0.1 vs ~0.45 greedy), which
    # leaves RL too few correct samples per step. The PPO ratio uses the same tempered distribution.
    # kv_cache_dtype: 'compute' (the model's dtype) or 'bfloat16' (half an fp32 model's cache; sampling.py).
    # engine: 'dense' (every row decodes until the longest ends) or 'slots' (decode_slots slots refilled with the next
    # prompt as rows end, then narrowed as the last rows end: on CPU, mixed response lengths then cost closer to what
    # is generated; sampling.py, experiments/bench_rollout.py). Both sample the same tokens for a row, up to float
    # rounding.
    return ml_collections.ConfigDict(dict(temperature=0.7, top_k=0, top_p=1.0, kv_cache_dtype="compute",
                                          engine="dense", decode_slots=0))


def stage_overrides() -> ml_collections.ConfigDict:
    """Fields applied to an earlier stage's config when this run starts it itself (None = keep the file's value),
    e.g. `--config.stage_overrides.sft.num_steps=200`; `lr` sets the stage's `optim.lr` (the files' rates suit the
    tiny CPU model, not a pretrained LLM)."""
    # *.*: that stage's field of the same name when this run starts the stage itself; None = the stage file's value
    # (lr: the stage's optim.lr).
    unset = lambda: ml_collections.config_dict.placeholder(int)
    lr = lambda: ml_collections.config_dict.placeholder(float)
    value = lambda: dict(max_steps=unset(), min_steps=unset(), prompts_per_step=unset(), group_size=unset(), lr=lr())
    reward_model = dict(value(), truncated_fraction=ml_collections.config_dict.placeholder(float))
    return ml_collections.ConfigDict(dict(sft=dict(num_steps=unset(), batch_size=unset(), eval_every=unset(), lr=lr()),
                                          value_pretrain=value(), reward_model=reward_model))


def base_rl_config(algorithm: str) -> ml_collections.ConfigDict:
    """Defaults shared by VC-PPO, PPO and GRPO; `configs/<algorithm>.py` sets what differs."""
    c = _common("rl", f"runs/default/{algorithm}")
    c.algorithm = algorithm  # a name for logs and checkpoints; what the method does is set by the fields below.
    # advantage: the one field that decides whether a run has a critic. 'gae': a critic and (decoupled) GAE (PPO,
    # VC-PPO); 'group': no critic, each response's reward relative to its prompt's group of `group_size` samples
    # (GRPO); the critic_* fields and critic_optim are then not read.
    c.advantage = "gae"
    # sft_dir: the SFT stage (or an HF folder: a finished one) the policy starts from; a missing stage is run by
    # train.py itself when `run_missing_stages`.
    c.sft_dir = "runs/default/sft"
    # critic_init: where the critic starts: the finished value-pretraining or reward-model stage in critic_dir, or the
    # policy's backbone with a fresh value head ('actor').
    c.critic_init = "value_pretrain"
    c.critic_dir = "runs/default/value_pretrain"  # the critic's stage (critic_init 'value_pretrain' / 'reward_model').
    # critic_init_bias: added to the value head's bias when RL starts, for any critic_init: the critic's initial bias
    # as an experimental factor (the paper's Fig. 2 critic is pessimistic: < 0). 0 = the critic as initialized.
    c.critic_init_bias = 0.0
    c.run_missing_stages = True  # run missing earlier stages first (False: a missing stage is an error).
    c.stage_overrides = stage_overrides()
    # Advantage estimation (paper Algorithm 1).
    c.gamma = 1.0  # discount per token.
    c.lambda_actor = 0.95  # GAE lambda of the policy's advantages.
    c.lambda_critic = 1.0  # GAE lambda of the critic's value targets (1.0 = Monte-Carlo returns; VC-PPO).
    c.adaptive_lambda = False  # VAPO: lambda_actor = 1 - 1 / (alpha * length) per sequence.
    c.adaptive_lambda_alpha = 0.05  # VAPO's alpha.
    c.whiten_advantages = True  # normalize GAE advantages over the batch (mean 0, std 1).
    c.grpo_normalize_std = True  # group advantages divided by the group's std (False: Dr. GRPO).
    # Objective.
    c.clip_low = 0.2  # PPO ratio clip below 1.
    c.clip_high = 0.2  # PPO ratio clip above 1; > clip_low = clip-higher (DAPO/VAPO).
    c.dual_clip = 0.0  # dual-clip bound on the ratio of negative-advantage tokens; 0 disables, otherwise > 1.
    c.value_clip = 0.0  # clip range of new values around the old ones in the value loss; 0 disables.
    c.loss_agg = "token-mean"  # how token losses are averaged over a batch (losses.AGG_MODES).
    c.kl_coef = 0.0  # weight of the KL to the reference (SFT) policy; 0 = no reference pass.
    c.kl_estimator = "k3"  # KL estimator (losses.KL_KINDS).
    c.kl_in_reward = False  # KL as a per-token reward penalty instead of a loss term.
    c.entropy_coef = 0.0  # entropy bonus weight.
    c.nll_coef = 0.0  # VAPO positive-example LM loss weight.
    c.reward_correct = 1.0  # the verifier's reward for a right answer.
    c.reward_wrong = -1.0  # the verifier's reward for a wrong or missing answer.
    # Rollouts.
    # prompts_per_step: prompts sampled per RL step, each `group_size` times. 64 responses per step: with 32 the
    # update's noise costs as much accuracy as its signal gains (experiments/STUDIES.md).
    c.prompts_per_step = 16
    c.group_size = 4  # responses sampled per prompt.
    c.sampling = sampling_config()
    # Updates. The learning rates suit the tiny CPU model; LLM-scale runs use ~1e-6 (actor) and ~1e-5 (critic).
    c.num_epochs = 1  # passes over each step's rollouts.
    c.num_minibatches = 2  # optimizer updates per epoch (must divide prompts_per_step * group_size).
    c.actor_optim = optim_config(3e-5)
    # Adam's first update moves every weight by lr * sign(grad) whatever the gradient's size; from a converged SFT
    # policy that alone breaks its outputs at larger lrs. Ramp the lr over the first optimizer updates instead.
    c.actor_optim.warmup_steps = 10
    c.critic_optim = optim_config(3e-4)
    c.logprob_chunk = 128  # response tokens per chunk of the log-prob computation (bounds the [T, vocab] logits).
    # Loop.
    c.num_steps = 60  # RL iterations.
    c.eval_every = 20  # steps between evaluations (and at step 0).
    c.eval_prompts = 64  # first test problems evaluated (the probe set).
    c.save_every = 20
    c.diag_buckets = 16  # token-position buckets for the value/advantage-by-position diagnostics.
    c.diag_early_tokens = 16  # first tokens counted as early in diag/adv_early_bias.
    # Controls that separate learning from drift.
    # shuffle_rewards: train on the batch's rewards permuted across responses (same rewards and lengths, no link to
    # the answers); rollout/accuracy still reports the true ones.
    c.shuffle_rewards = False
    # eval_kl_to_sft: at each evaluation also sample the probe prompts at the training temperature and report
    # probe/pass@1 and probe/kl_to_sft (per-token KL(policy || SFT policy); holds the SFT params in memory).
    c.eval_kl_to_sft = True
    # Host hooks (vcppo_jax/hooks.py, DAPO); 'none' = off.
    # reward_shaping: reward shaping of what the update trains on ('overlong': a penalty falling linearly to
    # -overlong_penalty over the last overlong_buffer tokens before max_response_len).
    c.reward_shaping = "none"
    c.overlong_buffer = 0  # tokens before max_response_len over which 'overlong' shaping applies.
    c.overlong_penalty = 1.0  # the 'overlong' penalty at max_response_len.
    # group_filter: 'mixed' keeps groups neither all right nor all wrong, sampling up to max_sampling_rounds prompt
    # batches per step to fill the batch (DAPO's dynamic sampling).
    c.group_filter = "none"
    c.max_sampling_rounds = 3  # most prompt batches sampled per step with a group filter.
    return c


def base_sft_config() -> ml_collections.ConfigDict:
    c = _common("sft", "runs/default/sft")
    c.batch_size = 32  # traces per SFT step.
    c.num_steps = 650  # SFT steps.
    c.direct_fraction = 0.3  # fraction of traces in short "direct answer" style (lets a policy collapse to short).
    # late_steps: over the last `late_steps` steps the share is `late_direct_fraction` instead (0 steps = off): a cold
    # start that keeps the chain-of-thought skill of its main phase but ends up preferring the short answer
    # (experiments/STUDIES.md).
    c.late_steps = 50
    c.late_direct_fraction = 0.7  # the direct-answer share of the late phase.
    # pad_to_multiple: 0 = every batch padded to max_prompt_len + max_response_len. k > 0: each batch trimmed to its
    # longest prompt and target, rounded up to a multiple of k (same loss; the default task's batches are 58% padding,
    # and k = 1 made the SFT step 0.43 s instead of 0.71 s on 2 CPU cores). The mechanism studies pin 0.
    c.pad_to_multiple = 1
    c.optim = optim_config(3e-3)
    c.optim.warmup_steps = 20
    c.optim.decay_steps = 630
    c.eval_every = 100  # steps between greedy evaluations.
    c.save_every = 100
    c.eval_prompts = 64  # first test problems evaluated.
    c.sampling = sampling_config()
    return c


def base_value_config(stage: str) -> ml_collections.ConfigDict:
    """Value pretraining (stage='value_pretrain') and outcome reward model (stage='reward_model') share a layout."""
    c = _common(stage, f"runs/default/{stage}")
    c.sft_dir = "runs/default/sft"  # the SFT stage (or HF folder) whose policy is sampled and whose backbone is used.
    c.run_missing_stages = True  # run a missing SFT stage first (False: it is an error).
    c.stage_overrides = stage_overrides()
    c.critic_init = "actor"  # the critic starts from the policy's backbone, or (value_pretrain) a 'reward_model'.
    c.critic_dir = ""  # the reward-model stage to start from when critic_init='reward_model'.
    c.prompts_per_step = 8  # prompts sampled per step, each `group_size` times.
    c.group_size = 4  # responses sampled per prompt.
    c.num_minibatches = 2  # optimizer updates per step.
    c.sampling = sampling_config()
    c.optim = optim_config(3e-4)
    c.optim.warmup_steps = 10
    c.gamma = 1.0  # discount of the Monte-Carlo return targets.
    c.reward_correct = 1.0  # the verifier's reward for a right answer.
    c.reward_wrong = -1.0  # the verifier's reward for a wrong or missing answer.
    # truncated_fraction: reward_model only: the fraction of responses labelled failures at a random cut
    # (value_train.value_targets); > 0 gives the pessimistic reward model of the mechanism study.
    c.truncated_fraction = 0.0
    c.min_steps = 20  # steps before the convergence test may stop the stage.
    c.max_steps = 80  # most steps.
    c.save_every = 20
    # converge_window: converged when, over the last `converge_window` steps vs the window before, value loss changed
    # by less than `converge_rtol` (relative) and explained variance by less than `converge_atol`.
    c.converge_window = 8
    c.converge_rtol = 0.05  # relative change of the value loss between windows.
    c.converge_atol = 0.02  # absolute change of the explained variance between windows.
    c.logprob_chunk = 128  # not read by the value stages (validated only; the RL stage chunks its log-probs).
    return c


def default_config(stage: str) -> ml_collections.ConfigDict:
    """A stage's default config (`configs/<experiment>.py` files override it): what a run that starts an earlier
    stage itself trains it with ('rl': VC-PPO's)."""
    builders = {"sft": base_sft_config, "value_pretrain": lambda: base_value_config("value_pretrain"),
                "reward_model": lambda: base_value_config("reward_model"), "rl": lambda: base_rl_config("vcppo")}
    if stage not in builders:
        raise ConfigError(f"stage={stage!r} is unknown; choose from {STAGES}")
    return builders[stage]()


# ----------------------------------------------------------------------------------------------------------------
# Validation.
# ----------------------------------------------------------------------------------------------------------------


def _fail(field: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"config.{field}={value!r} is invalid: {allowed}.")


def _check_range(c, field: str, lo: float, hi: float, *, lo_open=False, hi_open=False) -> None:
    v = _get(c, field)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v):
        _fail(field, v, "must be a finite number")
    bad = (v <= lo if lo_open else v < lo) or (v >= hi if hi_open else v > hi)
    if bad:
        lb = "(" if lo_open else "["
        rb = ")" if hi_open else "]"
        _fail(field, v, f"must be in {lb}{lo}, {hi}{rb}")


def _check_int(c, field: str, lo: int, hi: int | None = None) -> None:
    v = _get(c, field)
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        _fail(field, v, f"must be an integer >= {lo}" + (f" and <= {hi}" if hi is not None else ""))


def _check_choice(c, field: str, choices: Iterable[str]) -> None:
    v = _get(c, field)
    if v not in tuple(choices):
        _fail(field, v, f"must be one of {tuple(choices)}")


def _get(c, field: str) -> Any:
    for part in field.split("."):
        if part not in c:
            raise ConfigError(f"config.{field} is missing.")
        c = c[part]
    return c


def _validate_common(c) -> None:
    _check_choice(c, "stage", STAGES)
    _check_int(c, "seed", 0)
    _check_range(c, "dry_run_device_memory_gib", 0.0, float("inf"), hi_open=True)
    if not isinstance(c.dry_run_topology, str):
        _fail("dry_run_topology", c.dry_run_topology, "must be a string ('' = this host's devices)")
    if c.dry_run_topology:
        if not c.dry_run:
            _fail("dry_run_topology", c.dry_run_topology, "needs dry_run=True (it only plans; nothing runs there)")
        try:
            tpu_topology.check(c.dry_run_topology)
        except ValueError as e:
            _fail("dry_run_topology", c.dry_run_topology, str(e))
    if not c.workdir:
        _fail("workdir", c.workdir, "must be a non-empty path")
    m = c.model
    if not m.hf_path:
        _check_choice(c, "model.model_type", SUPPORTED_MODEL_TYPES)
        for f in ("hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "max_position_embeddings"):
            _check_int(c, f"model.{f}", 1)
        _check_int(c, "model.vocab_size", 0)
        _check_int(c, "model.head_dim", 0)
        if m.num_heads % m.num_kv_heads:
            _fail("model.num_kv_heads", m.num_kv_heads, f"must divide model.num_heads={m.num_heads}")
        if not m.head_dim and m.hidden_size % m.num_heads:
            _fail("model.hidden_size", m.hidden_size, f"must be divisible by model.num_heads={m.num_heads} "
                  "(or set model.head_dim)")
        _check_range(c, "model.rope_theta", 0.0, float("inf"), lo_open=True, hi_open=True)
        _check_range(c, "model.rms_norm_eps", 0.0, 1.0, lo_open=True)
    _check_choice(c, "model.dtype", DTYPES)
    _check_choice(c, "model.attention_impl", ("",) + tuple(i for i in ATTENTION_IMPLS if i))  # '' = by length
    _check_int(c, "model.attention_block_size", 1)
    _check_choice(c, "task.name", TASKS)
    _check_int(c, "task.max_prompt_len", 1)
    _check_int(c, "task.max_response_len", 1)
    if not isinstance(c.task.chat_template, bool):
        _fail("task.chat_template", c.task.chat_template, "must be True or False")
    if not isinstance(c.task.system_prompt, str):
        _fail("task.system_prompt", c.task.system_prompt, "must be a string ('' = the template's default)")
    if c.task.system_prompt and not c.task.chat_template:
        _fail("task.system_prompt", c.task.system_prompt, "needs task.chat_template=True (it is a chat turn)")
    for axis in ("data", "fsdp", "tensor"):
        v = c.mesh[axis]
        if not isinstance(v, int) or isinstance(v, bool) or (v < 1 and v != -1):
            _fail(f"mesh.{axis}", v, "must be a positive integer or -1 (fill the remaining devices)")
    if sum(c.mesh[a] == -1 for a in ("data", "fsdp", "tensor")) > 1:
        raise ConfigError("config.mesh: at most one of data/fsdp/tensor may be -1.")
    for f in ("log_every", "save_every", "max_to_keep", "max_bad_steps"):
        _check_int(c, f, 1)


def _validate_optim(c, field: str) -> None:
    _check_range(c, f"{field}.lr", 0.0, 1.0, lo_open=True)
    _check_int(c, f"{field}.warmup_steps", 0)
    _check_int(c, f"{field}.decay_steps", 0)  # 0 = constant after warmup; else cosine decay over that many steps.
    _check_range(c, f"{field}.weight_decay", 0.0, 1.0)
    _check_range(c, f"{field}.grad_clip", 0.0, float("inf"), hi_open=True)  # 0 disables clipping.
    _check_range(c, f"{field}.b1", 0.0, 1.0, hi_open=True)
    _check_range(c, f"{field}.b2", 0.0, 1.0, hi_open=True)
    _check_range(c, f"{field}.eps", 0.0, 1.0, lo_open=True)


def _validate_sampling(c) -> None:
    _check_range(c, "sampling.temperature", 0.0, float("inf"), hi_open=True)  # 0 = greedy.
    _check_int(c, "sampling.top_k", 0)
    _check_range(c, "sampling.top_p", 0.0, 1.0, lo_open=True)
    _check_choice(c, "sampling.kv_cache_dtype", KV_CACHE_DTYPES)
    _check_choice(c, "sampling.engine", ENGINES)
    _check_int(c, "sampling.decode_slots", 0)  # 0 = auto (sampling.slot_count)


def _validate_minibatching(c, batch: int) -> None:
    _check_int(c, "num_minibatches", 1)
    if batch % c.num_minibatches:
        raise ConfigError(
                f"config.num_minibatches={c.num_minibatches} must divide the rollout batch prompts_per_step*group_size="
                f"{c.prompts_per_step}*{c.group_size}={batch}.")


def _validate_rl(c) -> None:
    if not isinstance(c.algorithm, str) or not re.fullmatch(r"[A-Za-z0-9_.+-]+", c.algorithm):
        _fail("algorithm", c.algorithm, "must be a non-empty name of letters, digits and _.+- (it names the run)")
    _check_choice(c, "advantage", ADVANTAGE_ESTIMATORS)
    _check_choice(c, "reward_shaping", REWARD_SHAPINGS)
    _check_choice(c, "group_filter", GROUP_FILTERS)
    _check_int(c, "max_sampling_rounds", 1, 999)  # later rounds draw prompts with seed * 1000 + round
    _check_int(c, "overlong_buffer", 0, c.task.max_response_len)
    _check_range(c, "overlong_penalty", 0.0, float("inf"), hi_open=True)
    if c.group_filter != "none" and c.group_size < 2:
        _fail("group_filter", c.group_filter, "needs group_size >= 2 (it judges each prompt's group of responses)")
    for f in ("gamma", "lambda_actor", "lambda_critic"):
        _check_range(c, f, 0.0, 1.0)
    _check_range(c, "adaptive_lambda_alpha", 0.0, float("inf"), lo_open=True, hi_open=True)
    _check_range(c, "clip_low", 0.0, 1.0, lo_open=True, hi_open=True)
    _check_range(c, "clip_high", 0.0, float("inf"), lo_open=True, hi_open=True)
    if c.dual_clip != 0:
        _check_range(c, "dual_clip", 1.0, float("inf"), lo_open=True, hi_open=True)
    _check_range(c, "value_clip", 0.0, float("inf"), hi_open=True)
    _check_choice(c, "loss_agg", AGG_MODES)  # the lists are owned by the modules that implement them
    _check_choice(c, "kl_estimator", KL_KINDS)
    for f in ("kl_coef", "entropy_coef", "nll_coef"):
        _check_range(c, f, 0.0, float("inf"), hi_open=True)
    _check_int(c, "prompts_per_step", 1)
    _check_int(c, "group_size", 1)
    _check_int(c, "num_epochs", 1)
    _validate_minibatching(c, c.prompts_per_step * c.group_size)
    _validate_sampling(c)
    # The sampler would draw from the filtered distribution while the PPO ratio, the KL terms and the stored
    # log-probs use the full tempered one: every update would be silently off-policy.
    if c.sampling.top_k != 0 or c.sampling.top_p != 1.0:
        _fail("sampling.top_k" if c.sampling.top_k != 0 else "sampling.top_p",
              c.sampling.top_k if c.sampling.top_k != 0 else c.sampling.top_p,
              "must be 0 (top_k) and 1.0 (top_p) for RL: the training log-probs use the full tempered distribution, "
              "so filtered sampling would make the PPO ratio off-policy (top-k / top-p stay available to evaluation "
              "and to the sampler's API)")
    _validate_optim(c, "actor_optim")
    _check_int(c, "logprob_chunk", 1)
    _check_int(c, "num_steps", 0)
    _check_int(c, "eval_every", 1)
    _check_int(c, "eval_prompts", 1)
    _check_int(c, "diag_buckets", 1)
    _check_int(c, "diag_early_tokens", 1)
    _validate_rewards(c)
    if has_critic(c):
        _check_choice(c, "critic_init", CRITIC_INITS)
        _check_range(c, "critic_init_bias", -float("inf"), float("inf"), lo_open=True, hi_open=True)
        _validate_optim(c, "critic_optim")
        if c.critic_init in ("value_pretrain", "reward_model") and not c.critic_dir:
            _fail("critic_dir", c.critic_dir, f"must name a checkpoint directory when critic_init={c.critic_init!r}")
    else:
        if c.critic_init_bias != 0:  # the other critic fields are ignored without a critic; a bias means one was meant
            _fail("critic_init_bias", c.critic_init_bias, "must be 0 for advantage='group' (no critic)")
        if c.group_size < 2:
            _fail("group_size", c.group_size, "must be >= 2 for advantage='group' (advantages are relative within a "
                  "group)")


def _validate_rewards(c) -> None:
    if c.reward_correct <= c.reward_wrong:
        _fail("reward_correct", c.reward_correct, f"must be greater than config.reward_wrong={c.reward_wrong}")


def _validate_value(c) -> None:
    _check_choice(c, "critic_init", ("actor", "reward_model"))
    if c.critic_init == "reward_model" and not c.critic_dir:
        _fail("critic_dir", c.critic_dir, "must name a reward-model checkpoint when critic_init='reward_model'")
    _check_int(c, "prompts_per_step", 1)
    _check_int(c, "group_size", 1)
    _validate_minibatching(c, c.prompts_per_step * c.group_size)
    _validate_sampling(c)
    _validate_optim(c, "optim")
    _check_range(c, "gamma", 0.0, 1.0)
    _check_range(c, "truncated_fraction", 0.0, 1.0, hi_open=True)
    if c.stage == "value_pretrain" and c.truncated_fraction:
        _fail("truncated_fraction", c.truncated_fraction,
              "must be 0 for value pretraining (its targets are Monte-Carlo returns; truncation labels the reward "
              "model's)")
    _check_int(c, "min_steps", 0)
    _check_int(c, "max_steps", 1)
    if c.min_steps > c.max_steps:
        _fail("min_steps", c.min_steps, f"must be <= config.max_steps={c.max_steps}")
    _check_int(c, "converge_window", 1)
    _check_range(c, "converge_rtol", 0.0, float("inf"), hi_open=True)
    _check_range(c, "converge_atol", 0.0, float("inf"), hi_open=True)
    _check_int(c, "logprob_chunk", 1)
    _validate_rewards(c)


def _validate_sft(c) -> None:
    _check_int(c, "batch_size", 1)
    _check_int(c, "num_steps", 0)
    _check_range(c, "direct_fraction", 0.0, 1.0)
    _check_int(c, "pad_to_multiple", 0)
    _check_int(c, "late_steps", 0)  # >= num_steps: the whole run uses late_direct_fraction
    _check_range(c, "late_direct_fraction", 0.0, 1.0)
    _validate_optim(c, "optim")
    _validate_sampling(c)
    _check_int(c, "eval_every", 1)
    _check_int(c, "eval_prompts", 1)


def has_critic(config: ml_collections.ConfigDict) -> bool:
    """Whether an RL config trains a critic: `advantage` alone decides (GAE needs one, group advantages none)."""
    return config.advantage == "gae"


def validate(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """Checks every field an entrypoint reads; raises `ConfigError` naming the first bad field. Returns `config`."""
    _validate_common(config)
    {"rl": _validate_rl, "sft": _validate_sft, "value_pretrain": _validate_value,
      "reward_model": _validate_value}[config.stage](config)
    return config
