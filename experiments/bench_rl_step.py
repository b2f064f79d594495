"""Benchmarks one RL iteration (generation + update) of our GRPO and VC-PPO against TRL's GRPOTrainer, on CPU.

A random Qwen2ForCausalLM is built with transformers and written with `save_pretrained` (as in bench_sampling.py);
our side reads it with `load_hf_checkpoint` (critic = `critic_params_from_actor`), TRL's side loads the same folder.
Both do the same work per iteration: `prompts x group` rollouts of exactly --response-len tokens (no stop token:
ours eos_id=None, TRL min_new_tokens = max_completion_length), temperature 1, a trivial reward (sum of the response
token ids mod 2), then `num_minibatches` (2) optimizer steps of AdamW (lr 1e-6, grad clip 1.0) on half the batch each.
KL to a reference is off on both sides (TRL's default beta = 0), one PPO epoch (TRL num_iterations = 1).

Each measurement runs in a fresh subprocess of this script so that its peak RSS (ru_maxrss) is its own: 'peak MiB'
is the child's whole-process peak, 'growth MiB' is peak minus the RSS right after loading the model (i.e. what
generation + update add, incl. XLA compile / torch autograd buffers). On an accelerator the length sweep also prints
'device peak MiB', the device allocator's peak (jax `memory_stats()`; nan on CPU).

Run (from the repo root):
  .venv/bin/python experiments/bench_rl_step.py --quick          # d=64 x 2 layers, 2 prompts x 4, P=16, R=32
  .venv/bin/python experiments/bench_rl_step.py                  # d=128 x 2 layers, 4 x 4, P=32, R=128;
                                                                 # cost vs length at R = 256, 1024
  .venv/bin/python experiments/bench_rl_step.py --no-peers --remat --lengths=1024,4096 --iters=1
                                                                 # long responses, layer remat in the update
  .venv/bin/python experiments/bench_rl_step.py --lengths=64,256  # override the length sweep (ours, VC-PPO)

TRL is optional (not in requirements.txt); without it the TRL row says so and our rows still print.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import tempfile
import time

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # runnable as a script from the repo root
PAD_ID = 0
PRESETS = {
    "quick": dict(prompts=2, group=4, prompt_len=16, response_len=32, hidden=64, layers=2, vocab=512, iters=3,
                  lengths="32,64,128"),
    # 4096 is left out of the default sweep (minutes per iteration on CPU). With dense attention (--attention=xla)
    # and no --remat its update materializes [8, 4, 4128, 4128] scores per layer: past 17 GiB on a 24 GiB machine.
    "default": dict(prompts=4, group=4, prompt_len=32, response_len=128, hidden=128, layers=2, vocab=2048, iters=3,
                    lengths="256,1024"),
}
NUM_MINIBATCHES = 2
LR, GRAD_CLIP = 1e-6, 1.0


def bench_hparams(advantage: str, *, prompt_len: int, group_size: int, num_epochs: int, num_minibatches: int,
                  logprob_chunk: int):
    """The RL update both benchmarks time (this one and bench_mfu): whitened advantages, symmetric clip 0.2,
    token-mean, no KL / entropy / NLL terms; lambda_actor 0.95 with a critic, 1.0 without."""
    from vcppo_jax import rl  # noqa: PLC0415 (after the thread settings)

    return rl.RLHparams(
        advantage=advantage, prompt_len=prompt_len, group_size=group_size, gamma=1.0,
        lambda_actor=0.95 if advantage == "gae" else 1.0, lambda_critic=1.0, adaptive_lambda=False,
        adaptive_lambda_alpha=0.05, whiten_advantages=True, grpo_normalize_std=True, clip_low=0.2, clip_high=0.2,
        dual_clip=None, value_clip=None, loss_agg="token-mean", kl_coef=0.0, kl_estimator="k3", kl_in_reward=False,
        entropy_coef=0.0, nll_coef=0.0, num_epochs=num_epochs, num_minibatches=num_minibatches,
        logprob_chunk=logprob_chunk, temperature=1.0, diag_buckets=16, diag_early_tokens=16)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def _set_threads(threads: int) -> None:
    import torch  # noqa: PLC0415

    if threads:
        torch.set_num_threads(threads)
        # Read when the XLA backend starts (first jax computation), so setting it here still applies.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                                   f"{str(threads > 1).lower()} intra_op_parallelism_threads={threads}")


def build_checkpoint(folder: str, hidden: int, layers: int, vocab: int, max_len: int, seed: int = 0) -> None:
    """Random Qwen2ForCausalLM (+ a word-level tokenizer 't0'..'t{vocab-1}' for TRL) written to `folder`."""
    import tokenizers  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import transformers as tr  # noqa: PLC0415

    heads = max(2, hidden // 32)
    cfg = tr.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=max_len,
                         tie_word_embeddings=False, eos_token_id=vocab - 1, bos_token_id=None, pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    tr.Qwen2ForCausalLM(cfg).save_pretrained(folder)
    words = {f"t{i}": i for i in range(vocab)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="t1"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    tok.decoder = tokenizers.decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = tr.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token=f"t{vocab - 1}", unk_token="t1")
    fast.padding_side = "left"
    fast.save_pretrained(folder)


def prompt_ids(num: int, prompt_len: int, vocab: int, seed: int = 0):
    """[num, prompt_len] token ids in [2, vocab - 1) (no pad / unk / eos), all prompts full length."""
    import numpy as np  # noqa: PLC0415

    return np.random.default_rng(seed).integers(2, vocab - 1, size=(num, prompt_len)).astype(np.int32)


# ------------------------------------------------------------------------------------------------ children
def run_ours(o: dict) -> dict:
    """Times `iters` RL iterations of ours (after one warmup iteration = jit compile)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from vcppo_jax import rl  # noqa: PLC0415
    from vcppo_jax.models import CausalLM, ValueModel, critic_params_from_actor, load_hf_checkpoint  # noqa: PLC0415
    from vcppo_jax.optim import init_model_state  # noqa: PLC0415
    from vcppo_jax.rollout import to_rollout  # noqa: PLC0415
    from vcppo_jax.sampling import make_sampler  # noqa: PLC0415

    algo, b, p, r = o["algo"], o["prompts"] * o["group"], o["prompt_len"], o["response_len"]
    cfg, variables = load_hf_checkpoint(o["folder"], remat=bool(o.get("remat")),
                                        attention_impl=o.get("attention") or None)
    actor = CausalLM(cfg)
    advantage = {"grpo": "group", "vcppo": "gae"}[algo]
    has_critic = advantage == "gae"
    critic = ValueModel(cfg) if has_critic else None
    hp = bench_hparams(advantage, prompt_len=p, group_size=o["group"], num_epochs=1, num_minibatches=NUM_MINIBATCHES,
                       logprob_chunk=min(128, r))
    tx = optax.chain(optax.clip_by_global_norm(GRAD_CLIP), optax.adamw(LR))
    params = jax.device_put(variables["params"])
    critic_state = init_model_state(critic_params_from_actor({"params": params})["params"], tx) if has_critic \
        else None
    state = rl.RLState(actor=init_model_state(params, tx), critic=critic_state, ref_params=None,
                       rng=jax.random.key(0), step=jnp.zeros((), jnp.int32))
    sampler = make_sampler(actor, max_new_tokens=r, eos_id=None, pad_id=PAD_ID, temperature=1.0)
    experience_fn = jax.jit(rl.make_experience_fn(hp, actor, critic))
    update_fn = jax.jit(rl.make_update_fn(hp, actor, critic, tx, tx if has_critic else None), donate_argnums=0)
    prompts = np.repeat(prompt_ids(o["prompts"], p, cfg.vocab_size), o["group"], axis=0)  # groups are adjacent
    prompt_mask = np.ones_like(prompts, dtype=bool)
    base_rss = _rss_mib()

    def iteration(i: int):
        nonlocal state
        t0 = time.perf_counter()
        out = sampler(state.actor.params, prompts, prompt_mask, jax.random.key(i))
        seq_rewards = (np.asarray(out.tokens)[:, p:].sum(axis=1) % 2).astype(np.float32)
        rollout = to_rollout(out, prompt_mask, seq_rewards)
        t1 = time.perf_counter()
        experience, _ = experience_fn(state, rollout)
        state, m = update_fn(state, experience)
        jax.block_until_ready(m)
        return t1 - t0, time.perf_counter() - t1

    t0 = time.perf_counter()
    iteration(0)
    first = time.perf_counter() - t0
    gens, upds = zip(*(iteration(i + 1) for i in range(o["iters"])))
    stats = jax.devices()[0].memory_stats() or {}  # accelerators: the allocator's peak (host RSS says little there)
    return dict(first=first, gen=statistics.median(gens), update=statistics.median(upds),
                total=statistics.median(g + u for g, u in zip(gens, upds)), base_rss=base_rss, peak=_peak_mib(),
                params_m=cfg.num_params / 1e6, device_peak=stats.get("peak_bytes_in_use", 0) / 2**20 or None)


def run_trl(o: dict) -> dict:
    """Times `iters` iterations of TRL's GRPOTrainer (after one warmup iteration). One iteration = one generation
    of prompts x group completions + NUM_MINIBATCHES optimizer steps (steps_per_generation = NUM_MINIBATCHES)."""
    try:
        import trl  # noqa: PLC0415
        from datasets import Dataset  # noqa: PLC0415
    except ImportError as e:
        return dict(error=f"TRL not available ({e}); install e.g. `pip install trl==1.16.0` (adds accelerate, "
                          "datasets; keeps transformers 5.24.0 / torch 2.13.0)")
    import transformers as tr  # noqa: PLC0415

    b, p, r = o["prompts"] * o["group"], o["prompt_len"], o["response_len"]
    tok = tr.AutoTokenizer.from_pretrained(o["folder"])
    model = tr.AutoModelForCausalLM.from_pretrained(o["folder"], dtype="float32")
    steps = NUM_MINIBATCHES * (o["iters"] + 1)
    ids = prompt_ids(o["prompts"] * (o["iters"] + 1), p, model.config.vocab_size)
    dataset = Dataset.from_dict({"prompt": [" ".join(f"t{t}" for t in row) for row in ids]})

    lengths = []

    def reward(prompts, completions, completion_ids, **kwargs):
        lengths.extend(len(c) for c in completion_ids)  # checks below that every completion has exactly r tokens
        return [float(sum(c) % 2) for c in completion_ids]

    class Clock(tr.TrainerCallback):
        def __init__(self):
            self.ends = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ends.append(time.perf_counter())

    with tempfile.TemporaryDirectory() as out_dir:
        args = trl.GRPOConfig(
            output_dir=out_dir, use_cpu=True, bf16=False, fp16=False, report_to="none", logging_strategy="no",
            save_strategy="no", eval_strategy="no", disable_tqdm=True, dataloader_num_workers=0, seed=0,
            per_device_train_batch_size=b // NUM_MINIBATCHES, gradient_accumulation_steps=1,
            steps_per_generation=NUM_MINIBATCHES, num_generations=o["group"], max_completion_length=r,
            generation_kwargs={"min_new_tokens": r}, temperature=1.0, top_p=1.0, top_k=0, beta=0.0,
            num_iterations=1, learning_rate=LR, max_grad_norm=GRAD_CLIP, lr_scheduler_type="constant",
            warmup_steps=0, weight_decay=0.0, max_steps=steps, log_completions=False, shuffle_dataset=False,
            gradient_checkpointing=bool(o.get("remat")))
        clock = Clock()
        trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                                  processing_class=tok, callbacks=[clock])
        base_rss = _rss_mib()
        t0 = time.perf_counter()
        trainer.train()
    if not lengths or set(lengths) != {r}:
        return dict(error=f"TRL completions were not all {r} tokens long: lengths {sorted(set(lengths))}")
    ends = [t0] + clock.ends[NUM_MINIBATCHES - 1::NUM_MINIBATCHES]
    iters = [b_ - a for a, b_ in zip(ends[:-1], ends[1:])]
    return dict(first=iters[0], total=statistics.median(iters[1:]), base_rss=base_rss, peak=_peak_mib(),
                version=trl.__version__, completions=len(lengths))


def child(o: dict) -> None:
    _set_threads(o["threads"])
    res = run_trl(o) if o["algo"] == "trl" else run_ours(o)
    print("RESULT " + json.dumps(res), flush=True)


def spawn(o: dict, timeout: float) -> dict:
    cmd = [sys.executable, str(pathlib.Path(__file__).resolve()), "--child", json.dumps(o)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=REPO)
    except subprocess.TimeoutExpired:
        return dict(error=f"timed out after {timeout:.0f} s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
    return dict(error=f"exit {proc.returncode}: " + " | ".join(tail))


# ------------------------------------------------------------------------------------------------ parent
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("prompts", "group", "prompt-len", "response-len", "hidden", "layers", "vocab", "iters"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="default: from the preset")
    parser.add_argument("--lengths", type=str, default=None, help="comma-separated response lengths for the "
                        "cost-vs-length sweep (ours, VC-PPO); empty string skips it")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and XLA (0 = defaults)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement subprocess")
    parser.add_argument("--quick", action="store_true", help=f"preset {PRESETS['quick']}")
    parser.add_argument("--attention", choices=("", "xla", "cudnn", "blockwise"), default="",
                        help="our attention kernel ('' = by length: blockwise from 1024 tokens, dense below)")
    parser.add_argument("--remat", action="store_true", help="recompute each layer in the backward pass (ours: "
                        "ModelConfig.remat; TRL: gradient_checkpointing) to cut the update's activation memory")
    parser.add_argument("--no-peers", action="store_true", help="skip the GRPO / VC-PPO / TRL comparison, run "
                        "only the length sweep")
    parser.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(json.loads(args.child))
        return
    opts = dict(PRESETS["quick" if args.quick else "default"])
    opts.update({k: v for k, v in vars(args).items() if k in opts and v is not None})
    try:
        lengths = [int(x) for x in opts["lengths"].split(",") if x.strip()]
    except ValueError:
        parser.error(f"--lengths must be comma-separated ints, got {opts['lengths']!r}")
    sizes = {k: v for k, v in opts.items() if k != "lengths"}
    if min(sizes.values()) < 1 or min(lengths, default=1) < 1 or args.threads < 0:
        parser.error(f"sizes, lengths and threads must be positive, got {opts}, threads={args.threads}")
    if opts["group"] < 2 or (opts["prompts"] * opts["group"]) % NUM_MINIBATCHES:
        parser.error(f"--group must be >= 2 and prompts*group divisible by {NUM_MINIBATCHES}, got {sizes}")
    if opts["hidden"] % 64:
        parser.error(f"--hidden must be a multiple of 64, got {opts['hidden']}")
    max_len = opts["prompt_len"] + max([opts["response_len"], *lengths])

    import torch  # noqa: PLC0415
    import transformers as tr  # noqa: PLC0415

    b = opts["prompts"] * opts["group"]
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder, opts["hidden"], opts["layers"], opts["vocab"], max_len)
        base = dict(sizes, folder=folder, threads=args.threads, remat=args.remat, attention=args.attention)
        results = {} if args.no_peers else {a: spawn(dict(base, algo=a), args.timeout) for a in ("grpo", "vcppo", "trl")}
        sweep = {n: spawn(dict(base, algo="vcppo", response_len=n), args.timeout) for n in lengths}

    trl_version = results.get("trl", {}).get("version", "not run" if args.no_peers else "not available")
    print(f"torch {torch.__version__} | transformers {tr.__version__} | trl {trl_version} | threads={args.threads} | "
          f"remat={args.remat} attention={args.attention or 'by length'} | Qwen2 d={opts['hidden']} L={opts['layers']} vocab={opts['vocab']} | "
          f"{opts['prompts']} prompts x {opts['group']} samples = {b} rollouts, prompt {opts['prompt_len']} + "
          f"response {opts['response_len']} tokens, {NUM_MINIBATCHES} optimizer steps/iteration, median of "
          f"{opts['iters']} iterations after a warmup")
    notes = ["first iter includes our jit compile"]
    if results:
        header = (f"| {'implementation':<22} | {'first iter s':>12} | {'gen s':>7} | {'update s':>8} | {'iter s':>8} "
                  f"| {'tokens/s':>9} | {'vs TRL':>7} | {'peak MiB':>8} | {'growth MiB':>10} |")
        sep = "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|"
        print(header + "\n" + sep)
        trl_t = results["trl"].get("total")
        names = {"grpo": "vcppo_jax GRPO", "vcppo": "vcppo_jax VC-PPO", "trl": "TRL GRPOTrainer"}
        for a, res in results.items():
            if "error" in res:
                print(f"| {names[a]:<22} | {res['error']}")
                continue
            f = lambda k, w, d=3: f"{res[k]:>{w}.{d}f}" if k in res else f"{'-':>{w}}"  # noqa: E731
            ratio = f"{trl_t / res['total']:>6.2f}x" if trl_t else f"{'-':>7}"
            print(f"| {names[a]:<22} | {f('first', 12, 2)} | {f('gen', 7)} | {f('update', 8)} | {f('total', 8)} "
                  f"| {b * opts['response_len'] / res['total']:>9.0f} | {ratio} | {res['peak']:>8.0f} "
                  f"| {res['peak'] - res['base_rss']:>10.0f} |")
        notes.append("'vs TRL' = TRL iteration time / ours (>1: ours faster); tokens/s = generated tokens / iteration "
                     "time")
        if "error" in results["trl"]:
            notes.append("TRL row missing: " + results["trl"]["error"])
    if sweep:
        print(f"\nCost vs response length (vcppo_jax VC-PPO, {b} rollouts, prompt {opts['prompt_len']}):")
        header = (f"| {'response len':>12} | {'first iter s':>12} | {'gen s':>8} | {'update s':>8} | {'iter s':>8} "
                  f"| {'peak MiB':>8} | {'growth MiB':>10} | {'device peak MiB':>15} |")
        print(header + "\n" + "|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
        for n, res in sweep.items():
            if "error" in res:
                print(f"| {n:>12} | {res['error']}")
                continue
            print(f"| {n:>12} | {res['first']:>12.2f} | {res['gen']:>8.3f} | {res['update']:>8.3f} "
                  f"| {res['total']:>8.3f} | {res['peak']:>8.0f} | {res['peak'] - res['base_rss']:>10.0f} "
                  f"| {res.get('device_peak') or float('nan'):>15.0f} |")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
