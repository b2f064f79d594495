"""experiments/colab_demo.ipynb runs end to end on CPU at DEMO_SIZE='tiny', without jupyter.

The notebook's code cells are executed in one namespace, as a kernel would; IPython shell/magic lines (`!pip`,
`%cd`, only reached on Colab) become `pass` so the `if IN_COLAB:` block stays valid Python.
"""

import json
import pathlib

import matplotlib

matplotlib.use("Agg")  # before pyplot is first imported (the notebook imports it)

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from vcppo_jax.metrics import read_metrics  # noqa: E402

REPO = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOK = REPO / "experiments" / "colab_demo.ipynb"


def code_cells(path: pathlib.Path) -> list[str]:
    nb = json.loads(path.read_text())
    assert nb["nbformat"] == 4
    out = []
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("code", "markdown")
        if cell["cell_type"] != "code":
            continue
        lines = "".join(cell["source"]).splitlines()
        out.append("\n".join(line[: len(line) - len(line.lstrip())] + "pass"
                             if line.lstrip().startswith(("!", "%")) else line for line in lines))
    return out


def test_notebook_is_valid_nbformat4_with_colab_installs():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4 and nb["metadata"]["kernelspec"]["language"] == "python"
    assert any(c["cell_type"] == "markdown" for c in nb["cells"])
    source = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    for needle in ("REPO_URL =", "!git clone", "!pip install -q -r requirements.txt", "jax[tpu]==0.10.2",
                   "jax.devices()", "stages.run_stage(config)", "read_metrics("):
        assert needle in source, needle


def test_notebook_runs_tiny_on_cpu(tmp_path, monkeypatch):
    workdir = tmp_path / "demo"
    monkeypatch.setenv("VCPPO_DEMO_SIZE", "tiny")
    monkeypatch.setenv("VCPPO_DEMO_WORKDIR", str(workdir))
    monkeypatch.chdir(REPO / "experiments")  # where a local Jupyter would start the kernel
    plt.close("all")
    ns = {"__name__": "__main__"}
    for i, src in enumerate(code_cells(NOTEBOOK)):
        exec(compile(src, f"{NOTEBOOK.name}[code cell {i}]", "exec"), ns)  # noqa: S102

    assert ns["IN_COLAB"] is False and ns["DEMO_SIZE"] == "tiny"
    config = ns["config"]
    assert config.mesh.data == -1 and config.workdir == str(workdir / "vcppo")
    for stage in ("sft", "value_pretrain", "vcppo", "ppo_pessimistic"):
        assert (workdir / stage / "metrics.jsonl").exists(), stage
    ppo_config = ns["ppo_config"]
    assert (ppo_config.algorithm, ppo_config.lambda_critic, ppo_config.critic_init_bias) == ("ppo", 0.95, -2.0)
    assert ppo_config.critic_dir == config.critic_dir and ppo_config.sft_dir == config.sft_dir

    rl = [r for r in read_metrics(workdir / "vcppo") if "rollout/response_length_mean" in r]
    assert [r["step"] for r in rl] == list(range(1, config.num_steps + 1))
    for key in ("rollout/accuracy", "value/explained_var", "diag/value_err_pos00", "diag/adv_pos00",
                "diag/adv_length_corr", f"diag/adv_pos{config.diag_buckets - 1:02d}"):
        assert key in rl[0], key

    fig = ns["fig"]
    assert plt.fignum_exists(fig.number)
    axes = fig.get_axes()
    assert len(axes) == 4
    length_line = axes[0].get_lines()[0]
    assert list(length_line.get_xdata()) == [r["step"] for r in rl]
    assert list(length_line.get_ydata()) == pytest.approx([r["rollout/response_length_mean"] for r in rl])
    err_line, adv_line, ppo_err_line = axes[3].get_lines()[:3]
    want_adv = [rl[0][f"diag/adv_pos{i:02d}"] for i in range(config.diag_buckets)]
    assert list(adv_line.get_ydata()) == pytest.approx(want_adv)
    # Same seed, SFT policy and critic checkpoint: the first rollouts are the same, and PPO's critic is VC-PPO's
    # shifted by -2 at every position that holds tokens.
    err, ppo_err = np.asarray(err_line.get_ydata()), np.asarray(ppo_err_line.get_ydata())
    seen = [rl[0][f"diag/tokens_pos{i:02d}"] > 0 for i in range(config.diag_buckets)]
    np.testing.assert_allclose(ppo_err[seen], err[seen] - 2.0, atol=1e-4)
    plt.close(fig)
