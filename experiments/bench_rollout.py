"""Rollout throughput on long, variable-length responses: the 'slots' engine vs the 'dense' one vs transformers.

The workload is the long-response task's (README, "Long responses"; reproduce.py's `mechanism_long` profile): 64 rows,
prompts of 32 tokens, max_response_len 336, and response lengths drawn from that task's own records (5-9 two-digit
terms): a chain of thought (129-322 tokens with its EOS) or, with probability `--direct` (0.23), the 12-token direct
answer. 0.23 puts the mean length (~184) at what that study's first RL steps sampled (`sampled_length_first`,
177-190 per seed). A trained policy is not needed to reproduce lengths, only their cost: the model is a Qwen2 of the
task's size (d=128, 4 layers, 4/2 heads; vocabulary 512) whose weights make it count down: the LM head maps each
token's embedding to the next lower token, so a prompt ending in token n + 1 yields n, n - 1, ..., 1 and token 1 is
EOS (a response of exactly n tokens). Attention and MLP weights are random (HF's init); every matmul runs as in any
model of this shape, so the time per token is that of a real policy. Sampling at the RL temperature (0.7) follows
the countdown (its logit margin is ~40 / 0.7), so every implementation generates the same tokens, which is checked.

A second workload, 'uniform', gives every row the long workload's mean length: no row ends early, the case where
refilling slots cannot help and must not hurt.

Measured per workload, each call timed `--repeats` times round-robin (the machine is shared; the median is kept):
  dense   vcppo_jax.sampling, engine='dense' (every step computes all 64 rows until the longest ends)
  slots   engine='slots' with `--slots` decode slots (0 = the engine's auto choice), narrowed at the tail; also a
          sweep over `--sweep`
  hf_generate             transformers' `generate` on the padded batch (stops rows at EOS, computes them all)
  hf_continuous_batching  transformers' `generate_batch` (paged continuous batching) where it runs
Tokens/s = generated tokens (each row's length, EOS included) / median seconds; live_fraction = the share of decode
row-steps that computed a live row, as the engine counted them (sum(lengths - 1) / SampleOutput.decode_rows);
speedup_vs_dense = tokens/s over the dense engine's in the same run.

Run (from the repo root; 5-10 minutes on 2 idle cores, much of it transformers' generate_batch):
  .venv/bin/python experiments/bench_rollout.py --out experiments/results/rollout/bench.json
  .venv/bin/python experiments/bench_rollout.py --quick      # 16 rows, d=64, max 96 tokens: a smoke run
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile
import time
from collections.abc import Callable

import jax
import numpy as np
import torch
import transformers as tr

from vcppo_jax.data.synthetic import format_cot, format_direct, sample_problem, synthetic_config
from vcppo_jax.models import CausalLM, load_hf_checkpoint
from vcppo_jax.sampling import make_sampler, slot_count
from bench_rl_step import set_threads
import provenance

PAD_ID, EOS_ID = 0, 1
TEMPERATURE = 0.7  # config.sampling.temperature
LOGIT_MARGIN = 40.0  # the countdown token's logit lead (before the temperature)
PRESETS = {
    "default": dict(batch=64, prompt_len=32, max_new_tokens=336, hidden=128, layers=4, vocab=512, repeats=3),
    "quick": dict(batch=16, prompt_len=16, max_new_tokens=96, hidden=64, layers=2, vocab=128, repeats=2),
}


def build_countdown_checkpoint(folder: str, hidden: int, layers: int, vocab: int, seed: int = 0) -> None:
    """Qwen2ForCausalLM written to `folder` that greedily (and at temperature 0.7) answers token n with n - 1.

    Embeddings: random unit directions scaled to norm sqrt(hidden) (RMS 1, so the final norm keeps them); LM head row
    u = embedding of u + 1, scaled so that the matching logit is LOGIT_MARGIN and the others are ~N(0, margin^2 /
    hidden). The blocks keep HF's init (std 0.02): their small updates leave the countdown's margin in place."""
    cfg = tr.Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=EOS_ID, bos_token_id=None, pad_token_id=PAD_ID)
    torch.manual_seed(seed)
    model = tr.Qwen2ForCausalLM(cfg).eval()
    emb = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(seed))
    emb = emb / emb.norm(dim=1, keepdim=True) * hidden ** 0.5
    head = torch.zeros(vocab, hidden)
    head[:-1] = emb[1:] * (LOGIT_MARGIN / hidden)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(emb)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder)


def task_lengths(num: int, direct: float, max_new_tokens: int, seed: int = 0) -> np.ndarray:
    """[num] response lengths (tokens incl. EOS) of the long-response task's records: the chain of thought, or with
    probability `direct` the direct answer line; capped at max_new_tokens."""
    knobs = synthetic_config(min_terms=5, max_terms=9, min_digits=2, max_digits=2)  # the mechanism_long task
    rng = np.random.default_rng(seed)
    lengths = []
    for _ in range(num):
        cot, answer = format_cot(*sample_problem(rng, knobs))
        lengths.append(len(format_direct(answer) if rng.random() < direct else cot) + 1)  # char tokens + EOS
    return np.minimum(lengths, max_new_tokens)


def countdown_prompts(lengths: np.ndarray, prompt_len: int, vocab: int, seed: int = 0) -> tuple[np.ndarray, ...]:
    """Left-padded prompts [B, P] (real lengths in [P / 2, P], random tokens) ending in token length + 1."""
    if lengths.max() + 1 >= vocab:
        raise ValueError(f"a response of {lengths.max()} tokens needs a vocabulary > {lengths.max() + 1}")
    rng = np.random.default_rng(seed)
    real = rng.integers(max(1, prompt_len // 2), prompt_len + 1, size=len(lengths))
    mask = np.arange(prompt_len)[None, :] >= (prompt_len - real)[:, None]
    tokens = np.where(mask, rng.integers(2, vocab, size=mask.shape), PAD_ID).astype(np.int32)
    tokens[:, -1] = lengths + 1
    return tokens, mask


def round_robin(fns: dict[str, Callable[[], np.ndarray]], repeats: int) -> dict[str, float]:
    """Median seconds of each call over `repeats` rounds, the calls interleaved (a noisy neighbour slows all)."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help=f"preset {PRESETS['quick']}")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default: the preset's)")
    parser.add_argument("--direct", type=float, default=0.23, help="fraction of direct answers")
    parser.add_argument("--slots", type=int, default=0, help="the 'slots' engine's decode slots (0 = auto)")
    parser.add_argument("--sweep", default="4,8,16,32", help="slot counts also timed on the long workload ('' = none)")
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads for torch and XLA (0 = defaults)")
    parser.add_argument("--no-hf", action="store_true", help="skip transformers")
    parser.add_argument("--out", default="", help="write the figures as JSON here")
    args = parser.parse_args()
    opts = dict(PRESETS["quick" if args.quick else "default"])
    if args.repeats is not None:
        opts["repeats"] = args.repeats
    if opts["repeats"] < 1 or not 0 <= args.direct <= 1 or args.slots < 0:
        parser.error("--repeats must be >= 1, --direct in [0, 1], --slots >= 0")
    set_threads(args.threads, torch_too=True)  # before the first jax computation, which reads XLA_FLAGS
    b, p, r = opts["batch"], opts["prompt_len"], opts["max_new_tokens"]
    slots = slot_count(args.slots, b)
    sweep = sorted({int(s) for s in args.sweep.split(",") if s} - {slots}) if args.sweep else []

    with tempfile.TemporaryDirectory() as folder:
        build_countdown_checkpoint(folder, opts["hidden"], opts["layers"], opts["vocab"])
        hf_model = tr.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        cfg, variables = load_hf_checkpoint(folder)
    model, params = CausalLM(cfg), jax.device_put(variables["params"])
    long_lengths = task_lengths(b, args.direct, r)
    workloads = {"long": long_lengths, "uniform": np.full(b, int(round(long_lengths.mean())))}
    report = {"setup": {
        "jax": jax.__version__, "torch": torch.__version__, "transformers": tr.__version__,
        "threads": args.threads, "model": f"Qwen2 d={cfg.hidden_size} L={cfg.num_layers} heads "
        f"{cfg.num_heads}/{cfg.num_kv_heads} vocab {cfg.vocab_size} ({cfg.num_params / 1e6:.2f}M params)",
        "batch": b, "prompt_len": p, "max_new_tokens": r, "temperature": TEMPERATURE, "repeats": opts["repeats"],
        "slots": slots, "direct_fraction": args.direct}, "workloads": {}}
    print(f"jax {jax.__version__} | torch {torch.__version__} threads={torch.get_num_threads()} | transformers "
          f"{tr.__version__} | {report['setup']['model']} | {b} rows x prompt {p}, max {r} new tokens, "
          f"temperature {TEMPERATURE}, {slots} slots, median of {opts['repeats']} round-robin calls")

    for workload, lengths in workloads.items():
        tokens, mask = countdown_prompts(lengths, p, cfg.vocab_size)
        want = np.where(np.arange(r)[None, :] < lengths[:, None], lengths[:, None] - np.arange(r)[None, :], PAD_ID)
        widths = {"dense": b, "slots": slots} | ({f"slots_{s}": slot_count(s, b) for s in sweep}
                                                 if workload == "long" else {})
        steps: dict[str, tuple[int, int]] = {}  # name -> (decode steps, decode rows computed)

        def ours(name: str, width: int) -> Callable[[], np.ndarray]:
            engine = dict(engine="dense") if name == "dense" else dict(engine="slots", num_slots=width)
            sampler = make_sampler(model, max_new_tokens=r, eos_id=EOS_ID, pad_id=PAD_ID, temperature=TEMPERATURE,
                                   **engine)
            calls = iter(range(1 << 30))  # a fresh key per call, as in a rollout loop

            def call() -> np.ndarray:
                out = jax.device_get(sampler(params, tokens, mask, jax.random.key(next(calls))))
                steps[name] = int(out.num_steps), int(out.decode_rows)
                return out.tokens[:, p:]
            return call

        fns = {name: ours(name, width) for name, width in widths.items()}
        if not args.no_hf:
            t_tokens, t_mask = torch.tensor(tokens, dtype=torch.long), torch.tensor(mask, dtype=torch.long)
            sampling = dict(do_sample=True, temperature=TEMPERATURE, top_k=0, top_p=1.0)

            @torch.inference_mode()
            def hf_generate() -> np.ndarray:
                out = hf_model.generate(input_ids=t_tokens, attention_mask=t_mask, max_new_tokens=r,
                                        eos_token_id=EOS_ID, pad_token_id=PAD_ID, **sampling)[:, p:].numpy()
                return np.pad(out, ((0, 0), (0, r - out.shape[1])), constant_values=PAD_ID)

            prompts = [row[m].tolist() for row, m in zip(tokens, mask)]

            @torch.inference_mode()
            def hf_continuous_batching() -> np.ndarray:
                config = tr.GenerationConfig(max_new_tokens=r, eos_token_id=EOS_ID, pad_token_id=PAD_ID, **sampling)
                results = hf_model.generate_batch(prompts, generation_config=config, progress_bar=False)
                out = np.full((b, r), PAD_ID, np.int64)
                for i, res in enumerate(results.values()):
                    out[i, :len(res.generated_tokens)] = res.generated_tokens
                return out

            fns.update(hf_generate=hf_generate, hf_continuous_batching=hf_continuous_batching)
        results: dict[str, dict] = {}
        for name, fn in list(fns.items()):  # first call: compile / warm-up, and the tokens checked
            t0 = time.perf_counter()
            try:
                got = fn()
            except Exception as e:  # noqa: BLE001 (an HF path this version cannot run here is reported, not fatal)
                if not name.startswith("hf_"):
                    raise
                results[name] = {"error": f"{type(e).__name__}: {e}"[:300]}
                del fns[name]
                continue
            same = float(np.mean(got == want))
            if name in widths and same < 1:
                raise AssertionError(f"{workload}/{name}: the countdown was not followed ({same:.1%} tokens)")
            results[name] = {"first_call_s": round(time.perf_counter() - t0, 2), "tokens_match": same}
        for name, seconds in round_robin(fns, opts["repeats"]).items():
            results[name].update(seconds=round(seconds, 3), tokens_per_s=round(float(lengths.sum()) / seconds, 1))
            if name in widths:
                results[name]["rows_per_step"] = widths[name]  # at most: 'slots' narrows at the tail
                results[name]["decode_steps"], results[name]["decode_rows"] = steps[name]
                results[name]["live_fraction"] = round(float((lengths - 1).sum()) / steps[name][1], 3)
        dense = results["dense"]["tokens_per_s"]
        for res in results.values():
            if "tokens_per_s" in res:
                res["speedup_vs_dense"] = round(res["tokens_per_s"] / dense, 3)
        report["workloads"][workload] = {
            "lengths": {"mean": round(float(lengths.mean()), 1), "min": int(lengths.min()),
                        "max": int(lengths.max()), "generated_tokens": int(lengths.sum())}, "modes": results}
        print(f"\n{workload}: lengths mean {lengths.mean():.1f}, min {lengths.min()}, max {lengths.max()}")
        print(f"| {'mode':<22} | {'median s':>8} | {'tokens/s':>8} | {'vs dense':>8} | {'live rows':>9} |")
        print(f"|{'-' * 24}|{'-' * 10}|{'-' * 10}|{'-' * 10}|{'-' * 11}|")
        for name, res in results.items():
            if "error" in res:
                print(f"| {name:<22} | failed: {res['error']}")
                continue
            live = f"{res['live_fraction']:.1%}" if "live_fraction" in res else "-"
            print(f"| {name:<22} | {res['seconds']:>8.2f} | {res['tokens_per_s']:>8.0f} | "
                  f"{res['speedup_vs_dense']:>7.2f}x | {live:>9} |")
    if args.out:
        path = pathlib.Path(args.out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**report, "provenance": provenance.record()}, indent=1) + "\n")
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
