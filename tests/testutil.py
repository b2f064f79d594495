"""Helpers shared by tests: random params built with numpy (compiling the random init costs seconds on CPU)."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from vcppo_jax import runtime


def abstract_params(model: nn.Module):
    """Boxed abstract variables {'params': ...} of a CausalLM/ValueModel (shapes and logical axes, no FLOPs)."""
    return {"params": runtime.abstract_params(model)}


def all_shapes(jaxpr) -> list[tuple[int, ...]]:
    """Shapes of every intermediate of `jaxpr`, including inside scan/while/checkpoint/pjit/custom-VJP
    sub-jaxprs."""
    shapes = []
    for eqn in jaxpr.eqns:
        shapes += [tuple(v.aval.shape) for v in eqn.outvars if hasattr(v.aval, "shape")]
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (list, tuple)) else [param]):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    shapes += all_shapes(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    shapes += all_shapes(sub)
    return shapes


def random_params(model: nn.Module, seed: int = 0, scale: float = 0.15) -> dict:
    """Variables {'params': ...} with O(1)-scale values (norm scales ~1, everything else ~N(0, scale^2)), so that every
    term of the network matters in a comparison."""
    rng = np.random.default_rng(seed)
    flat, treedef = jax.tree_util.tree_flatten_with_path(nn.unbox(abstract_params(model)))
    leaves = [((1.0 if "norm" in jax.tree_util.keystr(path) else 0.0)
               + scale * rng.standard_normal(x.shape)).astype(x.dtype) for path, x in flat]
    return jax.tree.unflatten(treedef, [jnp.asarray(x) for x in leaves])


def sleep_then(seconds: float, result=True):
    """A stand-in for a slow verification (module level, so a spawned worker can import it)."""
    import time  # noqa: PLC0415

    time.sleep(seconds)
    if isinstance(result, Exception):
        raise result
    return result
