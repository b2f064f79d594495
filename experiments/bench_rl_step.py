"""Benchmarks one RL iteration (generation + update) of our GRPO and VC-PPO against TRL's GRPOTrainer, on CPU.

A random Qwen2ForCausalLM is built with transformers and written with `save_pretrained` (as in bench_sampling.py);
our side reads it with `load_hf_checkpoint` (critic = `critic_params_from_actor`), TRL's side loads the same folder.
Both do the same work per iteration: `prompts x group` rollouts of exactly R response tokens (no stop token:
ours eos_id=None, TRL min_new_tokens = max_completion_length), temperature 1, a trivial reward (sum of the response
token ids mod 2), then `num_minibatches` (2) optimizer steps of AdamW (lr 1e-6, grad clip 1.0) on half the batch each.
KL to a reference is off on both sides (TRL's default beta = 0), one PPO epoch (TRL num_iterations = 1).

Each measurement runs in a fresh subprocess of this script so that its peak RSS (VmHWM) is its own: 'peak MiB'
is the child's whole-process peak, 'growth MiB' is peak minus the RSS right after loading the model (i.e. what
generation + update add, incl. XLA compile / torch autograd buffers), 'timed peak MiB' the peak over the timed
iterations alone (the kernel's VmHWM, reset after the warmup iteration: no compile). On an accelerator the length
sweep also prints 'device peak MiB', the device allocator's peak (jax `memory_stats()`; nan on CPU). Each subprocess
runs under an address-space cap (--memory-cap-gib), so a configuration that does not fit (dense attention at 8k)
prints an out-of-memory row instead of swapping the machine.

Run (from the repo root):
  .venv/bin/python experiments/bench_rl_step.py --quick          # d=64 x 2 layers, 2 prompts x 4, P=16, R=32
  .venv/bin/python experiments/bench_rl_step.py                  # d=128 x 2 layers, 4 x 4, P=32, peers at R=128;
                                                                 # cost vs length at R = 256, 1024
  .venv/bin/python experiments/bench_rl_step.py --peer-lengths=128,1024,4096 --lengths= --remat=both --iters=1
                                                                 # ours vs TRL at 128 / 1k / 4k, remat off and on
  .venv/bin/python experiments/bench_rl_step.py --no-peers --lengths=1024,4096,8192 --attention=xla,blockwise \\
      --remat=both --iters=1                                     # dense vs blockwise attention, remat off and on

TRL is optional (not in requirements.txt); without it the TRL row says so and our rows still print.
"""

from __future__ import annotations

import argparse
import ctypes
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
PAD_ID = 0
PRESETS = {
    "quick": dict(prompts=2, group=4, prompt_len=16, peer_lengths="32", hidden=64, layers=2, vocab=512, iters=3,
                  lengths="32,64,128"),
    # 4096 is left out of the default sweep (minutes per iteration on CPU). With dense attention (--attention=xla)
    # and no --remat its update materializes [8, 4, 4128, 4128] scores per layer: past 17 GiB on a 24 GiB machine.
    "default": dict(prompts=4, group=4, prompt_len=32, peer_lengths="128", hidden=128, layers=2, vocab=2048,
                    iters=3, lengths="256,1024"),
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


def _status_mib(field: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _status_mib("VmRSS")


class Peaks:
    """This process's peak RSS over its whole life, and over a timed part alone.

    The kernel keeps one high-water mark (VmHWM, which getrusage's ru_maxrss also reads); `start_timed` saves it,
    hands the memory freed so far (the compiler's, kept resident in malloc's free lists) back to the OS and resets
    it, so that `timed` is the peak of what follows (no compile, no warmup allocations) and `whole` still covers
    everything."""

    def __init__(self):
        self._before = 0.0
        self._timing = False

    def start_timed(self) -> None:
        self._before = max(self._before, _status_mib("VmHWM"))
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self._timing = True

    def whole(self) -> float:
        return max(self._before, _status_mib("VmHWM"))

    def timed(self) -> float | None:
        return _status_mib("VmHWM") if self._timing else None


def set_threads(threads: int, torch_too: bool) -> None:
    """One `threads` count for XLA and, with `torch_too`, torch (bench_sampling; here TRL's child only: our child
    never imports torch, which would add ~180 MiB of RSS that our RL step does not use)."""
    if threads and torch_too:
        import torch  # noqa: PLC0415

        torch.set_num_threads(threads)
    if threads:
        # Read when the XLA backend starts (first jax computation), so setting it here still applies. XLA has no
        # thread-count flag: this keeps its matmuls on one thread (a bare word here, such as TF's
        # 'intra_op_parallelism_threads=1' we had, makes XLA silently ignore every flag after it).
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen="
                                   f"{str(threads > 1).lower()}")


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
def run_ours(o: dict, peaks: Peaks) -> dict:
    """Times `iters` RL iterations of ours (after one warmup iteration = jit compile)."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415
    import optax  # noqa: PLC0415

    from vcppo_jax import rl  # noqa: PLC0415
    from vcppo_jax.compile_options import jit_training  # noqa: PLC0415
    from vcppo_jax.models import CausalLM, ValueModel, critic_params_from_actor, load_hf_checkpoint  # noqa: PLC0415
    from vcppo_jax.optim import init_model_state  # noqa: PLC0415
    from vcppo_jax.rollout import to_rollout  # noqa: PLC0415
    from vcppo_jax.sampling import make_sampler  # noqa: PLC0415

    algo, p, r = o["algo"], o["prompt_len"], o["response_len"]
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
    experience_fn = jit_training(rl.make_experience_fn(hp, actor, critic))
    update_fn = jit_training(rl.make_update_fn(hp, actor, critic, tx, tx if has_critic else None), donate_argnums=0)
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
    warm = iteration(0)
    first = time.perf_counter() - t0
    if o["iters"]:
        peaks.start_timed()
    # iters = 0: only the warmup iteration, compile included (long responses, where it is a small part).
    gens, upds = zip(*(iteration(i + 1) for i in range(o["iters"]))) if o["iters"] else zip(warm)
    stats = jax.devices()[0].memory_stats() or {}  # accelerators: the allocator's peak (host RSS says little there)
    return dict(first=first, gen=statistics.median(gens), update=statistics.median(upds),
                total=statistics.median(g + u for g, u in zip(gens, upds)), base_rss=base_rss, peak=peaks.whole(),
                timed_peak=peaks.timed(), params_m=cfg.num_params / 1e6,
                device_peak=stats.get("peak_bytes_in_use", 0) / 2**20 or None)


def run_trl(o: dict, peaks: Peaks) -> dict:
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
            if len(self.ends) == NUM_MINIBATCHES and o["iters"]:  # the warmup iteration is over
                peaks.start_timed()

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
    return dict(first=iters[0], total=statistics.median(iters[1:] or iters), base_rss=base_rss, peak=peaks.whole(),
                timed_peak=peaks.timed(), version=trl.__version__,
                completions=len(lengths))


def child(o: dict) -> None:
    if o["memory_cap_gib"]:  # a measurement that does not fit fails alone instead of swapping the machine
        cap = int(o["memory_cap_gib"] * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    set_threads(o["threads"], torch_too=o["algo"] == "trl")
    res = (run_trl if o["algo"] == "trl" else run_ours)(o, Peaks())
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
    if any(m in line.lower() for line in tail for m in ("resource_exhausted", "memoryerror", "out of memory")):
        return dict(error=f"out of memory (over the {o['memory_cap_gib']:g} GiB address-space cap): " + tail[-1][:160])
    return dict(error=f"exit {proc.returncode}: " + " | ".join(tail))


# ------------------------------------------------------------------------------------------------ parent
REMATS = {"off": (False,), "on": (True,), "both": (False, True)}
NAMES = {"grpo": "vcppo_jax GRPO", "vcppo": "vcppo_jax VC-PPO", "trl": "TRL GRPOTrainer"}


def _ints(text: str, flag: str, parser) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} must be comma-separated ints, got {text!r}")


def _mib(x: float | None, width: int) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.0f}"


def _table(header: list[tuple[str, int]]) -> str:
    line = "| " + " | ".join(f"{name:>{w}}" for name, w in header) + " |"
    return line + "\n|" + "|".join("-" * (w + 2) for _, w in header) + "|"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("prompts", "group", "prompt-len", "hidden", "layers", "vocab"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="default: from the preset")
    parser.add_argument("--iters", type=int, default=None, help="timed iterations after the warmup (default: from "
                        "the preset; 0 = time only the warmup iteration, compile included)")
    parser.add_argument("--peer-lengths", type=str, default=None, help="comma-separated response lengths at which "
                        "GRPO, VC-PPO and TRL are compared (default: the preset's)")
    parser.add_argument("--lengths", type=str, default=None, help="comma-separated response lengths for the "
                        "cost-vs-length sweep (ours, VC-PPO); empty string skips it")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and XLA (0 = defaults)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per measurement subprocess")
    parser.add_argument("--memory-cap-gib", type=float, default=None, help="address-space limit of each measurement "
                        "subprocess (RLIMIT_AS; 0 = none): one that needs more fails with an out-of-memory row. "
                        "Default 16 on CPU, none with a GPU (CUDA reserves address space far beyond what it uses)")
    parser.add_argument("--quick", action="store_true", help=f"preset {PRESETS['quick']}")
    parser.add_argument("--attention", type=str, default="auto", help="comma-separated, 'auto' or ModelConfig's "
                        "ATTENTION_IMPLS: our attention kernel(s); auto = by length (blockwise from 1024 tokens, "
                        "dense below), xla = dense. Each one is measured (TRL has one: torch's sdpa)")
    parser.add_argument("--remat", nargs="?", const="on", default="off", choices=tuple(REMATS),
                        help="recompute each layer in the backward pass (ours: ModelConfig.remat; TRL: "
                        "gradient_checkpointing) to cut the update's activation memory; 'both' measures off and on")
    parser.add_argument("--no-peers", action="store_true", help="skip the GRPO / VC-PPO / TRL comparison, run "
                        "only the length sweep")
    parser.add_argument("--child", type=str, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(json.loads(args.child))
        return
    from vcppo_jax.models.config import ATTENTION_IMPLS  # noqa: PLC0415 (children import jax after their settings)

    attention_choices = ("auto",) + tuple(i for i in ATTENTION_IMPLS if i)  # auto = by length (attention_impl '')
    opts = dict(PRESETS["quick" if args.quick else "default"])
    opts.update({k: v for k, v in vars(args).items() if k in opts and v is not None})
    peer_lengths = _ints(opts.pop("peer_lengths"), "--peer-lengths", parser)
    peer_lengths = [] if args.no_peers else peer_lengths
    lengths = _ints(opts.pop("lengths"), "--lengths", parser)
    attentions = [a.strip() for a in args.attention.split(",") if a.strip()]
    if not attentions or set(attentions) - set(attention_choices):
        parser.error(f"--attention must be a comma-separated list of {attention_choices}, got {args.attention!r}")
    if min(v for k, v in opts.items() if k != "iters") < 1 or opts["iters"] < 0 or args.threads < 0 \
            or min(peer_lengths + lengths, default=1) < 1 or (args.memory_cap_gib or 0) < 0:
        parser.error(f"sizes, lengths and threads must be positive, got {opts}, threads={args.threads}")
    if opts["group"] < 2 or (opts["prompts"] * opts["group"]) % NUM_MINIBATCHES:
        parser.error(f"--group must be >= 2 and prompts*group divisible by {NUM_MINIBATCHES}, got {opts}")
    if opts["hidden"] % 64:
        parser.error(f"--hidden must be a multiple of 64, got {opts['hidden']}")
    if not peer_lengths and not lengths:
        parser.error("nothing to measure: --no-peers (or empty --peer-lengths) and an empty --lengths")
    max_len = opts["prompt_len"] + max(peer_lengths + lengths)

    import torch  # noqa: PLC0415
    import transformers as tr  # noqa: PLC0415

    b = opts["prompts"] * opts["group"]
    remats = REMATS[args.remat]
    if args.memory_cap_gib is None:
        args.memory_cap_gib = 0.0 if torch.cuda.is_available() else 16.0
    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder, opts["hidden"], opts["layers"], opts["vocab"], max_len)
        base = dict(opts, folder=folder, threads=args.threads, memory_cap_gib=args.memory_cap_gib)

        def measure(algo: str, n: int, attention: str, remat: bool) -> dict:
            att = "" if attention == "auto" else attention
            return spawn(dict(base, algo=algo, response_len=n, attention=att, remat=remat), args.timeout)

        peers = [(n, remat, algo, att, measure(algo, n, att, remat)) for n in peer_lengths for remat in remats
                 for algo, att in [(a, att) for a in ("grpo", "vcppo") for att in attentions] + [("trl", "sdpa")]]
        sweep = [(n, att, remat, measure("vcppo", n, att, remat)) for n in lengths for att in attentions
                 for remat in remats]

    trl_version = next((r["version"] for *_, r in peers if "version" in r), "not run" if not peers else "not available")
    print(f"torch {torch.__version__} | transformers {tr.__version__} | trl {trl_version} | threads={args.threads} | "
          f"Qwen2 d={opts['hidden']} L={opts['layers']} vocab={opts['vocab']} | {opts['prompts']} prompts x "
          f"{opts['group']} samples = {b} rollouts of prompt {opts['prompt_len']} + exactly R response tokens, "
          f"{NUM_MINIBATCHES} optimizer steps/iteration, " + (f"median of {opts['iters']} iterations after a warmup"
             if opts["iters"] else "the warmup iteration only (compile included)"))
    notes = ["first iter includes our jit compile; peak MiB = the measuring process's peak RSS, timed peak MiB = "
             "its peak RSS during the timed iterations (after the warmup: no compile), growth MiB = peak minus the "
             "RSS after loading the model"]
    if peers:
        print("\nGRPO and VC-PPO (actor + critic) vs TRL GRPOTrainer (actor only) at each response length R:")
        print(_table([("R", 5), ("remat", 5), ("implementation", 22), ("attention", 9), ("first iter s", 12),
                      ("gen s", 7), ("update s", 8), ("iter s", 8), ("tokens/s", 8), ("vs TRL", 7), ("peak MiB", 8),
                      ("vs TRL peak", 11), ("timed peak MiB", 14), ("growth MiB", 10)]))
        trl = {(n, remat): r for n, remat, algo, _, r in peers if algo == "trl"}
        for n, remat, algo, att, res in peers:
            head = f"| {n:>5} | {'on' if remat else 'off':>5} | {NAMES[algo]:>22} | {att:>9} |"
            if "error" in res:
                print(f"{head} {res['error']}")
                continue
            ref = trl.get((n, remat), {})
            speed = f"{ref['total'] / res['total']:>6.2f}x" if "total" in ref else f"{'-':>7}"
            mem = f"{res['peak'] / ref['peak']:>10.2f}x" if "peak" in ref else f"{'-':>11}"
            split = " | ".join(f"{res[k]:>{w}.3f}" if k in res else f"{'-':>{w}}" for k, w in (("gen", 7),
                                                                                                ("update", 8)))
            print(f"{head} {res['first']:>12.2f} | {split} | {res['total']:>8.3f} | {b * n / res['total']:>8.0f} "
                  f"| {speed} | {res['peak']:>8.0f} | {mem} | {_mib(res.get('timed_peak'), 14)} | "
                  f"{res['peak'] - res['base_rss']:>10.0f} |")
        notes.append("'vs TRL' = TRL's iteration time / ours (> 1: ours faster); 'vs TRL peak' = our peak RSS / "
                     "TRL's (< 1: ours smaller); tokens/s = generated tokens / iteration time")
    if sweep:
        print(f"\nCost vs response length (vcppo_jax VC-PPO, {b} rollouts, prompt {opts['prompt_len']}):")
        print(_table([("R", 5), ("attention", 9), ("remat", 5), ("first iter s", 12), ("gen s", 8), ("update s", 8),
                      ("iter s", 8), ("peak MiB", 8), ("timed peak MiB", 14), ("growth MiB", 10),
                      ("device peak MiB", 15)]))
        for n, att, remat, res in sweep:
            head = f"| {n:>5} | {att:>9} | {'on' if remat else 'off':>5} |"
            if "error" in res:
                print(f"{head} {res['error']}")
                continue
            print(f"{head} {res['first']:>12.2f} | {res['gen']:>8.3f} | {res['update']:>8.3f} | {res['total']:>8.3f} "
                  f"| {res['peak']:>8.0f} | {_mib(res.get('timed_peak'), 14)} "
                  f"| {res['peak'] - res['base_rss']:>10.0f} | {res.get('device_peak') or float('nan'):>15.0f} |")
        notes.append("device peak MiB: the accelerator allocator's peak (nan on CPU)")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
