"""Metric logging (JSONL + TensorBoard) and the diagnostics that expose PPO's long-CoT collapse.

The paper's collapse signature (Fig. 1-2): with a critic biased on early tokens, the mean
advantage on the first tokens of a response is large and positive (~ +0.7 at token 0) while it is
~0 later, and the response length falls. `position_bucket_means`, `early_token_bias` and
`advantage_length_corr` are jit-friendly reductions computed inside the
step; `collapse_warning` inspects the history of the advantage-length correlation and of the critic's error at
the first token on the host.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from vcppo_jax.losses import masked_mean

METRICS_FILE = "metrics.jsonl"
_TB_ILLEGAL = re.compile(r"[^-/\w.]")


def tensorboard_tag(name: str) -> str:
    """The TensorBoard tag of a metric: characters TensorBoard rejects become '_' ('eval/pass@1' ->
    'eval/pass_1'), the name TensorBoard would pick itself after logging a line per write."""
    return _TB_ILLEGAL.sub("_", name).lstrip("/")


# ----------------------------------------------------------------------------------------------
# Writer
# ----------------------------------------------------------------------------------------------


def _to_host(value: Any) -> float | int | np.ndarray | None:
    """Python scalar for size-1 numerics, ndarray for larger numeric arrays, None otherwise."""
    if isinstance(value, (bool, np.bool_)):
        return int(value)
    if isinstance(value, (int, float, np.integer, np.floating)):
        return value.item() if isinstance(value, np.generic) else value
    if isinstance(value, (np.ndarray, jax.Array)):
        arr = np.asarray(value)
        if not (np.issubdtype(arr.dtype, np.number) or arr.dtype == np.bool_):
            return None
        return arr.reshape(()).item() if arr.size == 1 else arr
    return None


class MetricWriter:
    """Appends one JSON object per `write` to `<workdir>/metrics.jsonl` and mirrors to TensorBoard.

    Scalars go to both; numeric arrays with more than one element go to TensorBoard as histograms
    only; other values (strings, None) are skipped. Non-finite scalars are written as JSON null
    (strict JSON) and as-is to TensorBoard. Only process 0 writes.
    """

    def __init__(self, workdir: str | os.PathLike, *, tensorboard: bool = True):
        self.workdir = os.fspath(workdir)
        self._active = jax.process_index() == 0
        self._file = None
        self._tb = None
        if not self._active:
            return
        os.makedirs(self.workdir, exist_ok=True)
        path = os.path.join(self.workdir, METRICS_FILE)
        _drop_torn_tail(path)
        # Line-buffered: each record reaches the OS as it is written, so a killed run loses no finished line.
        self._file = open(path, "a", encoding="utf-8", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter  # optional dependency: only needed when enabled

            self._tb = SummaryWriter(logdir=self.workdir)

    def write(self, step: int, metrics: Mapping[str, Any]) -> None:
        """metrics: flat dict of name -> scalar / array (jax arrays are fetched in one transfer)."""
        if not self._active:
            return
        if self._file is None:
            raise ValueError("MetricWriter.write called after close()")
        if "step" in metrics:
            raise ValueError("metrics must not contain the reserved key 'step'")
        host = jax.device_get(dict(metrics))
        record: dict[str, Any] = {"step": int(step)}
        for name, raw in host.items():
            value = _to_host(raw)
            if value is None:
                continue
            if isinstance(value, np.ndarray):
                if self._tb is not None and np.isfinite(value).all():
                    self._tb.add_histogram(tensorboard_tag(name), value, global_step=int(step))
                continue
            record[name] = value if math.isfinite(value) else None
            if self._tb is not None:
                self._tb.add_scalar(tensorboard_tag(name), value, global_step=int(step))
        self._file.write(json.dumps(record, allow_nan=False) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None

    def __enter__(self) -> MetricWriter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _drop_torn_tail(path: str) -> None:
    """Cuts a last line without its newline (a record a killed process was writing), so that a resumed run's
    first record does not continue it."""
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        return
    with open(path, "rb+") as f:
        f.seek(-1, os.SEEK_END)
        if f.read(1) == b"\n":
            return
        f.seek(0)
        data = f.read()
        keep = data.rfind(b"\n") + 1
        logging.warning("%s: dropping a torn last record (%d bytes) left by an interrupted run", path,
                        len(data) - keep)
        f.truncate(keep)


def read_metrics(workdir: str | os.PathLike) -> list[dict[str, Any]]:
    """All records of `<workdir>/metrics.jsonl`, one dict per step: records of the same step (training metrics,
    then the evaluation at that step) are merged, later values winning (after a resume the rerun step's)."""
    by_step: dict[int, dict[str, Any]] = {}
    with open(os.path.join(os.fspath(workdir), METRICS_FILE), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                record = json.loads(line)
                by_step.setdefault(record["step"], {}).update(record)
    return [by_step[s] for s in sorted(by_step)]


# ----------------------------------------------------------------------------------------------
# Jit-friendly diagnostics
# ----------------------------------------------------------------------------------------------


def position_bucket_means(x: jax.Array, mask: jax.Array, num_buckets: int) -> tuple[jax.Array, jax.Array]:
    """Masked mean of x per response-position bucket.

    x, mask: [batch, time]. Position t goes to bucket floor(t * num_buckets / time) (equal-width
    buckets over [0, time)). Returns (means [num_buckets], counts [num_buckets]); an empty bucket
    has mean 0 and count 0.
    """
    if not isinstance(num_buckets, int) or num_buckets < 1:
        raise ValueError(f"num_buckets={num_buckets!r} must be an int >= 1")
    if x.shape != mask.shape or x.ndim != 2:
        raise ValueError(f"x {x.shape} and mask {mask.shape} must both be [batch, time]")
    x = jnp.asarray(x, jnp.result_type(x.dtype, jnp.float32))
    time_len = x.shape[1]
    bucket = (np.arange(time_len) * num_buckets) // time_len  # static: [time]
    onehot = jnp.asarray(bucket[:, None] == np.arange(num_buckets)[None, :], x.dtype)  # [time, buckets]
    mask = mask.astype(x.dtype)
    sums = (x * mask).sum(0) @ onehot
    counts = mask.sum(0) @ onehot
    return jnp.where(counts > 0, sums / jnp.maximum(counts, 1), 0.0), counts


def early_token_bias(advantages: jax.Array, mask: jax.Array, *, early_tokens: int) -> dict[str, jax.Array]:
    """Mean advantage over each response's first `early_tokens` valid tokens vs its other tokens.

    advantages, mask: [batch, time]. Token-weighted means over the batch; an empty group gives 0.
    Returns 'diag/adv_early', 'diag/adv_late' and 'diag/adv_early_bias' (= early - late).
    """
    if not isinstance(early_tokens, int) or early_tokens < 1:
        raise ValueError(f"early_tokens={early_tokens!r} must be an int >= 1")
    if advantages.shape != mask.shape or advantages.ndim != 2:
        raise ValueError(f"advantages {advantages.shape} and mask {mask.shape} must both be [batch, time]")
    mask = mask.astype(advantages.dtype)
    rank = jnp.cumsum(mask, axis=1) - 1  # index among the valid tokens of the row
    early = mask * (rank < early_tokens)
    late = mask - early
    adv_early, adv_late = masked_mean(advantages, early > 0), masked_mean(advantages, late > 0)
    return {"diag/adv_early": adv_early, "diag/adv_late": adv_late, "diag/adv_early_bias": adv_early - adv_late}


def advantage_length_corr(advantages: jax.Array, mask: jax.Array, seq_rewards: jax.Array) -> jax.Array:
    """Correlation over the batch between each response's first-token advantage and its length, within outcome.

    advantages, mask: [batch, time] (responses right-padded, so column 0 is each response's first token);
    seq_rewards: [batch]. Both quantities are centred within each outcome class (reward > 0, and the rest) before
    the Pearson correlation, so what is left is the length preference the advantages add beyond the outcome. The
    first token is where the policy chooses how to answer (here: a direct answer or a chain of thought). A critic
    that is pessimistic on unfinished prefixes gives a short response's first token more of (r - V) than a long
    one's (lambda^T decay): strongly negative (about -0.8 in the mechanism study), which pushes the policy to short
    answers; an optimistic one, positive. A calibrated critic read +0.4 to +0.5 and GRPO about +0.1 there over the
    first steps (a longer, harder problem answered right earns more), and any of them swings in single batches.
    0 when either quantity has no variance.
    """
    if advantages.shape != mask.shape or advantages.ndim != 2 or seq_rewards.shape != advantages.shape[:1]:
        raise ValueError(f"advantages {advantages.shape}, mask {mask.shape} must be [batch, time] and seq_rewards "
                         f"{seq_rewards.shape} [batch]")
    lengths = mask.astype(jnp.float32).sum(axis=1)
    valid = (lengths > 0).astype(jnp.float32)
    first = advantages[:, 0].astype(jnp.float32) * valid
    centred = []
    for x in (first, lengths):
        out = jnp.zeros_like(x)
        for cls in (seq_rewards > 0, seq_rewards <= 0):
            w = valid * cls
            mean = (x * w).sum() / jnp.maximum(w.sum(), 1.0)
            out = out + w * (x - mean)
        centred.append(out)
    a, l = centred
    denom = jnp.sqrt((a * a).sum() * (l * l).sum())
    return jnp.where(denom > 1e-12, (a * l).sum() / jnp.maximum(denom, 1e-12), 0.0)


COLLAPSE_CORR, COLLAPSE_VALUE_ERR, COLLAPSE_WINDOW = -0.3, -0.3, 3


def collapse_warning(corr_history: Sequence[float], value_err_history: Sequence[float], *,
                     corr_threshold: float = COLLAPSE_CORR, value_err_threshold: float = COLLAPSE_VALUE_ERR,
                     window: int = COLLAPSE_WINDOW) -> str | None:
    """Warning text if, for `window` steps in a row, the advantages favoured short responses (`adv_length_corr`
    below `corr_threshold`) while the critic undervalued the start of the responses (`value_err_first`, its value
    minus the Monte-Carlo return at the first token, below `value_err_threshold`).

    corr_history, value_err_history: per-step 'diag/adv_length_corr' and 'diag/value_err_first', oldest first.
    Both, because each alone misfires: late in a healthy run, once every response uses its scratchpad, the
    correlation swings between about -0.9 and +0.5 from step to step (a bad first token also leads to a long,
    wrong response), and a noisy batch moves the critic error by ±0.3; together they name the mechanism of the
    paper's Fig. 1-2 (a pessimistic critic with lambda < 1 hands a short response's first token most of r - V).
    The mechanism study (README) shows when this fires and when it stays quiet.
    """
    if window < 1:
        raise ValueError(f"window={window} must be >= 1")
    pairs = list(zip(corr_history, value_err_history))[-window:]
    if len(pairs) < window or not all(math.isfinite(c) and math.isfinite(e) and c < corr_threshold
                                      and e < value_err_threshold for c, e in pairs):
        return None
    corr, err = pairs[-1]
    return (
        f"for {window} steps the advantages favoured short responses (first-token advantage vs length correlation "
        f"{corr:+.2f} < {corr_threshold}) while the critic undervalued their start (value - return at the first "
        f"token {err:+.2f} < {value_err_threshold}): the pessimistic-critic collapse of VC-PPO Fig. 1-2; consider "
        "value pretraining"
    )


# ----------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------


class Timer:
    """Wall time per named section and tokens/s, summarized and reset once per step.

    JAX dispatches asynchronously: block on a section's outputs (`jax.block_until_ready`) before
    it ends, or the time lands in whichever later section first waits on them.
    """

    def __init__(self) -> None:
        self._sections: dict[str, float] = {}
        self._start = time.perf_counter()

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sections[name] = self._sections.get(name, 0.0) + time.perf_counter() - t0

    def summary(self, num_tokens: int | None = None) -> dict[str, float]:
        """{'perf/step_time_s', 'perf/<section>_s', 'perf/tokens_per_s'}; starts a new step."""
        elapsed = time.perf_counter() - self._start
        out = {"perf/step_time_s": elapsed}
        out.update({f"perf/{name}_s": t for name, t in self._sections.items()})
        if num_tokens is not None:
            out["perf/tokens_per_s"] = num_tokens / max(elapsed, 1e-9)
        self._sections = {}
        self._start = time.perf_counter()
        return out
