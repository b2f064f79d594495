"""Benchmarks vcppo_jax.gae against the reversed Python loops that verl / TRL / OpenRLHF run (numpy and torch).

Run (from the repo root):
  .venv/bin/python experiments/bench_gae.py --quick          # ~25 s on 2 shared CPU cores
  .venv/bin/python experiments/bench_gae.py                  # batch 256 x time 1k, 4k, 16k; ~70 s on 2 cores

Prints one table: median wall time after a warmup call (JAX: compile + block_until_ready), the ratio to our default
implementation for this backend, and effective GB/s = (bytes of inputs read + outputs written) / time. The last lines
say which `impl` is fastest here, i.e. what `vcppo_jax.gae.DEFAULT_IMPL[backend]` should be.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import torch

from vcppo_jax import gae as gae_lib

GAMMA, LAM_ACTOR, LAM_CRITIC = 1.0, 0.95, 1.0


def make_batch(batch: int, length: int, seed: int = 0):
    """Right-padded responses with lengths in [length/2, length], +-1 reward on the last valid token."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(length // 2, length + 1, size=batch)
    mask = np.arange(length)[None] < lengths[:, None]
    rewards = np.zeros((batch, length), np.float32)
    rewards[np.arange(batch), lengths - 1] = rng.choice([-1.0, 1.0], size=batch)
    values = (rng.normal(size=(batch, length)) * 0.5).astype(np.float32)
    return rewards, values, mask


def numpy_loop_gae(rewards, values, mask, gamma, lam):
    """The usual reversed loop over time columns, vectorised over batch, masked steps pass the carry through."""
    m = mask.astype(rewards.dtype)
    advantages = np.zeros_like(rewards)
    next_value = np.zeros(rewards.shape[0], rewards.dtype)
    last_gae = np.zeros(rewards.shape[0], rewards.dtype)
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        new_gae = delta + gamma * lam * last_gae
        next_value = m[:, t] * values[:, t] + (1 - m[:, t]) * next_value
        last_gae = m[:, t] * new_gae + (1 - m[:, t]) * last_gae
        advantages[:, t] = last_gae * m[:, t]
    return advantages, (values + advantages) * m


@torch.inference_mode()
def torch_loop_gae(rewards, values, mask, gamma, lam):
    """verl's `compute_gae_advantage_return` loop (masked steps pass through), torch CPU tensors."""
    next_values = torch.zeros(rewards.shape[0])
    last_gae_lam = torch.zeros(rewards.shape[0])
    advantages_reversed = []
    for t in reversed(range(rewards.shape[1])):
        delta = rewards[:, t] + gamma * next_values - values[:, t]
        last_gae_lam_ = delta + gamma * lam * last_gae_lam
        next_values = values[:, t] * mask[:, t] + (1 - mask[:, t]) * next_values
        last_gae_lam = last_gae_lam_ * mask[:, t] + (1 - mask[:, t]) * last_gae_lam
        advantages_reversed.append(last_gae_lam)
    advantages = torch.stack(advantages_reversed[::-1], dim=1) * mask
    return advantages, (values + advantages) * mask


def median_time(fn: Callable[[], object], sync: Callable[[object], object], repeats: int, cap_s: float
                ) -> tuple[float, int]:
    """Median seconds over up to `repeats` calls after one warmup; stops early once `cap_s` is spent."""
    start = time.perf_counter()
    sync(fn())
    times = []
    while len(times) < repeats and (not times or time.perf_counter() - start < cap_s):
        t0 = time.perf_counter()
        sync(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), len(times)


def nbytes(*arrays) -> int:
    return sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree.leaves(arrays))


def bench_config(batch: int, length: int, repeats: int, cap_s: float, ours_impl: str):
    rewards, values, mask = make_batch(batch, length)
    j_r, j_v, j_m = jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask)
    t_r, t_v, t_m = torch.from_numpy(rewards), torch.from_numpy(values), torch.from_numpy(mask.astype(np.float32))
    block = jax.block_until_ready
    cases = {}
    for impl in gae_lib.IMPLS:
        cases[f"jax gae {impl}"] = (
            lambda impl=impl: gae_lib.gae(j_r, j_v, j_m, gamma=GAMMA, lam=LAM_ACTOR, impl=impl), block,
            (j_r, j_v, j_m))
        cases[f"jax decoupled {impl}"] = (
            lambda impl=impl: gae_lib.decoupled_gae(j_r, j_v, j_m, gamma=GAMMA, lambda_actor=LAM_ACTOR,
                                                    lambda_critic=LAM_CRITIC, impl=impl), block, (j_r, j_v, j_m))
    f32_mask = mask.astype(np.float32)
    cases["numpy loop"] = (lambda: numpy_loop_gae(rewards, values, f32_mask, GAMMA, LAM_ACTOR), lambda x: x,
                           (rewards, values, f32_mask))
    cases["torch loop"] = (lambda: torch_loop_gae(t_r, t_v, t_m, GAMMA, LAM_ACTOR), lambda x: x, (t_r, t_v, t_m))

    # Same numbers everywhere (valid tokens), before timing anything.
    ours = np.asarray(gae_lib.gae(j_r, j_v, j_m, gamma=GAMMA, lam=LAM_ACTOR, impl=ours_impl)[0])
    for name in ("jax gae scan", "jax gae associative", "numpy loop", "torch loop"):
        got = np.asarray(cases[name][0]()[0])
        np.testing.assert_allclose(got[mask], ours[mask], rtol=1e-4, atol=1e-3, err_msg=name)

    rows = []
    for name, (fn, sync, inputs) in cases.items():
        seconds, n = median_time(fn, sync, repeats, cap_s)
        outputs = fn()
        rows.append((name, seconds, n, nbytes(inputs) + nbytes(tuple(np.asarray(o) for o in outputs))))
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--times", default="1024,4096,16384", help="comma-separated response lengths")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case (after one warmup)")
    parser.add_argument("--cap", type=float, default=15.0, help="seconds per case before it stops repeating")
    parser.add_argument("--quick", action="store_true", help="batch 64 x time 256, 1024; 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.times, args.batch, args.repeats = "256,1024", 64, 3
    times = [int(t) for t in args.times.split(",")]
    if args.batch < 1 or args.repeats < 1 or any(t < 2 for t in times):
        parser.error("--batch and --repeats must be >= 1 and every --times entry >= 2")

    backend = jax.default_backend()
    ours_impl = gae_lib.default_impl()
    print(f"jax {jax.__version__} backend={backend} device={jax.devices()[0].device_kind} | torch {torch.__version__} "
          f"threads={torch.get_num_threads()} | numpy {np.__version__} | gamma={GAMMA} lam={LAM_ACTOR} "
          f"(decoupled: lambda_critic={LAM_CRITIC}) | ours = jax gae {ours_impl} (DEFAULT_IMPL[{backend!r}])")
    header = (f"| {'batch x time':>13} | {'implementation':<26} | {'median ms':>10} | {'n':>2} | {'vs ours':>8} "
              f"| {'GB/s':>6} |")
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    fastest = {}
    for length in times:
        rows = bench_config(args.batch, length, args.repeats, args.cap, ours_impl)
        ours = dict((r[0], r[1]) for r in rows)[f"jax gae {ours_impl}"]
        for name, seconds, n, moved in rows:
            print(f"| {f'{args.batch} x {length}':>13} | {name:<26} | {seconds * 1e3:>10.2f} | {n:>2} | "
                  f"{seconds / ours:>7.2f}x | {moved / seconds / 1e9:>6.2f} |")
        scan_s, assoc_s = (dict((r[0], r[1]) for r in rows)[f"jax gae {i}"] for i in ("scan", "associative"))
        fastest[length] = ("scan", scan_s / assoc_s) if scan_s <= assoc_s else ("associative", scan_s / assoc_s)
    for length, (impl, speedup) in fastest.items():
        print(f"time {length}: fastest impl on {backend} = {impl} (scan / associative time = {speedup:.2f})")
    choice = fastest[max(fastest)][0]
    verdict = "matches" if choice == ours_impl else "DIFFERS FROM"
    print(f"choice for DEFAULT_IMPL[{backend!r}] (longest time): {choice!r} -- {verdict} the current default "
          f"{ours_impl!r}")


if __name__ == "__main__":
    main()
