"""Multi-host without a pod, and crashes: the real RL loop run in other processes (`tests/stage_worker.py`) against
the same uninterrupted run in this process on 8 fake CPU devices.

Multi-host: 2 processes of 4 fake CPU devices each (gloo collectives, `jax.distributed` on localhost).

- Data path: each process feeds its own rows of the global batch and reads back the same rows; gathered over the
  processes, every row is there exactly once.
- A 1-process checkpoint resumed in 2 processes (on another mesh, fsdp across the processes) continues as the
  1-process run does: every later saved state and training record equal within float tolerance (the processes
  sum gradients over gloo in another order). Metrics and evaluations are written once, by process 0.
- SIGTERM to one process only: both save the same step (a collective orbax save that hangs unless every process
  joins it) and exit cleanly; that 2-process checkpoint resumed in 1 process ends where the uninterrupted run does.

Fault injection: one process killed with SIGKILL (no handler runs) at three points of three successive launches (in
a step's rollout, during a checkpoint save before orbax commits it, after an update before its save) and rerun each
time ends with every saved state equal to the uninterrupted run's.

A hang fails the test at `TIMEOUT_S` instead of blocking CI. Every worker writes to tmp/launch_<n>/process_<i>.log;
a failing test shows each worker's exit code and output tail (and, for a hang, each worker's Python stacks).
"""

import contextlib
import json
import os
import pathlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
import pytest

from test_pipeline import tiny_config, with_fields
from test_resume_loops import assert_same_tree, saved_steps, training_records
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import stages
from vcppo_jax.metrics import METRICS_FILE

N = 4  # RL steps
K = 2  # where the 1-process checkpoint is handed over, and where one process is signalled
TIMEOUT_S = 240
GRACE_S = 30
TAIL_CHARS = 4000
WORKER = pathlib.Path(__file__).with_name("stage_worker.py")
# Gradients and losses summed in another order: params agree to ~1e-6 after N Adam steps; sampled tokens agree.
RTOL, ATOL = 1e-4, 1e-5
# The 2-process runs' mesh: fsdp = 4 spans both processes (each holds 2 of its shards), so params and optimizer
# states are split across hosts; the 1-process runs use test_pipeline's data=2, fsdp=2, tensor=2.
TWO_PROCESS_MESH = dict(data=1, fsdp=4, tensor=2)

def rl_config(root, **fields) -> ml_collections.ConfigDict:
    c = tiny_config("vcppo", root, num_steps=N, save_every=1, max_to_keep=N, eval_every=K)
    c.update({k: str(v) if isinstance(v, pathlib.Path) else v for k, v in fields.items()})
    return c


def saved_state(workdir, step: int) -> dict:
    """The whole saved state of `step` as numpy, whatever devices and processes saved it (restored onto one
    device of this process: the saved shardings name devices of the other processes)."""
    path = pathlib.Path(workdir).resolve() / str(step) / ckpt_lib.STATE
    with ocp.StandardCheckpointer() as reader:
        device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        target = jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=device),
                              reader.metadata(path).item_metadata)
        return jax.device_get(reader.restore(path, target))


@contextlib.contextmanager
def reserved_port() -> Iterator[int]:
    """A free TCP port, kept bound until the launch is over. Process 0 binds it for the `jax.distributed`
    coordinator seconds later, after importing JAX: a port merely found free and released could be taken in between
    by any socket on the machine (outgoing connections included), and process 0 then dies at start-up ('Failed to add
    port to server', SIGSEGV) while process 1 waits for a coordinator that never comes. The holding socket is bound,
    never listening, with SO_REUSEPORT as gRPC's server binds: the coordinator can bind the port beside it, other
    sockets cannot, and the kernel does not hand it out for outgoing connections."""
    try:  # dual-stack, as the coordinator binds '[::]:port'
        s = socket.socket(socket.AF_INET6)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        address = ("::", 0)
    except OSError:  # no IPv6 here
        s = socket.socket(socket.AF_INET)
        address = ("", 0)
    with s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(address)
        yield s.getsockname()[1]


def new_launch_dir(tmp: pathlib.Path) -> pathlib.Path:
    """tmp/launch_<n>: the next free one, so the logs of a test's successive launches are all kept."""
    n = len(list(tmp.glob("launch_*")))
    path = tmp / f"launch_{n}"
    path.mkdir()
    return path


def kill_with_stacks(procs: list[subprocess.Popen]) -> None:
    """Kills hanging workers, each first asked (SIGUSR1, `stage_worker.enable_stack_dumps`) to write where its
    threads are waiting into its log."""
    for p in procs:
        p.send_signal(signal.SIGUSR1)
    time.sleep(2)  # the dump is written by a C handler at once; this only lets a loaded machine schedule it
    for p in procs:
        p.kill()
        p.wait()


def wait_all(procs: list[subprocess.Popen]) -> str | None:
    """Waits for every worker: None when all exited, else why the rest were killed. A worker that failed leaves
    the others waiting in a collective it will never join: they are given GRACE_S to exit, then killed."""
    deadline, failed_at = time.monotonic() + TIMEOUT_S, None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now > deadline or (failed_at is not None and now > failed_at + GRACE_S):
            kill_with_stacks([p for p in procs if p.poll() is None])
            return (f"did not finish within {TIMEOUT_S} s (a collective one process never joined?)"
                    if failed_at is None else f"still running {GRACE_S} s after another process failed: killed")
        time.sleep(0.2)
    return None


def launch_report(launch: pathlib.Path, codes: list[int], outs: list[str], killed: str | None) -> str:
    """Every worker's exit code and the tail of its output (stdout and stderr together), for a failure message."""
    lines = [f"{len(codes)}-process launch {launch}" + (f": {killed}" if killed else "")]
    for i, (code, out) in enumerate(zip(codes, outs)):
        lines += [f"--- process {i}: exit code {code}; last {TAIL_CHARS} characters of {launch}/process_{i}.log:",
                  out[-TAIL_CHARS:]]
    return "\n".join(lines)


def run_processes(tmp: pathlib.Path, config: ml_collections.ConfigDict, num_processes: int = 2,
                  **spec) -> tuple[list[int], list[str]]:
    """Runs `config` in `num_processes` worker processes (4 fake CPU devices each, or 8 for one); returns their
    exit codes and outputs. Each worker writes to tmp/launch_<n>/process_<i>.log (kept among pytest's tmp dirs);
    every launch's report (exit codes, output tails) is printed, so pytest shows it with any failure of the test.
    Fails the test if they have not all exited within TIMEOUT_S."""
    launch = new_launch_dir(tmp)
    spec_path = launch / "spec.json"
    devices = 8 if num_processes == 1 else 4
    env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               JAX_COMPILATION_CACHE_DIR=jax.config.jax_compilation_cache_dir or "",
               JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0.5")
    logs = [launch / f"process_{i}.log" for i in range(num_processes)]
    with reserved_port() as port:
        spec_path.write_text(json.dumps(dict(spec, num_processes=num_processes, port=port, config=config.to_dict())))
        procs = []
        for i, log in enumerate(logs):
            # A file, not a pipe: a pipe nobody reads while this waits on another process fills and blocks its writer.
            with open(log, "w") as f:
                procs.append(subprocess.Popen([sys.executable, str(WORKER), str(spec_path), str(i)], env=env,
                                              text=True, stdout=f, stderr=subprocess.STDOUT))
        killed = wait_all(procs)
    codes, outs = [p.returncode for p in procs], [log.read_text() for log in logs]
    report = launch_report(launch, codes, outs, killed)
    print(report)
    if killed:
        pytest.fail(report)
    return codes, outs


def run_two_processes(tmp: pathlib.Path, config: ml_collections.ConfigDict, **spec) -> list[str]:
    """Runs `config` in 2 processes; returns their stdouts, asserting both exited 0."""
    codes, outs = run_processes(tmp, config, 2, **spec)
    for i, (code, out) in enumerate(zip(codes, outs)):
        assert code == 0, f"process {i} exited {code}"  # the launch's report is printed above
    return outs


def data_path_reports(outs: list[str]) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for out in outs for line in out.splitlines()
            if line.startswith("DATA_PATH ")]


def metric_steps(workdir, key: str) -> list[int]:
    with open(pathlib.Path(workdir) / METRICS_FILE) as f:
        return [r["step"] for r in map(json.loads, f) if key in r]


def assert_close_tree(got, want, what):
    flat_got, flat_want = jax.tree_util.tree_flatten_with_path(got)[0], jax.tree_util.tree_flatten_with_path(want)[0]
    assert [p for p, _ in flat_got] == [p for p, _ in flat_want], what
    for (path, g), (_, w) in zip(flat_got, flat_want):
        g, w = np.asarray(g), np.asarray(w)
        if np.issubdtype(w.dtype, np.floating):
            np.testing.assert_allclose(g, w, rtol=RTOL, atol=ATOL, err_msg=f"{what} {jax.tree_util.keystr(path)}")
        else:
            np.testing.assert_array_equal(g, w, err_msg=f"{what} {jax.tree_util.keystr(path)}")


def assert_close_records(got: list[dict], want: list[dict]):
    assert [r["step"] for r in got] == [r["step"] for r in want]
    for g, w in zip(got, want):
        assert g.keys() == w.keys()
        for k in w:
            assert g[k] == pytest.approx(w[k], rel=1e-3, abs=1e-4), (g["step"], k)


# Process 0 of a launch, as far as binding the coordinator: it crashes (SIGSEGV) when the port is taken.
BIND_COORDINATOR = """import sys, jax
jax.distributed.initialize(f"localhost:{sys.argv[1]}", num_processes=1, process_id=0, initialization_timeout=60)
jax.distributed.shutdown()"""


def test_reserved_port_keeps_other_sockets_off_but_not_the_coordinator():
    with reserved_port() as port:
        for host in ("127.0.0.1", "0.0.0.0"):
            with socket.socket() as other, pytest.raises(OSError):  # EADDRINUSE: what the coordinator met
                other.bind((host, port))
        bound = subprocess.run([sys.executable, "-c", BIND_COORDINATOR, str(port)], env=dict(os.environ,
                               JAX_PLATFORMS="cpu"), capture_output=True, text=True, timeout=TIMEOUT_S)
        assert bound.returncode == 0, f"exit code {bound.returncode}:\n{bound.stderr[-TAIL_CHARS:]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted N-step VC-PPO run (and its SFT and value-pretraining stages) in this process, 8 devices."""
    root = tmp_path_factory.mktemp("multihost")
    config = rl_config(root)
    stages.run_stage(config)
    return root, config


def test_one_process_checkpoint_resumes_in_two_processes(reference, tmp_path):
    root, ref = reference
    workdir = root / "vcppo_two_processes"
    shutil.copytree(ref.workdir, workdir, ignore=shutil.ignore_patterns(METRICS_FILE, *map(str, range(K + 1, N + 1))))
    assert saved_steps(workdir) == list(range(1, K + 1))
    config = rl_config(root, workdir=workdir, mesh=ml_collections.ConfigDict(TWO_PROCESS_MESH))
    outs = run_two_processes(tmp_path, config)

    reports = data_path_reports(outs)
    batch = config.prompts_per_step * config.group_size
    assert sorted(r["process"] for r in reports) == [0, 1]
    covered = sorted(i for r in reports for i in range(*r["rows"]))
    assert covered == list(range(batch))  # each row fed by exactly one process
    for r in reports:
        assert r["global_shape"] == [batch] and r["total"] == sum(range(batch))
        assert r["fetched"] == list(range(*r["rows"])) and r["gathered"] == list(range(batch))

    assert saved_steps(workdir) == saved_steps(ref.workdir) == list(range(1, N + 1))
    for step in range(K + 1, N + 1):
        assert_close_tree(saved_state(workdir, step), saved_state(ref.workdir, step), f"step {step}")
    assert ckpt_lib.read_meta(workdir)["eval"] == pytest.approx(ckpt_lib.read_meta(ref.workdir)["eval"], rel=1e-3)
    # One record per step, and one evaluation per eval step: process 1 wrote nothing.
    assert_close_records(training_records(workdir), [r for r in training_records(ref.workdir) if r["step"] > K])
    assert metric_steps(workdir, "eval/pass@1") == [N]
    assert "[vcppo]" in outs[0] and "[vcppo]" not in outs[1]  # the stage's start and end lines: process 0 only


def test_sigterm_to_one_process_saves_both_and_resumes_in_one(reference, tmp_path):
    root, ref = reference
    workdir = root / "vcppo_preempted"
    # Only the preemption save before step N: a save one process skipped would hang the other.
    config = rl_config(root, workdir=workdir, save_every=100)
    outs = run_two_processes(tmp_path, with_fields(config, mesh=ml_collections.ConfigDict(TWO_PROCESS_MESH)),
                             sigterm_after_step=K, sigterm_process=1)
    assert saved_steps(workdir) == [K] and not ckpt_lib.read_meta(workdir)["done"]
    assert f"preempted: saved step {K}" in outs[0]  # process 0 was not signalled, yet stopped and saved with 1

    stages.run_stage(config)  # the 2-process checkpoint, restored in this 8-device process on its own mesh
    assert saved_steps(workdir) == [K, N]
    assert_close_tree(saved_state(workdir, N), saved_state(ref.workdir, N), f"step {N}")
    assert_close_records(training_records(workdir), training_records(ref.workdir))
    assert metric_steps(workdir, "eval/pass@1") == [0, K, N]


# (SIGKILL point, RL step): one per launch, each launch resuming from the checkpoints the previous one committed.
KILLS = (("rollout", 2), ("save", 3), ("update", 4))


def test_sigkill_at_three_points_and_rerun_equals_the_uninterrupted_run(reference, tmp_path):
    root, ref = reference
    workdir = root / "vcppo_killed"
    config = rl_config(root, workdir=workdir)  # saves every step
    for point, step in KILLS:
        (code,), (out,) = run_processes(tmp_path, config, 1, kill_at=[point, step])
        assert code == -signal.SIGKILL, f"not killed at {point} {step}:\n{out[-3000:]}"
        # Saves are asynchronous: the last one or two before the kill may not have been committed either.
        committed = saved_steps(workdir)
        assert committed == list(range(1, len(committed) + 1)) and len(committed) < step, (point, step, committed)
        if point == "save":  # killed with the step's files written but not committed
            assert list(workdir.glob(f"{step}.orbax-checkpoint-tmp*")), sorted(p.name for p in workdir.iterdir())
    (code,), (out,) = run_processes(tmp_path, config, 1)
    assert code == 0, out[-3000:]
    assert saved_steps(workdir) == list(range(1, N + 1))
    for step in range(1, N + 1):  # same devices, same mesh: the same numbers
        assert_same_tree(saved_state(workdir, step), saved_state(ref.workdir, step), f"step {step}")
    # Every record a killed launch wrote stays readable; for each step the last one (the rerun's) is the reference's.
    want = {r["step"]: r for r in training_records(ref.workdir)}
    got = {r["step"]: r for r in training_records(workdir)}
    assert got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], rel=1e-6, abs=1e-7), step
