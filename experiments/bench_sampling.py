"""Benchmarks vcppo_jax.sampling against transformers' `generate` (PyTorch, on the GPU when there is one) on the same
Qwen2 checkpoint.

A random Qwen2ForCausalLM is built with transformers, written with `save_pretrained` and read back into our model
with `load_hf_checkpoint`. Both generate for the same left-padded prompts with no stop token (eos_id=None /
eos_token_id=None), so every row produces exactly --new-tokens tokens and both do the same work.

Run (from the repo root):
  .venv/bin/python experiments/bench_sampling.py --quick     # batch 4, prompt 16, 32 new tokens, d=64 x 2 layers
  .venv/bin/python experiments/bench_sampling.py             # batch 16, prompt 64, 128 new tokens, d=256 x 4 layers

Prints one table: median wall time of a generate call after a warmup (ours: the warmup is the jit compile, shown
separately), generated tokens/s (batch * new tokens / time) and the speed ratio ours / HF, for our sampler with its
KV cache in the compute dtype (fp32) and in bfloat16 (`kv_cache_dtype`). For greedy it also checks that both produce
the same tokens (logits parity, up to float near-ties). Then the decode floor: the time of only the weight matmuls
of the same number of one-token steps (every kernel of the model times a [batch, in] activation, jitted in one loop;
no attention, norms or sampling), i.e. what reading the weights once per token costs here. HF time / floor bounds
the speed-up a decode loop on XLA's matmuls can have over HF at this size. --threads (default 1) caps
torch's and XLA's intra-op threads: on a shared 2-core machine torch's 2-thread OpenMP pool was 5-10x slower
than 1 thread for these tiny matmuls.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch
import transformers as tr

from vcppo_jax.models import CausalLM, load_hf_checkpoint
from vcppo_jax.sampling import make_sampler
from bench_rl_step import set_threads  # one thread setting for both benchmarks

PAD_ID = 0
PRESETS = {
    "quick": dict(batch=4, prompt_len=16, new_tokens=32, hidden=64, layers=2, vocab=512, repeats=3),
    "default": dict(batch=16, prompt_len=64, new_tokens=128, hidden=256, layers=4, vocab=4096, repeats=3),
}
MODES = {  # name -> (temperature, top_k, top_p), applied identically by both implementations
    "greedy": (0.0, 0, 1.0),
    "sampled": (1.0, 50, 0.9),
}


def build_checkpoint(folder: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> None:
    """Random Qwen2ForCausalLM written with save_pretrained. Weights are scaled up from HF's init (std 0.02) so that
    next-token distributions are peaked and greedy ties are rare."""
    heads = max(2, hidden // 32)
    cfg = tr.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads // 2, max_position_embeddings=4096,
                         tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    model = tr.Qwen2ForCausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.copy_(torch.randn(p.shape, generator=g) * (0.5 if name == "lm_head.weight" else 0.1))
    model.save_pretrained(folder)


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Left-padded prompts [batch, prompt_len] with real lengths in [prompt_len / 2, prompt_len]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(max(1, prompt_len // 2), prompt_len + 1, size=batch)
    mask = np.arange(prompt_len)[None, :] >= (prompt_len - lengths)[:, None]
    tokens = np.where(mask, rng.integers(1, vocab, size=(batch, prompt_len)), PAD_ID).astype(np.int32)
    return tokens, mask


def median_time(fn: Callable[[], object], repeats: int) -> tuple[float, float, object]:
    """(seconds of the first call, median seconds of `repeats` further calls, last result)."""
    t0 = time.perf_counter()
    out = fn()
    first = time.perf_counter() - t0
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return first, statistics.median(times), out


def matmul_floor(params, batch: int, steps: int, repeats: int) -> float:
    """Median seconds of `steps` rounds of [batch, in] @ [in, out] over every kernel of the model (the embedding
    is a gather, so it is left out; a 3-d kernel is split [dim 0, rest], which reads the same weights with the
    same FLOPs as its real split), in one jitted fori_loop: a lower bound on any decode loop's time."""
    kernels = [x.reshape(-1, x.shape[-1]) if x.ndim == 2 else x.reshape(x.shape[0], -1) for path, x in
               jax.tree_util.tree_flatten_with_path(params)[0] if "kernel" in jax.tree_util.keystr(path)]
    xs = [jnp.ones((batch, w.shape[0]), w.dtype) for w in kernels]

    @jax.jit
    def run(kernels, xs):
        def step(i, acc):  # the activations depend on i, so nothing is hoisted out of the loop
            return acc + sum(jnp.sum((x * i) @ w) for x, w in zip(xs, kernels))
        return jax.lax.fori_loop(0, steps, step, jnp.zeros((), jnp.float32))

    return median_time(lambda: jax.block_until_ready(run(kernels, xs)), repeats)[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag in ("batch", "prompt-len", "new-tokens", "hidden", "layers", "vocab", "repeats"):
        parser.add_argument(f"--{flag}", type=int, default=None, help="default: from the preset")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and XLA (0 = library "
                        "defaults)")
    parser.add_argument("--quick", action="store_true", help=f"preset {PRESETS['quick']}")
    parser.add_argument("--torch-device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="where transformers generates (default: cuda when available; jax uses its default)")
    args = parser.parse_args()
    if args.threads < 0:
        parser.error(f"--threads must be >= 0, got {args.threads}")
    set_threads(args.threads, torch_too=True)  # before the first jax computation below, which reads XLA_FLAGS
    opts = dict(PRESETS["quick" if args.quick else "default"])
    opts.update({k: v for k, v in vars(args).items() if k in opts and v is not None})
    if min(opts.values()) < 1 or opts["hidden"] % 64:
        parser.error(f"sizes must be >= 1 and --hidden a multiple of 64, got {opts}")
    b, p, r = opts["batch"], opts["prompt_len"], opts["new_tokens"]

    with tempfile.TemporaryDirectory() as folder:
        build_checkpoint(folder, opts["hidden"], opts["layers"], opts["vocab"])
        hf_model = tr.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval().to(args.torch_device)
        cfg, variables = load_hf_checkpoint(folder)
    model = CausalLM(cfg)
    params = jax.device_put(variables["params"])
    tokens, mask = make_prompts(b, p, cfg.vocab_size)
    t_tokens, t_mask = (torch.tensor(x, dtype=torch.long, device=args.torch_device) for x in (tokens, mask))

    xla_flags = os.environ.get("XLA_FLAGS", "").strip()
    print(f"jax {jax.__version__} ({jax.default_backend()}, XLA_FLAGS={xla_flags!r}) | torch {torch.__version__} on {args.torch_device} "
          f"threads={torch.get_num_threads()} | transformers {tr.__version__} | Qwen2 d={cfg.hidden_size} "
          f"L={cfg.num_layers} heads={cfg.num_heads}/{cfg.num_kv_heads} vocab={cfg.vocab_size} "
          f"({cfg.num_params / 1e6:.2f}M params) | "
          f"batch {b} x prompt {p} + {r} new tokens, {opts['repeats']} timed calls after a warmup")
    header = (f"| {'mode':<7} | {'implementation':<24} | {'first call s':>12} | {'median s':>9} | {'tokens/s':>9} "
              f"| {'ours / HF':>9} |")
    print(header)
    print("|" + "|".join("-" * len(c) for c in header.split("|")[1:-1]) + "|")
    notes, times = [], {}
    for mode, (temperature, top_k, top_p) in MODES.items():
        calls = iter(range(1 << 30))  # a fresh key per call, as in a rollout loop

        def ours(kv_cache_dtype: str) -> Callable[[], np.ndarray]:
            sampler = make_sampler(model, max_new_tokens=r, eos_id=None, pad_id=PAD_ID, temperature=temperature,
                                   top_k=top_k, top_p=top_p, kv_cache_dtype=kv_cache_dtype)
            return lambda: np.asarray(jax.block_until_ready(sampler(params, tokens, mask,
                                                                    jax.random.key(next(calls))).tokens))

        sampling = dict(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p) if temperature else dict(
            do_sample=False)

        @torch.inference_mode()
        def hf() -> np.ndarray:
            out = hf_model.generate(input_ids=t_tokens, attention_mask=t_mask, max_new_tokens=r, min_new_tokens=r,
                                    eos_token_id=None, pad_token_id=PAD_ID, **sampling)
            return out.cpu().numpy()

        o_first, o_med, o_tokens = median_time(ours("compute"), opts["repeats"])
        bf_first, bf_med, bf_tokens = median_time(ours("bfloat16"), opts["repeats"])
        h_first, h_med, h_tokens = median_time(hf, opts["repeats"])
        assert o_tokens.shape == bf_tokens.shape == h_tokens.shape == (b, p + r), (o_tokens.shape, h_tokens.shape)
        rate = lambda s: b * r / s  # noqa: E731
        print(f"| {mode:<7} | {'vcppo_jax (jit, XLA)':<24} | {o_first:>12.2f} | {o_med:>9.3f} | {rate(o_med):>9.0f} "
              f"| {h_med / o_med:>8.2f}x |")
        print(f"| {mode:<7} | {'vcppo_jax, bf16 KV cache':<24} | {bf_first:>12.2f} | {bf_med:>9.3f} "
              f"| {rate(bf_med):>9.0f} | {h_med / bf_med:>8.2f}x |")
        print(f"| {mode:<7} | {'transformers generate':<24} | {h_first:>12.2f} | {h_med:>9.3f} | {rate(h_med):>9.0f} "
              f"| {'1.00x':>9} |")
        times[mode] = o_med, h_med
        if temperature == 0:
            same = float(np.mean(o_tokens[:, p:] == h_tokens[:, p:]))
            rows = int(np.sum(np.all(o_tokens[:, p:] == h_tokens[:, p:], axis=1)))
            notes.append(f"greedy: ours == HF on {same:.1%} of generated tokens ({rows}/{b} rows identical)")
    floor = matmul_floor(params, b, r, opts["repeats"])
    ratios = lambda i: ", ".join(f"{m} {t[i] / floor:.2f}x" for m, t in times.items())  # noqa: E731
    notes.append(f"decode floor (XLA, the weight matmuls of {r} one-token steps at batch {b}, nothing else): "
                 f"{floor:.3f} s = {rate(floor):.0f} tokens/s; ours / floor: {ratios(0)}; HF / floor: {ratios(1)} "
                 "(a decode loop on XLA's matmuls cannot beat HF by more than HF / floor)")
    notes.append("first call: ours includes the jit compile; 'ours / HF' = HF median time / our median time")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
