"""`--config.dry_run=True`: will this stage fit? Compiles its programs against abstract inputs and reads XLA's plan.

Builds the mesh, the model config (`config.model`, or the `config.json` of `model.hf_path`: no weights are read),
the stage's abstract train state with its shardings, then lowers and compiles each jitted program of the stage
ahead of time against `jax.ShapeDtypeStruct`s (no weights, no data, no earlier stage needed): the sampler, and the
SFT step / the value step / the RL experience and update steps. For each it prints XLA's per-device memory
(`compiled.memory_analysis()`: arguments, outputs, temporaries, donated buffers) and the peak a device needs while
it runs with the whole train state resident, and whether the largest peak fits the device's memory
(`memory_stats()['bytes_limit']`; on CPU, which reports none, the host's RAM shared by its local devices;
`dry_run_device_memory_gib` overrides both).

`dry_run_topology` (e.g. 'v5e:2x4', 'v4:2x2x4') compiles the same programs with the TPU compiler for that slice's
devices on this host (`tpu_topology`; no TPU needed), against its chips' HBM. Where the TPU's splash attention
runs, its block and padding for each sequence length are printed first, and its kernel is compiled alone on one
layer's per-device shapes before anything else, so that a shape it cannot take fails first, naming the fallback.
For each training program it also prints the FLOPs one device executes per call and the time they take at the
chip's peak bf16 rate (the time at 100% MFU): these are compiled plans, not runs on TPU hardware.

FLOPs are counted on the traced program (`program_flops`) rather than read from XLA's `cost_analysis()`, which
counts each loop body once (a 10-step `fori_loop` of matmuls reports one matmul's FLOPs on TPU) and a Pallas
kernel as none: a transformer whose layers are one `scan`, updated over a scan of minibatches, would be undercounted
by their product. XLA's figure is printed beside it.

The programs are the loops' own (`sft.programs`, `value_train.programs`, `rl_loop.programs`), with the loops'
shapes and shardings.
"""

from __future__ import annotations

import math
import os
from typing import Any, Callable

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np

from vcppo_jax import builders
from vcppo_jax import config as config_lib
from vcppo_jax import rl
from vcppo_jax import rl_loop
from vcppo_jax import runtime as rt_lib
from vcppo_jax import sft
from vcppo_jax import sharding
from vcppo_jax import tpu_topology
from vcppo_jax import value_train
from vcppo_jax.models import CausalLM, ModelConfig, ValueModel
from vcppo_jax.models.config import long_attention_kernel, uses_memory_linear
from vcppo_jax.models.splash import SPLASH_BLOCK_MULTIPLE, splash_attention, splash_block
from vcppo_jax.optim import make_optimizer

MIB = 2 ** 20


def _batch(rt, **leaves: tuple[tuple[int, ...], Any]) -> dict[str, jax.ShapeDtypeStruct]:
    """Abstract global batch arrays split on their leading dim, as `Runtime.place_batch` lays them out."""
    sh = sharding.batch_sharding(rt.mesh)
    return {k: jax.ShapeDtypeStruct(shape, dtype, sharding=sh) for k, (shape, dtype) in leaves.items()}


def _replicated(rt, x: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=jax.sharding.NamedSharding(rt.mesh,
                                                                                      jax.sharding.PartitionSpec()))


def _shardings(tree: Any) -> Any:
    return jax.tree.map(lambda x: x.sharding, tree)


def programs(config: ml_collections.ConfigDict, rt, cfg: ModelConfig) -> tuple[list, Any]:
    """[(name, jitted fn, abstract args)] of the stage's programs (the ones its loop builds: `sft.programs`,
    `value_train.programs`, `rl_loop.programs`), and its abstract resident state. The training programs take the
    compiler options of the mesh's platform (a TPU slice's on a CPU host)."""
    tok = builders.tokenizer(config)
    P, R = config.task.max_prompt_len, config.task.max_response_len
    actor = CausalLM(cfg)
    backend = rt.mesh.devices.flat[0].platform
    key = _replicated(rt, jax.eval_shape(lambda: jax.random.PRNGKey(0)))

    def prompts(batch: int) -> tuple:
        p = _batch(rt, tokens=((batch, P), jnp.int32), mask=((batch, P), jnp.int32))
        return p["tokens"], p["mask"], key

    def sampler(fn, batch: int) -> tuple:
        return "sampler", fn.__wrapped__, (rt.target(rt_lib.abstract_params(actor)), *prompts(batch))

    if config.stage == "sft":
        tx = make_optimizer(config.optim)
        state = rt_lib.model_state_from_dict(rt.target(rt_lib.model_state_to_dict(
            rt_lib.abstract_model_state(actor, tx))))
        progs = sft.programs(config, actor, tx, _shardings(state), tok, backend=backend)
        b = config.batch_size
        batch = _batch(rt, tokens=((b, P + R), jnp.int32), attn_mask=((b, P + R), bool),
                       response_mask=((b, R), jnp.float32))
        return [sampler(progs.greedy, min(config.eval_prompts, b)), ("sft_step", progs.step, (state, batch))], state
    b = config.prompts_per_step * config.group_size
    rollout = rl.Rollout(**_batch(rt, tokens=((b, P + R), jnp.int32), attn_mask=((b, P + R), bool),
                                  response_mask=((b, R), jnp.float32), rewards=((b, R), jnp.float32),
                                  seq_rewards=((b,), jnp.float32), sample_logp=((b, R), jnp.float32)))
    if config.stage in ("value_pretrain", "reward_model"):
        critic, tx = ValueModel(cfg), make_optimizer(config.optim)
        state = rt.target(rt_lib.abstract_model_state(critic, tx))
        progs = value_train.programs(config, actor, critic, tx, _shardings(state), tok, backend=backend)
        sample = sampler(progs.sampler, b)
        # The sampling policy's params stay resident beside the critic's state.
        return [sample, ("value_step", progs.step, (state, rollout, key))], (state, sample[2][0])
    models = rl_loop.Models.from_config(config, cfg)
    state = rt.target(rl_loop.abstract_state(config, models))
    progs = rl_loop.programs(config, models, _shardings(state), tok, backend=backend)
    with rt.context():
        experience, _ = jax.eval_shape(progs.experience, state, rollout)
    experience = jax.tree.map(
        lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=sharding.batch_sharding(rt.mesh)), experience)
    # Without a reference policy in the state, the drift probe holds a copy of the SFT params (rl_loop.run_rl).
    sft_copy = rt.target(rt_lib.abstract_params(actor)) if config.eval_kl_to_sft and state.ref_params is None else None
    return [sampler(progs.sampler, b), ("experience", progs.experience, (state, rollout)),
            ("update", progs.update, (state, experience))], (state, sft_copy)


def _bytes_per_device(tree: Any) -> int:
    """Bytes one device holds of an abstract sharded tree (the largest shard of each leaf)."""
    total = 0
    for x in jax.tree.leaves(tree):
        shape = x.sharding.shard_shape(x.shape) if getattr(x, "sharding", None) is not None else x.shape
        total += int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total


def device_memory_bytes(config: ml_collections.ConfigDict,
                        topology: tpu_topology.Topology | None = None) -> tuple[int, str]:
    """(bytes one device may use, where that number comes from)."""
    if config.dry_run_device_memory_gib > 0:
        return int(config.dry_run_device_memory_gib * 2 ** 30), "dry_run_device_memory_gib"
    if topology is not None:
        return topology.device_memory_bytes, f"{topology.chip.kind} HBM (tpu_topology.CHIPS)"
    device = jax.local_devices()[0]
    stats = device.memory_stats() if hasattr(device, "memory_stats") else None
    if stats and stats.get("bytes_limit"):
        return int(stats["bytes_limit"]), f"{device.device_kind} memory_stats"
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return host // jax.local_device_count(), f"host RAM / {jax.local_device_count()} local {device.platform} devices"


# ------------------------------------------------------------------------------------------------ splash up front
def splash_passes(config: ml_collections.ConfigDict, cfg: ModelConfig, platform: str) -> list[dict[str, Any]]:
    """The stage's passes that run the splash kernel on `platform`: the training passes over prompt + response
    and the sampler's prefill over the prompt. Each: its length, the kernel's block, the padded length, and
    `fix`: a note when the shape costs padding or the block is not what the config asked for ('' = none)."""
    P, R = config.task.max_prompt_len, config.task.max_response_len
    if long_attention_kernel(cfg.attention_impl, platform) != "splash":
        return []
    out = []
    for what, t in (("prompt + response (training passes)", P + R), ("prompt (sampler prefill)", P)):
        if not uses_memory_linear(cfg.attention_impl, t):
            continue
        block = splash_block(t, cfg.attention_block_size)
        padded = -(-t // block) * block
        fix = []
        if cfg.attention_block_size % SPLASH_BLOCK_MULTIPLE and block < t:
            fix.append(f"model.attention_block_size={cfg.attention_block_size} is not a multiple of the kernel's "
                       f"{SPLASH_BLOCK_MULTIPLE} lanes: blocks of {block} are used")
        if padded > t:
            # The largest 128-multiple block that divides the length padded to 128 (if any) wastes the least.
            lanes = -(-t // SPLASH_BLOCK_MULTIPLE) * SPLASH_BLOCK_MULTIPLE
            better = max((b for b in range(SPLASH_BLOCK_MULTIPLE, block + 1, SPLASH_BLOCK_MULTIPLE) if lanes % b == 0))
            fix.append(f"{t} tokens are padded to {padded} ({(padded - t) / padded:.0%} of the kernel's queries and "
                       f"keys are padding)" + (f"; model.attention_block_size={better} pads to {lanes} only"
                                               if better != block and lanes < padded else ""))
        out.append(dict(what=what, length=t, block=block, padded=padded, fix="; ".join(fix)))
    return out


def check_splash(rt, cfg: ModelConfig, passes: list[dict[str, Any]]) -> None:
    """Compiles the splash kernel alone (forward and backward, one layer, one sequence per device along the batch
    axes) at each pass's length on `rt.mesh`; raises ValueError naming the fallback if it does not compile."""
    rows = sharding.data_parallel_size(rt.mesh)
    sh = sharding.batch_sharding(rt.mesh)
    dt = cfg.compute_dtype
    for p in passes:
        t, h = p["length"], cfg.head_dim
        q = jax.ShapeDtypeStruct((rows, t, cfg.num_heads, h), dt, sharding=sh)
        kv = jax.ShapeDtypeStruct((rows, t, cfg.num_kv_heads, h), dt, sharding=sh)
        mask = jax.ShapeDtypeStruct((rows, t), bool, sharding=sh)

        def loss(q, k, v, mask):
            out = splash_attention(q, k, v, mask, block_size=cfg.attention_block_size)
            return out.astype(jnp.float32).sum()

        try:
            with rt.context():
                jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, kv, kv, mask).compile()
        except Exception as e:  # noqa: BLE001 - Mosaic reports unsupported shapes as several error types
            raise ValueError(
                f"the splash attention kernel does not compile for {p['what']}: {t} tokens, {cfg.num_heads} query / "
                f"{cfg.num_kv_heads} kv heads of head_dim {h}, {cfg.dtype}, blocks of {p['block']} "
                f"({str(e).splitlines()[0][:300]}). Fallback: --config.model.attention_impl=blockwise (the "
                "memory-linear pure-JAX kernel), or a smaller --config.model.attention_block_size") from e


# ------------------------------------------------------------------------------------------------ FLOPs
def _sub_jaxprs(params: dict[str, Any]):
    for value in params.values():
        for x in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(x, jax.extend.core.ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, jax.extend.core.Jaxpr):
                yield x


def jaxpr_flops(jaxpr) -> tuple[float, bool]:
    """(FLOPs of the matmuls `jaxpr` executes, whether that count is exact) over the global arrays it traces.

    A dot_general of output O contracting K elements per output is 2 * |O| * K; a scan counts its body `length`
    times, a Pallas kernel its body once per grid step (all of its grid: a kernel that skips blocks, like causal
    splash, is counted as if it ran them), the body of a `shard_map` once per shard; a cond counts its costliest
    branch. A while loop's trip count is not known when tracing: its body counts once and the count is not exact.
    Rematerialized forward passes in the backward pass are counted: these are FLOPs executed, not model FLOPs.
    """
    total, exact = 0.0, True
    for eqn in jaxpr.eqns:
        name, params = eqn.primitive.name, eqn.params
        if name == "dot_general":
            (contract, _), _ = params["dimension_numbers"]
            lhs = eqn.invars[0].aval.shape
            total += 2.0 * math.prod(eqn.outvars[0].aval.shape) * math.prod(lhs[d] for d in contract)
            continue
        if name == "cond":
            counts = [jaxpr_flops(b.jaxpr) for b in params["branches"]]
            total += max(c for c, _ in counts)
            exact &= all(e for _, e in counts)
            continue
        inner = [jaxpr_flops(j) for j in _sub_jaxprs(params)]
        flops, inner_exact = sum(c for c, _ in inner), all(e for _, e in inner)
        if name == "scan":
            flops *= params["length"]
        elif name == "pallas_call":
            flops *= math.prod(params["grid_mapping"].grid)
        elif name == "shard_map":
            flops *= math.prod(params["mesh"].shape[a] for a in params["newly_manual_axes"])
        elif name == "while":
            inner_exact = False
        total += flops
        exact &= inner_exact
    return total, exact


def pallas_kernels(jaxpr) -> set[str]:
    """Names of the Pallas kernels (e.g. splash's) anywhere in `jaxpr`."""
    names = {eqn.params["name"] for eqn in jaxpr.eqns if eqn.primitive.name == "pallas_call"}
    for eqn in jaxpr.eqns:
        for sub in _sub_jaxprs(eqn.params):
            names |= pallas_kernels(sub)
    return names


def program_flops(traced: jax.stages.Traced, num_devices: int) -> tuple[float, bool]:
    """(matmul FLOPs one device executes per call, exact) of a traced program: `jaxpr_flops` of its global arrays
    split evenly over the mesh's `num_devices` (the batch, fsdp and tensor axes divide the work)."""
    flops, exact = jaxpr_flops(traced.jaxpr.jaxpr)
    return flops / num_devices, exact


# ------------------------------------------------------------------------------------------------ plan
def plan(config: ml_collections.ConfigDict, print_fn: Callable[[str], None] = print) -> dict[str, Any]:
    """Compiles the stage's programs (module docstring); prints and returns the plan (sizes in MiB per device,
    FLOPs per device and call, seconds at the chip's peak)."""
    config_lib.validate(config)
    topology = tpu_topology.get(config.dry_run_topology) if config.dry_run_topology else None
    rt = rt_lib.make_runtime(config, topology.devices if topology else None)
    cfg = builders.policy_model_config(config)
    device = rt.mesh.devices.flat[0]
    where = f"{topology.name}: {topology.hosts} host(s), " if topology else ""
    print_fn(f"[dry_run] {config.stage}: {cfg.model_type} {cfg.num_params / 1e6:.2f}M params, mesh "
             f"{dict(rt.mesh.shape)} over {where}{rt.mesh.devices.size} {device.device_kind} devices")
    passes = splash_passes(config, cfg, device.platform)
    for p in passes:
        print_fn(f"  splash attention, {p['what']}: {p['length']} tokens in blocks of {p['block']}"
                 + (f"; {p['fix']}" if p["fix"] else ""))
    if device.platform == "tpu":  # elsewhere splash runs only in Pallas's interpreter, which make_runtime refuses
        check_splash(rt, cfg, passes)
    progs, resident = programs(config, rt, cfg)
    resident_b = _bytes_per_device(resident)
    limit, source = device_memory_bytes(config, topology)
    peak_flops = topology.peak_flops if topology else None
    out: dict[str, Any] = {"stage": config.stage, "params": cfg.num_params, "resident_mib": resident_b / MIB,
                           "device_memory_mib": limit / MIB, "device_memory_source": source,
                           "platform": device.platform, "device_kind": device.device_kind,
                           "num_devices": int(rt.mesh.devices.size), "mesh": dict(rt.mesh.shape),
                           "topology": topology.name if topology else "", "hosts": topology.hosts if topology else 1,
                           "peak_tflops_per_device": peak_flops / 1e12 if peak_flops else None,
                           "splash": passes, "programs": {}}
    print_fn(f"  resident state {resident_b / MIB:.1f} MiB/device")
    print_fn(f"  {'program':<12} {'args':>10} {'outputs':>10} {'temps':>10} {'donated':>10} {'peak':>10}  MiB/device"
             + ("   TFLOP/device  at peak  (XLA's count)" if peak_flops else ""))
    with rt.context():
        for name, fn, args in progs:
            traced = fn.trace(*args)
            try:
                compiled = traced.lower().compile()
            except jax.errors.JaxRuntimeError as e:
                # The TPU compiler refuses a program whose buffers exceed the chip's HBM: that is the plan's answer.
                if "RESOURCE_EXHAUSTED" not in str(e):
                    raise
                out["programs"][name] = {"compile_error": str(e).splitlines()[0]}
                print_fn(f"  {name:<12} DOES NOT FIT: {str(e).splitlines()[0]}")
                continue
            mem = compiled.memory_analysis()
            sizes = {"args": mem.argument_size_in_bytes, "outputs": mem.output_size_in_bytes,
                     "temps": mem.temp_size_in_bytes, "donated": mem.alias_size_in_bytes}
            # The resident state is in memory whether or not this program takes all of it as an argument.
            peak = max(resident_b, sizes["args"]) + sizes["outputs"] + sizes["temps"] - sizes["donated"]
            row = {k: v / MIB for k, v in sizes.items()} | {"peak": peak / MIB,
                                                            "kernels": sorted(pallas_kernels(traced.jaxpr.jaxpr))}
            line = f"  {name:<12} " + " ".join(f"{row[k]:>10.1f}" for k in ("args", "outputs", "temps", "donated",
                                                                             "peak"))
            if name != "sampler":  # its decode loop stops at EOS: no per-call count to give
                flops, exact = program_flops(traced, rt.mesh.devices.size)
                cost = compiled.cost_analysis() or {}
                row |= {"tflops": flops / 1e12, "tflops_exact": exact,
                        "xla_cost_analysis_tflops": float(cost.get("flops", 0.0)) / 1e12}
                if peak_flops:
                    row["seconds_at_peak"] = flops / peak_flops
                    line += (f"  {'' if exact else '>='}{row['tflops']:>11.3g}  {row['seconds_at_peak']:>6.3g} s"
                             f"  ({row['xla_cost_analysis_tflops']:.3g})")
            out["programs"][name] = row
            print_fn(line)
    refused = [k for k, v in out["programs"].items() if "compile_error" in v]
    planned = {k: v for k, v in out["programs"].items() if k not in refused}
    worst = max(planned.items(), key=lambda kv: kv[1]["peak"]) if planned else None
    out["fits"] = not refused and worst[1]["peak"] * MIB <= limit
    print_fn((f"  largest peak {worst[1]['peak']:.1f} MiB/device ({worst[0]})" if worst else "  nothing compiled")
             + f" vs device memory {limit / MIB:.0f} MiB ({source})"
             + (f", {', '.join(refused)} refused by the compiler" if refused else "")
             + f": {'fits' if out['fits'] else 'DOES NOT FIT'}")
    if peak_flops:
        print_fn(f"  TFLOP/device: matmul FLOPs per call counted on the traced program (each loop iteration, remat "
                 f"recompute included); 'at peak': that many at {topology.chip.peak_bf16_tflops:g} bf16 TFLOP/s, "
                 "the step time at 100% MFU; XLA's cost_analysis counts each loop body once. A compiled plan, not a "
                 "run on TPU hardware.")
    return out
