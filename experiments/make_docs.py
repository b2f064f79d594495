"""The generated parts of the documentation: the config reference and the results tables.

  python experiments/make_docs.py          # rewrite experiments/CONFIG.md and the generated regions in place
  python experiments/make_docs.py --check  # exit 1 naming each document that differs from what this generates

experiments/CONFIG.md is generated whole from `vcppo_jax/config.py`: every field of every stage's default config
(`config.default_config(stage)` for `config.STAGES`) with its default, its description and its allowed values. A
field's description is the comment beside its default in the builder that sets it: the trailing comment on its line
(`c.gamma = 1.0  # discount per token.`, or a `name=value,  # ...` line of a `dict(...)`), and/or a comment
paragraph starting `# name: ...` in that builder (dotted for nested dicts, `*` for any one name). Allowed values are
what `config.validate` checks on the stage's defaults (recorded by running it), so they are the owning modules' lists.

experiments/STUDIES.md and experiments/BENCHMARKS.md are hand-written prose around regions delimited by
`<!-- BEGIN GENERATED: name -->` and `<!-- END GENERATED: name -->`; each region is rendered from the committed JSON
under experiments/results/ and ends with the JSON's "provenance" block (command, commit, machine, date).
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import io
import json
import pathlib
import re
import sys
import tokenize
from typing import Any, Callable

import ml_collections

import gradient_noise
import plot_results
import real_model_report
import tpu_plans
from vcppo_jax import config as config_lib
from vcppo_jax.data import math_tasks

ROOT = pathlib.Path(__file__).resolve().parent.parent
RESULTS = ROOT / "experiments" / "results"
CONFIG_MD = ROOT / "experiments" / "CONFIG.md"
TAG = re.compile(r"^\s*#\s*([A-Za-z_*][\w.*]*):\s+(.*)$")
PROVENANCE_KEYS = ("command", "commit", "machine", "date")


# ----------------------------------------------------------------------------------------------------------------
# Config reference.
# ----------------------------------------------------------------------------------------------------------------


class Builder:
    """One builder function of config.py: the descriptions it gives (relative dotted names; `*` patterns), the
    builders whose ConfigDicts it nests (name -> function), and the builder it extends (`c = _common(...)`)."""

    def __init__(self, name: str):
        self.name, self.docs, self.subs, self.base = name, {}, {}, None


def _comments(source: str) -> dict[int, tuple[str, bool]]:
    """Line -> (comment text, whether code precedes it on the line)."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = (tok.string.lstrip("#").strip(), bool(tok.line[:tok.start[1]].strip()))
    return out


def _called(node: ast.AST) -> str | None:
    """The function name a value calls (through `ml_collections.ConfigDict(...)` and lambdas), else None."""
    if isinstance(node, ast.Lambda):
        node = node.body
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "ConfigDict" and node.args:
            return _called(node.args[0])
        if isinstance(f, ast.Name):
            return f.id
    return None


def _attr_path(node: ast.AST) -> str | None:
    """`c.a.b` -> 'a.b'."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join(reversed(parts)) if isinstance(node, ast.Name) and node.id == "c" and parts else None


def _dict_fields(call: ast.Call, prefix: str, builder: Builder, trailing: dict[int, str], functions: set[str]):
    """Keywords of a `dict(...)` literal (nested dicts recursed) with a trailing comment on a line of their own."""
    on_line: dict[int, int] = {}
    for kw in call.keywords:
        on_line[kw.lineno] = on_line.get(kw.lineno, 0) + 1
    for kw in call.keywords:
        if kw.arg is None:
            continue
        name, inner = prefix + kw.arg, kw.value
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Attribute) and inner.func.attr == "ConfigDict":
            inner = inner.args[0]
        if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "dict":
            _dict_fields(inner, name + ".", builder, trailing, functions)
        elif _called(kw.value) in functions:
            builder.subs[name] = _called(kw.value)
        if on_line[kw.lineno] == 1 and kw.lineno in trailing:
            builder.docs[name] = trailing[kw.lineno]


def parse_builders(source: str) -> dict[str, Builder]:
    """Every function of config.py as a `Builder` (see the module docstring for the rules)."""
    tree, comments = ast.parse(source), _comments(source)
    trailing = {line: text for line, (text, after_code) in comments.items() if after_code}
    functions = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    builders = {}
    for fn in (n for n in tree.body if isinstance(n, ast.FunctionDef)):
        b = builders[fn.name] = Builder(fn.name)
        # Comment paragraphs starting '# name: text', continued by the comment lines below them.
        tag, lines = None, sorted(line for line in comments if fn.lineno <= line <= fn.end_lineno)
        for line in lines:
            text, after_code = comments[line]
            m = TAG.match("# " + text) if not after_code else None
            if m:
                tag = m.group(1)
                b.docs[tag] = m.group(2)
            elif tag and not after_code and line - 1 in comments and not comments[line - 1][1]:
                b.docs[tag] += " " + text
            else:
                tag = None
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1:
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id == "c" and _called(node.value) in functions:
                    b.base = _called(node.value)
                path = _attr_path(target)
                if path is None:
                    continue
                if _called(node.value) in functions:
                    b.subs[path] = _called(node.value)
                if node.lineno in trailing:
                    b.docs[path] = (b.docs[path] + " " if path in b.docs else "") + trailing[node.lineno]
            elif isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
                inner = node.value.args[0] if node.value.args else None
                if isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id == "dict":
                    _dict_fields(inner, "", b, trailing, functions)
    return builders


def stage_builders(source: str) -> dict[str, str]:
    """Stage -> the builder `default_config` calls for it."""
    fn = next(n for n in ast.parse(source).body if isinstance(n, ast.FunctionDef) and n.name == "default_config")
    table = next(n.value for n in ast.walk(fn) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Dict))
    return {k.value: (v.id if isinstance(v, ast.Name) else _called(v)) for k, v in zip(table.keys, table.values)}


def describe(builders: dict[str, Builder], fn: str, path: str) -> str | None:
    """A field's description: its own in `fn` (or in the builder `fn` extends), else the nested builder's."""
    while fn is not None:
        b = builders[fn]
        if path in b.docs:
            return b.docs[path]
        parts = path.split(".")
        for i in range(len(parts) - 1, 0, -1):
            head = ".".join(parts[:i])
            if head in b.subs:
                found = describe(builders, b.subs[head], ".".join(parts[i:]))
                if found:
                    return found
        for pattern, text in b.docs.items():
            if "*" in pattern and pattern.count(".") == path.count(".") and fnmatch.fnmatchcase(path, pattern):
                return text
        fn = b.base
    return None


def flatten(c: ml_collections.ConfigDict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in c.items():
        if isinstance(v, ml_collections.ConfigDict):
            out.update(flatten(v, f"{prefix}{k}."))
        else:
            out[prefix + k] = v
    return out


def allowed_values(stage: str) -> dict[str, str]:
    """What `config.validate` checks on the stage's defaults, per field (recorded while it runs)."""
    seen: dict[str, str] = {}
    originals = {n: getattr(config_lib, n) for n in ("_check_choice", "_check_range", "_check_int")}

    def choice(c, field, choices):
        seen[field] = ", ".join(f"`{v!r}`" for v in tuple(choices))
        return originals["_check_choice"](c, field, choices)

    def rng(c, field, lo, hi, *, lo_open=False, hi_open=False):
        seen[field] = f"{'(' if lo_open else '['}{lo}, {hi}{')' if hi_open else ']'}"
        return originals["_check_range"](c, field, lo, hi, lo_open=lo_open, hi_open=hi_open)

    def integer(c, field, lo, hi=None):
        seen[field] = f"integer >= {lo}" + (f", <= {hi}" if hi is not None else "")
        return originals["_check_int"](c, field, lo, hi)

    try:
        config_lib._check_choice, config_lib._check_range, config_lib._check_int = choice, rng, integer
        config_lib.validate(config_lib.default_config(stage))
    finally:
        for n, f in originals.items():
            setattr(config_lib, n, f)
    return seen


def config_rows() -> list[dict[str, Any]]:
    """One row per field and stage: stage, name, default, description (None when missing), allowed values."""
    source = pathlib.Path(config_lib.__file__).read_text()
    builders, roots = parse_builders(source), stage_builders(source)
    rows = []
    for stage in config_lib.STAGES:
        allowed = allowed_values(stage)
        for name, value in flatten(config_lib.default_config(stage)).items():
            if name not in allowed and isinstance(value, bool):
                allowed[name] = "`True`, `False`"
            rows.append(dict(stage=stage, name=name, default=value, description=describe(builders, roots[stage], name),
                             allowed=allowed.get(name, "")))
    return rows


def orphan_tags(source: str | None = None) -> list[str]:
    """Descriptions in config.py that name no field of any stage's default config (a renamed field's leftover)."""
    source = source if source is not None else pathlib.Path(config_lib.__file__).read_text()
    builders, roots = parse_builders(source), stage_builders(source)
    tags, matched = set(), set()

    def walk(fn: str, prefix: str, fields: set[str]) -> None:
        b = builders[fn]
        for path in b.docs:
            full = prefix + path
            tags.add((fn, path))
            if any(fnmatch.fnmatchcase(f, full) and f.count(".") == full.count(".") for f in fields):
                matched.add((fn, path))
        for head, sub in b.subs.items():
            walk(sub, f"{prefix}{head}.", fields)
        if b.base:
            walk(b.base, prefix, fields)

    for stage in config_lib.STAGES:
        walk(roots[stage], "", set(flatten(config_lib.default_config(stage))))
    return sorted(f"{fn}: {path}" for fn, path in tags - matched)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _prompt_text(text: str) -> str:
    """Prompt text as one table cell: a code span, newlines shown as \\n."""
    return "`" + _cell(text.replace("\n", "\\n")) + "`"


def config_markdown() -> str:
    rows = config_rows()
    merged: dict[tuple, dict] = {}  # one row per (field, description, allowed values), its stages and defaults
    for r in rows:
        key = (r["name"], r["description"], r["allowed"])
        merged.setdefault(key, {"stages": [], "defaults": {}})
        merged[key]["stages"].append(r["stage"])
        merged[key]["defaults"][r["stage"]] = r["default"]
    sections: dict[tuple, list] = {}
    for (name, desc, allowed), m in merged.items():
        sections.setdefault(tuple(m["stages"]), []).append((name, desc, allowed, m["defaults"]))
    order = sorted(sections, key=lambda s: (-len(s), [config_lib.STAGES.index(x) for x in s]))
    lines = ["# Config reference", "",
             "Generated by `python experiments/make_docs.py` from `vcppo_jax/config.py` (do not edit by hand): every "
             "field of every stage's default config, `config.default_config(stage)`. Set any of them on the command "
             "line (`--config.sampling.temperature=1.0`) or in a `configs/<experiment>.py` file. Defaults are the "
             "builders' (a config file may change them: `configs/grpo.py` sets `advantage='group'`, ...); allowed "
             "values are what `config.validate` checks on the defaults (a bound may depend on another field, e.g. "
             "`overlong_buffer <= task.max_response_len`). Stages: " +
             ", ".join(f"`{s}`" for s in config_lib.STAGES) + " (`rl` here is VC-PPO's defaults).", ""]
    for stages in order:
        title = "Every stage" if len(stages) == len(config_lib.STAGES) else ", ".join(f"`{s}`" for s in stages)
        lines += [f"## {title}", "", "| field | default | meaning | allowed values |", "|---|---|---|---|"]
        for name, desc, allowed, defaults in sections[stages]:
            by_value: dict[str, list[str]] = {}
            for stage, v in defaults.items():
                by_value.setdefault(repr(v), []).append(stage)
            default = (f"`{next(iter(by_value))}`" if len(by_value) == 1 else
                       "; ".join(f"{', '.join(s)}: `{v}`" for v, s in by_value.items()))
            lines.append(f"| `{name}` | {_cell(default)} | {_cell(desc or '(no description)')} | {allowed} |")
        lines.append("")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------------------
# Results tables.
# ----------------------------------------------------------------------------------------------------------------


def _load(rel: str) -> Any:
    return json.loads((RESULTS / rel).read_text())


def provenance_line(block: dict | None) -> str:
    block = block or {}
    cells = [f"command: `{block.get('command', 'unknown')}`"] + [f"{k}: {block.get(k, 'unknown')}"
                                                                 for k in PROVENANCE_KEYS[1:]]
    note = f" ({block['note']})" if block.get("note") else ""
    return "*Produced by " + " · ".join(cells) + note + ".*"


def numbered_provenance(entries: list[dict]) -> list[str]:
    """One numbered provenance line per result entry (a table whose rows come from several runs)."""
    return [f"{i}. {provenance_line(e.get('provenance'))}" for i, e in enumerate(entries, 1)]


def _demote(markdown: str) -> str:
    """A study's .md as a region: its title dropped, its sub-headings bold."""
    lines = markdown.strip("\n").split("\n")[1:]
    return "\n".join(f"**{ln.lstrip('#').strip()}**" if ln.startswith("#") else ln for ln in lines).strip("\n")


def study_region(rel: str, markdown: Callable[[dict], str]) -> Callable[[], str]:
    """A study's table (`rel` under results/) rendered by its report's `markdown`, with its provenance line."""
    def render() -> str:
        table = _load(rel)
        return _demote(markdown(table)) + "\n\n" + provenance_line(table.get("provenance"))
    return render


def real_model_region() -> str:
    entries = _load("real_model/calibration.json")
    lines = ["| starting policy | task | knobs | prompt template | system turn | temperature | problems "
             "| sampled pass@1 (%) | `\\boxed{}` (%) | ended before the cap (%) | mean length | max new tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        knobs = ", ".join(f"{k}={v}" for k, v in e["knobs"].items() if k != "template")
        template = _prompt_text(e["knobs"].get("template", math_tasks.DEFAULT_TEMPLATE).replace("{{}}", "{}"))
        # Entries from before the field was recorded ran without a system prompt.
        system = _prompt_text(e["system_prompt"]) if e.get("system_prompt") else "the chat template's default"
        lines.append(f"| `{e['policy']}` | {e['task']} | {knobs} | {template} | {system} | {e['temperature']} "
                     f"| {e['num']} "
                     f"| {100 * e['pass@1']:.1f} | {100 * e['boxed_fraction']:.1f} | {100 * e['ended_fraction']:.1f} "
                     f"| {e['response_length_mean']:.1f} | {e['max_response_len']} |")
    return "\n".join(lines + [""] + numbered_provenance(entries))


def gradient_noise_region() -> str:
    results = [json.loads(f.read_text()) for f in sorted((RESULTS / "real_model").glob("gradient_noise*.json"))]
    return "\n".join([gradient_noise.markdown(results), ""] + numbered_provenance(results))


def rollout_region() -> str:
    bench = _load("rollout/bench.json")
    s = bench["setup"]
    lines = [f"{s['model']}, {s['batch']} rows, prompt {s['prompt_len']} + at most {s['max_new_tokens']} new tokens, "
             f"temperature {s['temperature']}, median of {s['repeats']} round-robin calls, {s['threads']} thread "
             f"(jax {s['jax']}, torch {s['torch']}, transformers {s['transformers']}).", "",
             "| workload | lengths (mean, min-max) | implementation | tokens/s | vs dense | decode row-steps live "
             "| tokens equal dense's |", "|---|---|---|---|---|---|---|"]
    for name, w in bench["workloads"].items():
        ln = w["lengths"]
        for mode, m in w["modes"].items():
            live = f"{100 * m['live_fraction']:.0f}%" if "live_fraction" in m else ""
            lines.append(f"| {name} | {ln['mean']}, {ln['min']}-{ln['max']} | {mode} | {m['tokens_per_s']:.0f} "
                         f"| {m['speedup_vs_dense']:.2f}x | {live} | {100 * m['tokens_match']:.0f}% |")
    return "\n".join(lines + ["", provenance_line(bench.get("provenance"))])


def tpu_plans_region() -> str:
    plans = {p["plan"]: p for p in (json.loads(f.read_text()) for f in sorted((RESULTS / "tpu_plans").glob("*.json")))}
    ordered = [plans[name] for name in tpu_plans.PLANS if name in plans]
    commands = [f"- {p['plan']} {r['stage']}{' (fallback)' if r is not s else ''}: `{r['command']}` "
                f"({r['compile_seconds']:.0f} s)" for p in ordered for s in p["stages"]
                for r in [s] + ([s["fits_with"]] if "fits_with" in s else [])]
    provenances = {json.dumps(p.get("provenance"), sort_keys=True) for p in ordered}
    return "\n".join([tpu_plans.table(ordered), "", "Each stage's command (compile wall time):", ""] + commands +
                     [""] + [provenance_line(json.loads(p)) for p in sorted(provenances)])


def transcribed_region(rel: str) -> Callable[[], str]:
    """A table kept as JSON columns and rows of text (numbers transcribed from an earlier report; see provenance)."""
    def render() -> str:
        t = _load(rel)
        lines = ["| " + " | ".join(t["columns"]) + " |", "|" + "---|" * len(t["columns"])]
        lines += ["| " + " | ".join(_cell(str(c)) for c in row) + " |" for row in t["rows"]]
        return "\n".join(lines + ["", provenance_line(t.get("provenance"))])
    return render


DOCUMENTS: dict[str, dict[str, Callable[[], str]]] = {
    "experiments/STUDIES.md": {
        "learning": study_region("learning.json", plot_results.learning_markdown),
        "mechanism": study_region("mechanism.json", plot_results.mechanism_markdown),
        "mechanism_long": study_region("mechanism_long/mechanism.json", plot_results.mechanism_markdown),
        "mechanism_long_check": study_region("mechanism_long_check/mechanism.json",
                                             plot_results.mechanism_markdown),
        "real_model": real_model_region,
        "real_model_runs": study_region("real_model/real_model.json", real_model_report.report_markdown),
        "gradient_noise": gradient_noise_region,
    },
    "experiments/BENCHMARKS.md": {
        "rollout": rollout_region,
        "rl_step": transcribed_region("bench/rl_step.json"),
        "rl_step_attention": transcribed_region("bench/rl_step_attention.json"),
        "attention_memory": transcribed_region("bench/attention_memory.json"),
        "tpu_plans": tpu_plans_region,
    },
}
REGION = re.compile(r"(<!-- BEGIN GENERATED: (\S+) -->\n)(.*?)(<!-- END GENERATED: \2 -->)", re.S)


def render_document(text: str, regions: dict[str, Callable[[], str]], path: str) -> str:
    """`text` with every generated region rewritten; every region of `regions` must be in it, and only those."""
    found = [m.group(2) for m in REGION.finditer(text)]
    if sorted(found) != sorted(regions):
        raise ValueError(f"{path}: generated regions {sorted(found)}, expected {sorted(regions)}")
    return REGION.sub(lambda m: m.group(1) + regions[m.group(2)]().rstrip("\n") + "\n" + m.group(4), text)


def generated() -> dict[pathlib.Path, str]:
    """Every generated document's expected text."""
    out = {CONFIG_MD: config_markdown()}
    for rel, regions in DOCUMENTS.items():
        path = ROOT / rel
        out[path] = render_document(path.read_text(), regions, rel)
    return out


def stale() -> list[str]:
    """The documents whose text differs from what this script generates."""
    return [str(p.relative_to(ROOT) if p.is_relative_to(ROOT) else p) for p, text in generated().items()
            if not p.exists() or p.read_text() != text]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="exit 1 if a document differs from what this generates")
    args = p.parse_args(argv)
    missing = [r["stage"] + ": " + r["name"] for r in config_rows() if not r["description"]]
    if missing:
        print("config fields without a description in vcppo_jax/config.py:\n  " + "\n  ".join(missing))
        return 1
    if args.check:
        bad = stale()
        for path in bad:
            print(f"{path} is stale: run python experiments/make_docs.py")
        return 1 if bad else 0
    for path, text in generated().items():
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
            print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
