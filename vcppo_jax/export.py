"""A trained policy out as an HF (transformers) folder: weights, config.json and the run's tokenizer.

The policy is the actor of an RL run (`actor/params`) or the model of an SFT run (`params`), read from the run's
checkpoint in `config.workdir`; its architecture comes from the checkpoint's meta, the tokenizer from the config
(`builders.tokenizer`), so the folder loads with `AutoModelForCausalLM` / `AutoTokenizer` and with our
`load_hf_checkpoint`, and chats with the same template.
"""

from __future__ import annotations

import os

import flax.linen as nn
import jax
import ml_collections

from vcppo_jax import builders
from vcppo_jax import checkpoint as ckpt_lib
from vcppo_jax import runtime as rt_lib
from vcppo_jax.models import CausalLM, save_hf_checkpoint

_PARAMS_KEY = {"rl": "actor/params", "sft": "params"}


def export_policy(config: ml_collections.ConfigDict, out: str, *, step: int | None = None,
                  dtype: str = "float32") -> str:
    """Writes the policy of the run `config` describes (its newest readable step, or `step`) to the folder `out`
    (which must not hold a model already); returns `out`."""
    if config.stage not in _PARAMS_KEY:
        raise ValueError(f"config.stage={config.stage!r} has no policy to export; one of {sorted(_PARAMS_KEY)}")
    if os.path.exists(os.path.join(out, "config.json")):
        raise FileExistsError(f"{out} already holds a model; export into a new folder")
    meta = ckpt_lib.read_meta(config.workdir, step)
    if not meta:
        raise FileNotFoundError(f"no {config.stage} checkpoint in {config.workdir!r}")
    cfg = builders.model_config_from_json(meta["model_config"])
    tok = builders.tokenizer(config)
    one_device = jax.sharding.SingleDeviceSharding(jax.devices()[0])  # whatever mesh the run trained on
    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=one_device),
                          nn.unbox(rt_lib.abstract_params(CausalLM(cfg))))
    params = ckpt_lib.load_params(config.workdir, target, key=_PARAMS_KEY[config.stage], step=step)
    stop = builders.stop_ids(config, tok)
    # generate() then stops where our sampler does: at EOS or the chat template's end of turn.
    eos = list(stop) if len(stop) > 1 else stop[0]
    save_hf_checkpoint(out, cfg, {"params": params}, dtype=dtype, eos_token_id=eos, pad_token_id=tok.pad_token_id,
                       bos_token_id=tok.bos_token_id)
    tok.save_pretrained(out)
    return out
