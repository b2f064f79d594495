"""What the three training loops (SFT, value training, RL) share around their steps: the train state restored from
the workdir or freshly initialized, the step logger, the preemption guard, and the save / preempt / close block.

    with stage_run(config, rt, layout, init, total=..., desc=..., show=...) as (run, state):
        for step in range(run.start, total):
            state, metrics = ...
            run.log(step + 1, metrics)
            if run.save(step + 1, to_dict(state), meta, done=...):
                break
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Callable, Iterator

import ml_collections

from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import runtime as rt_lib


@dataclasses.dataclass
class StageRun:
    """One run of a loop: where it starts (`start`, the restored checkpoint's `meta`, {} when fresh) and where its
    steps go (`logger`, `ckpt`)."""
    config: ml_collections.ConfigDict
    ckpt: ckpt_lib.Checkpointer
    logger: rt_lib.StepLogger
    guard: Any
    start: int
    meta: dict

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Step metrics (`step`: steps done); halts after `max_bad_steps` steps in a row with skipped updates."""
        self.logger.count_nonfinite(step - 1, float(metrics["train/nonfinite"]))
        self.logger.log(step, metrics)

    def save(self, step: int, state: dict, meta: dict, *, done: bool) -> bool:
        """Saves at the last step, every `save_every` steps and when any host was signalled to stop; returns
        whether to stop now (preempted: the state of `step` is saved)."""
        stop = self.guard.should_stop_any()  # collective: every host saves the same step, even if one was signalled
        if done or step % self.config.save_every == 0 or stop:
            self.ckpt.save(step, state, meta, force=True)
        if stop:
            self.logger.print(f"preempted: saved step {step}")
        return stop


@contextlib.contextmanager
def stage_run(config: ml_collections.ConfigDict, rt: rt_lib.Runtime, layout: dict, init: Callable[[Any], dict], *,
              total: int, desc: str, show: tuple[str, ...]) -> Iterator[tuple[StageRun, dict]]:
    """(run, state dict): the state restored from `config.workdir` or `init`-ed (`runtime.restore_or_init_state`),
    inside the preemption guard and the mesh's context; the checkpointer and logger are closed on the way out, after
    pending saves finish."""
    ckpt, state, meta, start = rt_lib.restore_or_init_state(rt, config, layout, init)
    logger = rt_lib.StepLogger(config, total=total, initial=start, desc=desc, show=show)
    try:
        with ckpt_lib.preemption_guard() as guard, rt.context():
            yield StageRun(config=config, ckpt=ckpt, logger=logger, guard=guard, start=start, meta=meta), state
    finally:
        ckpt.wait()
        ckpt.close()
        logger.close()
