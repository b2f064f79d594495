"""One process of a run started by tests/test_multihost.py (not a test module): a stage run as `train.py` runs it,
with a fault injected at a chosen point.

    python tests/stage_worker.py SPEC_JSON PROCESS_ID

SPEC_JSON holds "config" (the stage's config as a dict), "num_processes" and "port" (> 1 processes: joined through
`jax.distributed` from the environment variables a multi-node launch sets, gloo collectives on CPU; each process
then reports its part of the batch data path on a `DATA_PATH <json>` line), and optionally:
  "sigterm_after_step", "sigterm_process" (default 1): that process alone sends itself SIGTERM once it has logged
    that step, as one preempted host of a pod would be signalled;
  "kill_at" [point, step]: SIGKILL (no handler, no cleanup: a crashed or OOM-killed host) at RL step `step`
    (1-based) during its 'rollout', after its 'update' (before it is logged or saved), or during its 'save' (the
    checkpoint written to a temporary folder and not yet committed by orbax's rename). For runs that save every
    step.
"""

import faulthandler
import json
import os
import pathlib
import signal
import sys

import jax


import ml_collections
import numpy as np

from orbax.checkpoint._src.path import atomicity  # private: where a save is committed

from vcppo_jax import rl_loop
from vcppo_jax import runtime as rt_lib
from vcppo_jax import stages


def data_path_report(rt: rt_lib.Runtime, batch_size: int) -> dict:
    """Feeds this process's rows of the global batch arange(batch_size), reads back the device rows it holds
    and the whole batch gathered from every process."""
    rows = rt.local_rows(batch_size)
    global_rows = np.arange(batch_size, dtype=np.int32)
    placed = rt.place_batch(global_rows[rows])
    doubled = rt.fetch(jax.jit(lambda x: 2 * x)(placed))
    return {"process": jax.process_index(), "rows": [rows.start, rows.stop], "fetched": (doubled // 2).tolist(),
            "gathered": rt.gather(global_rows[rows], rows).tolist(), "global_shape": list(placed.shape),
            "total": int(jax.jit(lambda x: x.sum())(placed))}


def preempt_after(step: int) -> None:
    """This process receives SIGTERM right after it logs `step` (the signal handler only sets a flag)."""
    log = rt_lib.StepLogger.log

    def log_then_signal(self, s, metrics, **kw):
        log(self, s, metrics, **kw)
        if s == step:
            os.kill(os.getpid(), signal.SIGTERM)

    rt_lib.StepLogger.log = log_then_signal


def kill_at(point: str, step: int, workdir: str) -> None:
    """SIGKILL this process at RL step `step` (1-based) during its `point` (module docstring)."""
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731
    if point in ("rollout", "update"):
        # run_rl's rollouts call rl_loop.generate_and_score once per step (evaluations go through rollout.evaluate);
        # whole_batch_stats runs once per step right after the update, before the step is logged or saved.
        name = "generate_and_score" if point == "rollout" else "whole_batch_stats"
        original = getattr(rl_loop, name)
        # The run resumes after its newest committed step (every step is saved in these runs).
        resumed_at = max((int(p.name) for p in pathlib.Path(workdir).glob("*") if p.name.isdigit()), default=0)
        calls = []

        def counted(*args, **kwargs):
            calls.append(args)
            if resumed_at + len(calls) == step:
                die()
            return original(*args, **kwargs)

        setattr(rl_loop, name, counted)
    elif point == "save":
        finalize = atomicity.AtomicRenameTemporaryPath.finalize

        async def finalize_or_die(self, *args, **kwargs):
            if self.get_final().name == str(step):  # the step's folder, written, about to be renamed into place
                die()
            return await finalize(self, *args, **kwargs)

        atomicity.AtomicRenameTemporaryPath.finalize = finalize_or_die
    else:
        raise ValueError(f"unknown kill point {point!r}")


def enable_stack_dumps() -> None:
    """Python stacks of every thread into this process's log on a crash (SIGSEGV, SIGABRT: a fatal error in JAX's
    coordination client or gloo) and on SIGUSR1, which the test sends before it kills a worker that hangs."""
    faulthandler.enable(all_threads=True)
    faulthandler.register(signal.SIGUSR1, all_threads=True)


def main(spec_path: str, process_id: int) -> None:
    enable_stack_dumps()
    spec = json.loads(open(spec_path).read())
    config = ml_collections.ConfigDict(spec["config"])
    print(f"worker {process_id} of {spec.get('num_processes', 1)}: pid {os.getpid()}, port {spec.get('port')}",
          flush=True)
    if spec.get("num_processes", 1) > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        # As a multi-node launch sets them; `make_runtime` joins the processes (maybe_initialize_distributed).
        os.environ.update(JAX_COORDINATOR_ADDRESS=f"localhost:{spec['port']}",
                          JAX_NUM_PROCESSES=str(spec["num_processes"]), JAX_PROCESS_ID=str(process_id))
        rt = rt_lib.make_runtime(config)
        assert jax.process_count() == spec["num_processes"], jax.process_count()
        print("DATA_PATH " + json.dumps(data_path_report(rt, config.prompts_per_step * config.group_size)),
              flush=True)
    if spec.get("sigterm_after_step") is not None and process_id == spec.get("sigterm_process", 1):
        preempt_after(spec["sigterm_after_step"])
    if spec.get("kill_at"):
        kill_at(*spec["kill_at"], config.workdir)
    stages.run_stage(config)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]))
