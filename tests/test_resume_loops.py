"""Resume through the real loops, and logged values recomputed from scratch.

(A) For every RL algorithm (`run_rl`: VC-PPO, PPO with a reward-model critic, GRPO with `ref_params`) and both
critic stages (`run_value_training`: value pretraining, reward model), a run stopped after step k and resumed to
step N equals the uninterrupted N-step run: every saved step's whole state (params, optimizer states, RNG, step
counter = data position, GRPO's reference params), the checkpoint meta and every training record of metrics.jsonl.
Both runs go through `stages.run_stage`; the interruption is a finished k-step run whose `num_steps` / `max_steps`
then grows to N (the loops restore the newest checkpoint and continue from its step).

(B) The rollout metrics each RL iteration logs equal what an independent recomputation gives: the documented
prompts (`batch_indices(seed, step)`, each repeated `group_size` times) sampled with the documented key
(`fold_in(PRNGKey(seed), step)`) from the policy of that iteration (the SFT checkpoint for the first, the run's
saved step before it for later ones), decoded and scored with the task's verifier here. For VC-PPO (gamma = 1,
lambda_critic = 1) the logged `returns/mean` is the token mean of each row's Monte-Carlo return, i.e. of its
sequence reward.

The policy is an SFT run long enough to answer some 1-digit sums right, so rollouts mix right and wrong answers
of different lengths (checked: otherwise (B) could not tell a token mean from a row mean, and GRPO would not
move). The session's persistent compilation cache (conftest.py) lets repeated runs load the programs the first run
compiled.
"""

import json
import math
import pathlib
import shutil

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_pipeline import tiny_config
from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stages
from vcppo_jax.data.batching import batch_indices
from vcppo_jax.metrics import METRICS_FILE
from vcppo_jax.models import CausalLM
from vcppo_jax.rewards import extract_synthetic_answer
from vcppo_jax.rollout import prompt_batch
from vcppo_jax.sampling import make_sampler

N = 3  # steps of every run
INTERRUPT_AT = {"value_pretrain": 1, "reward_model": 2, "vcppo": 1, "ppo": 2, "grpo": 2}
CRITIC_STAGES = ("value_pretrain", "reward_model")
ALGORITHMS = ("vcppo", "ppo", "grpo")
CRITIC_OF = {"vcppo": "value_pretrain", "ppo": "reward_model", "grpo": None}
# 2 one-digit terms: answers 0..18, which the tiny policy gets right some of the time after SFT_STEPS steps at lr
# 1e-2 (its chain-of-thought answers are clipped at 16 tokens and wrong). 48 problems: at most half the 100 these
# knobs allow.
KNOBS = dict(min_digits=1, max_digits=1, num_train=32, num_test=16)
SFT_STEPS = 150
# GRPO samples one prompt 8 times (configs/grpo.py's group size): with this seed the first group mixes right and
# wrong answers, so GRPO moves from the first step on (a group scored alike has zero advantage).
RL_FIELDS = {"grpo": dict(prompts_per_step=1, group_size=8)}


def rl_config(algorithm: str, root, **fields) -> ml_collections.ConfigDict:
    c = tiny_config(algorithm, root, num_steps=N, save_every=1, max_to_keep=N, **RL_FIELDS.get(algorithm, {}))
    c.task.knobs.update(KNOBS)
    for stage in CRITIC_STAGES:  # as `critic_config`, should run_stage ever start them itself
        c.stage_overrides[stage].max_steps = N
    c.update({k: str(v) if isinstance(v, pathlib.Path) else v for k, v in fields.items()})
    return c


def critic_config(stage: str, root, **fields) -> ml_collections.ConfigDict:
    parent = rl_config("vcppo" if stage == "value_pretrain" else "ppo", root)
    c = stages.derived_config(parent, stage, str(pathlib.Path(root) / stage))
    c.update(dict(save_every=1, max_to_keep=N))
    c.update({k: str(v) if isinstance(v, pathlib.Path) else v for k, v in fields.items()})
    return c


def sft_config(root) -> ml_collections.ConfigDict:
    parent = rl_config("vcppo", root)
    c = stages.derived_config(parent, "sft", parent.sft_dir)
    c.update(dict(num_steps=SFT_STEPS, eval_every=SFT_STEPS))
    c.optim.update(dict(lr=1e-2, warmup_steps=0, decay_steps=0))
    return c


def config_for(name: str, root, **fields) -> ml_collections.ConfigDict:
    return (critic_config if name in CRITIC_STAGES else rl_config)(name, root, **fields)


def steps_field(name: str) -> str:
    return "max_steps" if name in CRITIC_STAGES else "num_steps"


def records(workdir) -> list[dict]:
    """metrics.jsonl as written, one dict per line (not merged by step)."""
    with open(pathlib.Path(workdir) / METRICS_FILE) as f:
        return [json.loads(line) for line in f if line.strip()]


def training_records(workdir) -> list[dict]:
    """The per-step training records without the wall-clock timings (perf/*)."""
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in records(workdir)
            if "train/nonfinite" in r]


def saved_steps(workdir) -> list[int]:
    with ckpt_lib.Checkpointer(workdir) as ckpt:
        return ckpt.all_steps()


def saved_state(workdir, step: int) -> dict:
    """The whole saved state tree of `step` (no target: every leaf, whatever the loop put there), as numpy."""
    with ocp.StandardCheckpointer() as reader:
        return jax.device_get(reader.restore(pathlib.Path(workdir).resolve() / str(step) / ckpt_lib.STATE))


def assert_same_tree(got, want, what):
    flat_got = jax.tree_util.tree_flatten_with_path(got)[0]
    flat_want = jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], what
    for (path, g), (_, w) in zip(flat_got, flat_want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, jax.tree_util.keystr(path))
        if np.issubdtype(w.dtype, np.floating):
            np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-6, err_msg=f"{what} {jax.tree_util.keystr(path)}")
        else:  # PRNG key data, step and update counters: exact
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def params_of(state: dict, name: str):
    return state["critic_params"] if name in CRITIC_STAGES else state["actor"]["params"]


def moved(a, b) -> bool:
    return any(not np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A module-scoped pipeline root holding the shared SFT run."""
    root = tmp_path_factory.mktemp("resume_loops")
    stages.run_stage(sft_config(root))
    return root


@pytest.fixture(scope="module")
def uninterrupted(root):
    """`get(name)`: the config of the uninterrupted N-step run of a critic stage or algorithm (run once, on first
    use; an algorithm's critic stage first)."""
    done = {}

    def get(name: str) -> ml_collections.ConfigDict:
        if name not in done:
            if CRITIC_OF.get(name):
                get(CRITIC_OF[name])
            config = config_for(name, root)
            stages.run_stage(config)
            done[name] = config
        return done[name]

    return get


# ---------------------------------------------------------------------------------------------------------------
# (A) Interrupted at k and resumed == uninterrupted.
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", CRITIC_STAGES + ALGORITHMS)
def test_resumed_run_equals_uninterrupted_run(root, uninterrupted, name):
    reference = uninterrupted(name).workdir
    workdir = root / f"{name}_resumed"
    k = INTERRUPT_AT[name]
    stages.run_stage(config_for(name, root, workdir=workdir, **{steps_field(name): k}))
    assert saved_steps(workdir) == list(range(1, k + 1)) and ckpt_lib.read_meta(workdir)["done"]
    stages.run_stage(config_for(name, root, workdir=workdir, **{steps_field(name): N}))

    assert saved_steps(workdir) == saved_steps(reference) == list(range(1, N + 1))
    for step in range(1, N + 1):
        assert_same_tree(saved_state(workdir, step), saved_state(reference, step), f"{name} step {step}")
    final = saved_state(reference, N)
    if name in ALGORITHMS:
        assert int(final["step"]) == N  # RL iterations done == data position
        assert ("critic" in final) == (name != "grpo") and ("ref_params" in final) == (name == "grpo")
    # Not vacuous: the runs trained (the state moved from the first saved step to the last), and GRPO's policy had
    # left its reference policy when the run was interrupted.
    assert moved(params_of(final, name), params_of(saved_state(reference, 1), name))
    if name == "grpo":
        at_k = saved_state(reference, k)
        assert moved(at_k["actor"]["params"], at_k["ref_params"])
    # eval, histories, done, and what the run was built from; only the run's own id differs (two runs).
    meta, want = ckpt_lib.read_meta(workdir, N), ckpt_lib.read_meta(reference, N)
    assert meta["provenance"].pop("run_id") != want["provenance"].pop("run_id")
    assert meta == want
    assert {ckpt_lib.read_meta(workdir, s)["provenance"]["run_id"] for s in range(1, N + 1)} == {
        ckpt_lib.read_meta(workdir, N)["provenance"]["run_id"]}  # one id across the interruption

    want = training_records(reference)
    assert [r["step"] for r in want] == list(range(1, N + 1))
    assert training_records(workdir) == want
    if name in ALGORITHMS:
        evals = lambda d: [r for r in records(d) if "eval/pass@1" in r]  # noqa: E731
        assert [r["step"] for r in evals(reference)] == [0, N]
        # The finished k-step run evaluated at k too; the evaluations the two runs share are equal.
        assert [r["step"] for r in evals(workdir)] == [0, k, N]
        assert [r for r in evals(workdir) if r["step"] != k] == evals(reference)


def test_grpo_resumes_with_the_drift_probe(root, uninterrupted):
    """GRPO as configs/grpo.py runs it (kl_coef > 0, eval_kl_to_sft): resumed from a checkpoint, the next
    iteration trains, evaluates (with probe/kl_to_sft) and saves."""
    workdir = root / "grpo_probe_resumed"
    shutil.copytree(uninterrupted("grpo").workdir, workdir)
    stages.run_stage(rl_config("grpo", root, workdir=workdir, num_steps=N + 1, eval_kl_to_sft=True))
    assert saved_steps(workdir)[-1] == N + 1
    last = records(workdir)[-1]
    assert last["step"] == N + 1 and math.isfinite(last["probe/kl_to_sft"])


# ---------------------------------------------------------------------------------------------------------------
# (B) Logged rollout metrics == an independent recomputation.
# ---------------------------------------------------------------------------------------------------------------


def policy_after(config: ml_collections.ConfigDict, step: int):
    """(runtime, actor, params) of the policy after `step` RL updates: the SFT checkpoint for 0, else the run's."""
    rt = rt_lib.make_runtime(config)
    cfg = builders.model_config_from_json(ckpt_lib.read_meta(config.sft_dir)["model_config"], config)
    actor = CausalLM(cfg)
    target = rt.target(rt_lib.abstract_params(actor))
    params = (ckpt_lib.load_params(config.sft_dir, target, key="params") if step == 0 else
              ckpt_lib.load_params(config.workdir, target, key="actor/params", step=step))
    return rt, actor, params


def sample_and_score(config, step: int, split: str, indices, *, group_size: int, temperature: float, rng) -> dict:
    """Responses of the policy after `step` updates to the records `indices` of `split` (each `group_size` times):
    lengths, verifier rewards and texts, decoded here."""
    rt, actor, params = policy_after(config, step)
    tok = builders.tokenizer(config)
    verifier = builders.verifier(config)
    s, P, R = config.sampling, config.task.max_prompt_len, config.task.max_response_len
    sampler = make_sampler(actor, max_new_tokens=R, eos_id=tok.eos_token_id, pad_id=tok.pad_token_id,
                           temperature=temperature, top_k=s.top_k, top_p=s.top_p)
    pb = prompt_batch(builders.task_source(config, split), indices, tok, max_prompt_len=P, group_size=group_size)
    with rt.context():
        out = jax.device_get(sampler(params, rt.place_batch(pb.tokens), rt.place_batch(pb.mask), rng))
    lengths = np.asarray(out.lengths)
    responses = np.asarray(out.tokens)[:, P:]
    texts = []
    for row, n in zip(responses, lengths):
        ids = row[:n].tolist()
        if ids and ids[-1] == tok.eos_token_id:
            ids = ids[:-1]
        texts.append(tok.decode(ids))
    rewards = np.array([verifier(t, a) for t, a in zip(texts, pb.answers)], np.float64)
    return dict(lengths=lengths.astype(np.float64), rewards=rewards, texts=texts, answers=pb.answers)


def recompute_rollout(config: ml_collections.ConfigDict, step: int) -> dict:
    """Rows of RL iteration `step` (0-based) sampled again here, with the documented prompts and key."""
    train_size = len(builders.task_source(config, config.task.train_split))
    idx = batch_indices(train_size, config.prompts_per_step, step, config.seed)
    return sample_and_score(config, step, config.task.train_split, idx, group_size=config.group_size,
                            temperature=config.sampling.temperature,
                            rng=jax.random.fold_in(jax.random.PRNGKey(config.seed), step))


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_logged_rollout_metrics_equal_recomputed_rollouts(uninterrupted, algorithm):
    config = uninterrupted(algorithm)
    logged = {r["step"]: r for r in records(config.workdir) if "train/nonfinite" in r}
    R = config.task.max_response_len
    mixed_steps, weighted_steps = [], []
    for step in range(N):
        ro = recompute_rollout(config, step)
        lengths, rewards = ro["lengths"], ro["rewards"]
        assert set(rewards) <= {config.reward_correct, config.reward_wrong}
        want = {"rollout/accuracy": np.mean(rewards == config.reward_correct),
                "rollout/reward_mean": rewards.mean(),
                "rollout/response_length_mean": lengths.mean(),
                "rollout/response_length_max": lengths.max(),
                "rollout/response_length_min": lengths.min(),
                "rollout/clip_ratio": np.mean(lengths == R)}
        got = {k: logged[step + 1][k] for k in want}
        assert got == pytest.approx(want, rel=1e-6, abs=1e-7), (step, ro["texts"], ro["answers"])
        if algorithm == "vcppo":
            assert config.gamma == 1.0 and config.lambda_critic == 1.0
            # Monte-Carlo return of every response token = its row's sequence reward; the mean is over tokens.
            mc_mean = (lengths * rewards).sum() / lengths.sum()
            assert logged[step + 1]["returns/mean"] == pytest.approx(mc_mean, abs=1e-5), step
            if abs(mc_mean - rewards.mean()) > 1e-3:
                weighted_steps.append(step)
        if len(set(rewards)) > 1:
            mixed_steps.append(step)
    # Not vacuous: some iteration mixes right and wrong answers, and (VC-PPO) one where the token mean of the
    # returns differs from their row mean (right and wrong answers of different lengths).
    assert mixed_steps, "every rollout scored alike: pick another seed / SFT length"
    assert algorithm != "vcppo" or weighted_steps, "returns/mean check cannot tell token from row means"


def test_logged_greedy_eval_equals_greedy_decoding_here(uninterrupted):
    """The eval records (steps 0 and N) are the greedy policy's: pass@1, mean length, direct-answer fraction, answer
    (format) rate and clip ratio of argmax decoding of the first `eval_prompts` test records, decoded and scored
    here, equal the logged ones."""
    config = uninterrupted("vcppo")
    assert config.sampling.temperature > 0  # a sampled eval would differ from greedy decoding
    logged = {r["step"]: r for r in records(config.workdir) if "eval/pass@1" in r}
    batch = min(config.eval_prompts, config.prompts_per_step * config.group_size)
    num_prompts = min(config.eval_prompts, len(builders.task_source(config, config.task.test_split)))
    lengths = []
    for step in (0, N):
        got = []
        for start in range(0, num_prompts - num_prompts % batch, batch):
            got.append(sample_and_score(config, step, config.task.test_split, range(start, start + batch),
                                        group_size=1, temperature=0.0, rng=jax.random.PRNGKey(12345)))
        rewards = np.concatenate([g["rewards"] for g in got])
        lens = np.concatenate([g["lengths"] for g in got])
        texts = [t for g in got for t in g["texts"]]
        want = {"eval/pass@1": np.mean(rewards >= config.reward_correct), "eval/response_length_mean": lens.mean(),
                "eval/direct_fraction": np.mean(["\n" not in t.strip() for t in texts]),
                "eval/answer_rate": np.mean([extract_synthetic_answer(t) is not None for t in texts]),
                "eval/clip_ratio": np.mean(lens >= config.task.max_response_len)}
        assert {k: logged[step][k] for k in want} == pytest.approx(want, rel=1e-6), step
        lengths.append(lens)
    assert len(set(np.concatenate(lengths))) > 1  # not vacuous: lengths vary, so a sampled eval would show


def test_critic_init_bias_shifts_the_first_steps_values(root, uninterrupted):
    """`critic_init_bias` reaches the critic RL starts from: on the same first rollout (sampled before any update),
    every logged value bucket and the first-token critic error sit exactly the bias below the unbiased run's."""
    want = training_records(uninterrupted("vcppo").workdir)[0]
    config = rl_config("vcppo", root, workdir=root / "vcppo_bias", num_steps=1, critic_init_bias=-2.0)
    stages.run_stage(config)
    got = training_records(config.workdir)[0]
    assert got["rollout/accuracy"] == want["rollout/accuracy"] and got["step"] == want["step"] == 1
    buckets = [k for k in want if k.startswith("diag/value_pos") and want[k.replace("value", "tokens")] > 0]
    assert len(buckets) >= 2
    for k in buckets + ["diag/value_err_first"]:
        assert got[k] == pytest.approx(want[k] - 2.0, abs=1e-5), k
