"""The generated documentation: every config field has a description, and the documents equal what
experiments/make_docs.py generates from config.py and the committed JSON."""

import json
import pathlib

import make_docs
from vcppo_jax import config as config_lib


def test_every_config_field_of_every_stage_has_a_description():
    rows = make_docs.config_rows()
    assert {r["stage"] for r in rows} == set(config_lib.STAGES)
    missing = [f"{r['stage']}: {r['name']}" for r in rows if not r["description"]]
    assert not missing, f"config fields without a description beside their default in vcppo_jax/config.py: {missing}"


def test_a_field_without_a_comment_is_reported_and_a_stray_tag_is_an_orphan():
    source = pathlib.Path(config_lib.__file__).read_text()
    assert make_docs.orphan_tags() == []
    # Drop one trailing comment: that field has no description any more.
    line = '        rope_theta=10000.0,  # RoPE base frequency.'
    assert line in source
    builders = make_docs.parse_builders(source.replace(line, '        rope_theta=10000.0,'))
    assert make_docs.describe(builders, "base_rl_config", "model.rope_theta") is None
    assert make_docs.describe(make_docs.parse_builders(source), "base_rl_config", "model.rope_theta")
    # A '# name:' paragraph naming no field (a renamed field's leftover) is an orphan.
    renamed = source.replace("    # top_k: keep only", "    # top_kk: keep only")
    assert make_docs.orphan_tags(renamed) == ["sampling_config: top_kk"]


def test_allowed_values_come_from_the_owning_modules_lists():
    rows = {(r["stage"], r["name"]): r for r in make_docs.config_rows()}
    from vcppo_jax.losses import KL_KINDS
    assert rows[("rl", "kl_estimator")]["allowed"] == ", ".join(f"`{k!r}`" for k in KL_KINDS)
    assert rows[("rl", "critic_init")]["allowed"] == ", ".join(f"`{k!r}`" for k in config_lib.CRITIC_INITS)
    assert rows[("rl", "lambda_actor")]["allowed"] == "[0.0, 1.0]"


def test_generated_documents_are_up_to_date():
    assert make_docs.stale() == [], "run: python experiments/make_docs.py"


def test_check_mode_names_a_stale_document(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(make_docs, "CONFIG_MD", tmp_path / "CONFIG.md")
    (tmp_path / "CONFIG.md").write_text("stale\n")
    assert make_docs.main(["--check"]) == 1
    assert "CONFIG.md is stale" in capsys.readouterr().out


def test_a_written_report_records_where_it_came_from(tmp_path):
    import plot_results  # noqa: PLC0415 (matplotlib, only for this test)

    js, _ = plot_results.write_json_and_markdown({"methods": {}}, "table\n", tmp_path, "study")
    block = json.loads(js.read_text())["provenance"]
    assert set(block) == {"command", "commit", "machine", "date"} and all(block.values())
    kept = {"command": "c", "commit": "x", "machine": "m", "date": "d"}  # a table that says its own provenance
    js, _ = plot_results.write_json_and_markdown({"provenance": kept}, "", tmp_path, "given")
    assert json.loads(js.read_text())["provenance"] == kept
