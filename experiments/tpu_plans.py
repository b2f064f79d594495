"""The recipes' plans on Cloud TPU slices, compiled on this host without a TPU (README, "Compiling for Cloud TPU
without a TPU"): for each recipe and slice, every stage of its pipeline is planned by the dry run
(`--config.dry_run=True --config.dry_run_topology=...`): the TPU compiler's per-device memory against the chips'
HBM, and the FLOPs per call of each training program with the time they take at the chip's peak. A stage that does
not fit is planned again with the overrides of `fallbacks` until one fits. The Qwen recipes plan their RL stage, the
pipeline's largest; the others every stage they run. These are compiled plans, not runs on TPU hardware.

  python -m vcppo_jax.tpu_topology install       # once: libtpu into ~/.cache/vcppo_jax (outside the venv)
  python experiments/tpu_plans.py                 # all plans, ~1 h on 2 CPU cores; --only NAME ... to pick
Writes experiments/results/tpu_plans/<plan>.json and prints the README's table.

The Qwen recipes (configs/vcppo_gsm8k.py) read only config.json from their model folders in a dry run; without the
checkpoints, this script writes the published config.json of each model (values below, from the models' Hugging
Face pages) beside a stand-in tokenizer (the programs see only its stop and pad ids). SmolLM2 (configs/smollm2.py)
plans from its prepared folder (experiments/prepare_model.py), whose chat template it needs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
import tempfile
import time

import ml_collections

import config_files
from vcppo_jax import config as config_lib
from vcppo_jax import dry_run, stages
from vcppo_jax.models.hf import is_hf_checkpoint
from vcppo_jax.stage_meta import prerequisites
from vcppo_jax.tokenizer import synthetic_tokenizer

REPO = pathlib.Path(__file__).resolve().parents[1]
OUT = REPO / "experiments" / "results" / "tpu_plans"
# config.json of Qwen/Qwen2.5-0.5B-Instruct and Qwen/Qwen3-0.6B (architecture fields only).
HF_CONFIGS = {
    "qwen2.5-0.5b": dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", vocab_size=151936, hidden_size=896,
                         intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6,
                         tie_word_embeddings=True, hidden_act="silu", use_sliding_window=False),
    "qwen3-0.6b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=40960, rope_theta=1000000.0, rms_norm_eps=1e-6,
                       tie_word_embeddings=True, hidden_act="silu", attention_bias=False, use_sliding_window=False),
}


def colab_demo_config() -> ml_collections.ConfigDict:
    """The notebook's own config cell at DEMO_SIZE='tpu' (its code cells run in order until `config` exists)."""
    import os  # noqa: PLC0415

    nb = json.loads((REPO / "experiments" / "colab_demo.ipynb").read_text())
    os.environ["VCPPO_DEMO_SIZE"] = "tpu"
    ns: dict = {"__name__": "__main__"}
    for cell in nb["cells"]:
        if cell["cell_type"] == "code" and "config" not in ns:
            # IPython shell / magic lines are reached only on Colab; as in tests/test_colab_demo.py they become pass.
            lines = "".join(cell["source"]).splitlines()
            src = "\n".join(l[: len(l) - len(l.lstrip())] + "pass" if l.lstrip().startswith(("!", "%")) else l
                            for l in lines)
            exec(compile(src, "colab_demo.ipynb", "exec"), ns)  # noqa: S102
    return ns["config"]


def gsm8k_config(model: str, folders: pathlib.Path) -> ml_collections.ConfigDict:
    c = config_files.load("vcppo_gsm8k", model)
    folder = folders / model
    if not (folder / "config.json").exists():
        folder.mkdir(parents=True)
        synthetic_tokenizer().save_pretrained(folder)
        (folder / "config.json").write_text(json.dumps(HF_CONFIGS[model]))
    c.model.hf_path = str(folder)
    return c


def smollm2_config() -> ml_collections.ConfigDict:
    c = config_files.load("smollm2", "vcppo")
    if not is_hf_checkpoint(c.sft_dir):
        sys.exit(f"{c.sft_dir} is missing: python experiments/prepare_model.py smollm2-135m-instruct --out {c.sft_dir}")
    return c


# name -> (recipe as a command names it, config builder, slice, what the slice is called on Cloud, planned stages).
PLANS = {
    "colab_demo_v5e-1": ("experiments/colab_demo.ipynb (DEMO_SIZE='tpu')", lambda _: colab_demo_config(), "v5e:1x1",
                         "v5e-1", "all"),
    "gsm8k_qwen2.5-0.5b_v5e-8": ("configs/vcppo_gsm8k.py:qwen2.5-0.5b",
                                 lambda d: gsm8k_config("qwen2.5-0.5b", d), "v5e:2x4", "v5e-8", "rl"),
    "gsm8k_qwen2.5-0.5b_v4-32": ("configs/vcppo_gsm8k.py:qwen2.5-0.5b",
                                 lambda d: gsm8k_config("qwen2.5-0.5b", d), "v4:2x2x4", "v4-32", "rl"),
    "gsm8k_qwen3-0.6b_v5e-8": ("configs/vcppo_gsm8k.py:qwen3-0.6b", lambda d: gsm8k_config("qwen3-0.6b", d),
                               "v5e:2x4", "v5e-8", "rl"),
    "gsm8k_qwen3-0.6b_v4-32": ("configs/vcppo_gsm8k.py:qwen3-0.6b", lambda d: gsm8k_config("qwen3-0.6b", d),
                               "v4:2x2x4", "v4-32", "rl"),
    "smollm2_vcppo_v5e-1": ("configs/smollm2.py:vcppo", lambda _: smollm2_config(), "v5e:1x1", "v5e-1", "all"),
}


def stage_configs(config: ml_collections.ConfigDict, which: str) -> list[ml_collections.ConfigDict]:
    """The pipeline's stages in order ('all': the earlier stages it would run first, then itself; an HF folder as
    sft_dir is a finished SFT stage) or only `config`."""
    earlier = [] if which != "all" else [
        stages.derived_config(config, stage, workdir) for stage, workdir in prerequisites(config)
        if not (stage == "sft" and is_hf_checkpoint(workdir))]
    return earlier + [config]


def fallbacks(config: ml_collections.ConfigDict, num_devices: int) -> list[dict]:
    """What to try, in order, when a stage does not fit: the state sharded over every device (fsdp), then, for the
    RL stages, also half the prompts per step: the sampler's temporaries did not shrink with the mesh (Qwen3-0.6B on
    a v5e-8: refused at 16.3 GB on data=8, 17.7 GiB on fsdp=8 and on data=fsdp=tensor=2; its whole bf16 KV cache of
    512 responses is 17.5 GiB)."""
    fsdp = {"mesh.data": 1, "mesh.fsdp": num_devices, "mesh.tensor": 1}
    return [fsdp] + ([fsdp | {"prompts_per_step": config.prompts_per_step // 2}] if "prompts_per_step" in config
                     else [])


def _apply(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    c = config.copy_and_resolve_references()
    for key, value in overrides.items():
        node, *path = key.split(".")
        if path:
            c[node][path[0]] = value
        else:
            c[node] = value
    return c


def plan_stage(config: ml_collections.ConfigDict, topology: str, overrides: dict, log) -> dict:
    c = _apply(config, overrides | {"dry_run": True, "dry_run_topology": topology, "progress_bar": False,
                                    "tensorboard": False})
    config_lib.validate(c)
    start = time.time()
    result = dry_run.plan(c, print_fn=log)
    return result | {"overrides": overrides, "compile_seconds": round(time.time() - start, 1)}


def command(name: str, recipe: str, topology: str, stage: str, overrides: dict) -> str:
    """The train.py command that plans the recipe's RL stage alone; the earlier stages a run derives from it (and
    the notebook's config, not a file) are planned by this script."""
    if recipe.startswith("experiments/") or stage != "rl":
        return f"python experiments/tpu_plans.py --only {name}"
    flags = "".join(f" --config.{k}={v}" for k, v in overrides.items())
    hf = " --config.model.hf_path=<folder with the model's config.json>" if "gsm8k" in recipe else ""
    return (f"python experiments/train.py --config={recipe}{hf} --config.dry_run=True "
            f"--config.dry_run_topology={topology}{flags}")


def run_plan(name: str, folders: pathlib.Path) -> dict:
    recipe, build, topology, cloud_name, which = PLANS[name]
    lines: list[str] = []

    def log(text: str) -> None:
        print(text, flush=True)
        lines.append(text)

    log(f"=== {name}: {recipe} on {cloud_name} ({topology})")
    out = {"plan": name, "recipe": recipe, "topology": topology, "slice": cloud_name, "stages": [],
           "note": "compiled plans (TPU compiler via libtpu, no TPU hardware), not runs on TPU"}
    for config in stage_configs(build(folders), which):
        row = plan_stage(config, topology, {}, log)
        row["command"] = command(name, recipe, topology, config.stage, {})
        if not row["fits"]:
            for overrides in fallbacks(config, row["num_devices"]):
                log(f"--- {config.stage} does not fit; trying {overrides}")
                fix = plan_stage(config, topology, overrides, log)
                fix["command"] = command(name, recipe, topology, config.stage, overrides)
                row["fits_with"] = fix
                if fix["fits"]:
                    break
        out["stages"].append(row)
    out["log"] = lines
    return out


def table(plans: list[dict]) -> str:
    """The README's markdown table: one row per planned stage (and per fallback that was compiled)."""
    rows = ["| recipe | slice | stage | mesh, overrides | resident | largest peak / HBM | fits | train step TFLOP/chip "
            "| at peak |", "|---|---|---|---|---|---|---|---|---|"]
    for p in plans:
        for s in p["stages"]:
            for r in [s] + ([s["fits_with"]] if "fits_with" in s else []):
                progs = r["programs"]
                refused = [k for k, v in progs.items() if "compile_error" in v]
                peak_name, peak = max(((k, v["peak"]) for k, v in progs.items() if k not in refused),
                                      key=lambda kv: kv[1], default=(None, 0.0))
                step = next(progs[k] for k in ("update", "value_step", "sft_step") if k in progs)
                peak_text = (f"{', '.join(refused)}: over HBM (compiler)" if refused else
                             f"{peak / 1024:.2f} GiB ({peak_name})")
                flops = (f"{step['tflops']:.3g} | {step['seconds_at_peak']:.3g} s" if "tflops" in step
                         else "(not compiled) | ")
                mesh = "x".join(f"{k}{v}" for k, v in r["mesh"].items() if v > 1) or "1 chip"
                extra = ", ".join(f"{k}={v}" for k, v in r["overrides"].items() if not k.startswith("mesh."))
                rows.append(
                    f"| {p['recipe']} | {p['slice']} (`{p['topology']}`) | {s['stage']} | {mesh}"
                    f"{', ' + extra if extra else ''} | {r['resident_mib'] / 1024:.2f} GiB | "
                    f"{peak_text} / {r['device_memory_mib'] / 1024:.0f} GiB | "
                    f"{'yes' if r['fits'] else '**no**'} | {flops} |")
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--only", nargs="*", choices=tuple(PLANS), default=None)
    p.add_argument("--out", type=pathlib.Path, default=OUT)
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as folders:
        for name in args.only or PLANS:
            result = run_plan(name, pathlib.Path(folders))
            (args.out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    plans = [json.loads(f.read_text()) for f in sorted(args.out.glob("*.json"))]
    print(table([pl for name in PLANS for pl in plans if pl["plan"] == name]))


if __name__ == "__main__":
    main()
