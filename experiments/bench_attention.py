"""Memory and time of the actor's training pass (forward + backward of the response log-probs) vs response length:
attention kernels side by side (--kernels, default dense 'xla' beside 'blockwise', `vcppo_jax/models/attention.py`;
also 'cudnn' on a GPU, 'splash' on a TPU), remat off and on. The last kernel is the reference of the ratios.

Memory is XLA's own plan for the compiled step (`compiled.memory_analysis()`: temporary buffers, i.e. activations
and attention intermediates, plus arguments and outputs), so a length whose dense step would not fit in RAM is still
measured: nothing is allocated. Time (--time-up-to) runs the step on random tokens, best of --iters after a warm-up.

Run (from the repo root):
  .venv/bin/python experiments/bench_attention.py                        # 1k, 4k, 8k, 16k; time up to 1k
  .venv/bin/python experiments/bench_attention.py --lengths=512,2048 --time-up-to=2048
  python experiments/bench_attention.py --kernels=xla,cudnn,blockwise --dtype=bfloat16   # GPU: the default's choice
"""

from __future__ import annotations

import argparse
import os
import pathlib
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

MODEL = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, num_kv_heads=2,
             tie_embeddings=True)  # the RL-step benchmark's model (experiments/bench_rl_step.py)
PROMPT_LEN = 32


def step_fn(cfg, prompt_len: int):
    """jitted params, tokens [B, P+R], mask -> (loss, grads): the actor loss's forward and backward."""
    import jax  # noqa: PLC0415

    from vcppo_jax import rl  # noqa: PLC0415
    from vcppo_jax.models import CausalLM  # noqa: PLC0415

    actor = CausalLM(cfg)

    def loss(params, tokens, mask):
        logp, _ = rl.policy_logprobs(actor, params, tokens, mask, prompt_len=prompt_len, chunk=128)
        return -logp.mean()

    return jax.jit(jax.value_and_grad(loss)), actor


def measure(impl: str, remat: bool, length: int, batch: int, block: int, timed: bool, iters: int,
            dtype: str = "float32") -> dict:
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415
    import numpy as np  # noqa: PLC0415

    import flax.linen as nn  # noqa: PLC0415

    from vcppo_jax import runtime  # noqa: PLC0415
    from vcppo_jax.models import ModelConfig, init_params  # noqa: PLC0415

    cfg = ModelConfig(**MODEL, attention_impl=impl, attention_block_size=block, remat=remat, dtype=dtype,
                      max_position_embeddings=PROMPT_LEN + length)
    fn, actor = step_fn(cfg, PROMPT_LEN)
    t = PROMPT_LEN + length
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (batch, t)), jnp.int32)
    mask = jnp.ones((batch, t), bool)
    compiled = fn.lower(nn.unbox(runtime.abstract_params(actor)), tokens, mask).compile()  # no weights needed
    mem = compiled.memory_analysis()
    out = {"temp_mib": mem.temp_size_in_bytes / 2**20,
           "total_mib": (mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes) / 2**20}
    if timed:
        params = init_params(actor, jax.random.PRNGKey(0))["params"]
        jax.block_until_ready(compiled(params, tokens, mask))
        times = []
        for _ in range(iters):
            start = time.perf_counter()
            jax.block_until_ready(compiled(params, tokens, mask))
            times.append(time.perf_counter() - start)
        out["time_s"] = min(times)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", default="1024,4096,8192,16384", help="response lengths (tokens)")
    p.add_argument("--kernels", default="xla,blockwise", help="attention_impl values, side by side; the last is the "
                   "ratios' reference")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="compute dtype ('cudnn' "
                   "needs bfloat16)")
    p.add_argument("--batch", type=int, default=8, help="responses per step")
    p.add_argument("--block", type=int, default=512, help="blockwise / splash attention block size")
    p.add_argument("--time-up-to", type=int, default=1024, help="also time the step at lengths up to this")
    p.add_argument("--iters", type=int, default=2)
    args = p.parse_args()
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    lengths = [int(x) for x in args.lengths.split(",")]
    kernels = args.kernels.split(",")
    print(f"actor training pass, batch {args.batch} x ({PROMPT_LEN} + R) tokens, {args.dtype}, model {MODEL}; XLA's "
          f"planned memory of the compiled step (MiB: temporaries / with arguments and outputs), time s; ratios: "
          f"each kernel / {kernels[-1]}", flush=True)
    print(f"{'R':>6} {'remat':>5} | " + " | ".join(f"{k + ' MiB':>19} {'s':>7} {'ratio':>12}" for k in kernels),
          flush=True)
    for length in lengths:
        for remat in (False, True):
            timed = length <= args.time_up_to
            rows = []
            for kernel in kernels:
                try:
                    rows.append(measure(kernel, remat, length, args.batch, args.block, timed, args.iters, args.dtype))
                except Exception as e:  # noqa: BLE001 - a kernel refused on this backend or out of memory: say so
                    rows.append({"error": f"{type(e).__name__}: {str(e).splitlines()[0][:60]}"})
            ref = rows[-1]
            cells = []
            for r in rows:
                if "error" in r:
                    cells.append(f"{r['error']:>40}")
                    continue
                mem = r["total_mib"] / ref["total_mib"] if "total_mib" in ref else float("nan")
                time_s = r.get("time_s", float("nan"))
                speed = time_s / ref["time_s"] if timed and "time_s" in ref else float("nan")
                cells.append(f"{r['temp_mib']:>9.0f} / {r['total_mib']:>7.0f} {time_s:>7.2f} "
                             f"{mem:>5.1f}x/{speed:>5.2f}x")
            print(f"{length:>6} {str(remat):>5} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
