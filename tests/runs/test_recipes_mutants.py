"""Recipes and overrides (runs/recipes.py): ``--set a.b=value`` parsing (YAML-typed, floats written 1e-4 included),
finding a recipe by path or shipped name, the one-line errors of a malformed, repeated-key, empty or non-mapping
recipe, input paths relative to the recipe's folder, the source each value is recorded under, a run directory's
saved config, text fields taken as written, ``--run-dir`` and the refusal of a key given twice, the YAML written back
with its source comments, and ``--help-config``'s lines."""

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

import diffcurr_fast
from diffcurr_fast.models import registry as model_registry
from diffcurr_fast.options import Options, option
from diffcurr_fast.runs import recipes
from diffcurr_fast.runs.recipes import (
    DEMO_RECIPE,
    apply_overrides,
    config_to_yaml,
    describe_config,
    duplicate_keys,
    find_recipe,
    list_recipes,
    load_config,
    load_run_config,
    parse_override,
    read_recipe,
    recipes_dir,
    run_dir_overrides,
)


def _demo_lr() -> float:
    return float(yaml.safe_load((recipes_dir() / DEMO_RECIPE).read_text())["optim"]["lr"])


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# ---- parse_override ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, key, value",
    [
        (" optim.lr = 1e-4", "optim.lr", 1e-4),  # the key is stripped; YAML 1.1's string 1e-4 is a float
        ("optim.lr=2E5", "optim.lr", 2e5),
        ("a.b=x=y", "a.b", "x=y"),  # split at the first "="
        ("a.b=", "a.b", ""),
        ("a.b=   ", "a.b", ""),
        ("a.b=12", "a.b", 12),
        ("a.b=inf", "a.b", "inf"),  # a float() text with neither e nor . stays a text
        ("a.b=[1, 2]", "a.b", [1, 2]),
        ("a.b=null", "a.b", None),
    ],
)
def test_an_override_is_split_at_the_first_equals_and_typed_as_yaml(text, key, value):
    """``a.b=value``: the key stripped, the value read as YAML, a text float() reads with an e or a . a float."""
    got = parse_override(text)
    assert got == (key, value) and type(got[1]) is type(value)


def test_an_override_without_equals_or_with_bad_yaml_is_one_line():
    """No "=": the expected form and the text; unparsable YAML: the override and the parser's reason, no chain."""
    with pytest.raises(ValueError) as e:
        parse_override("optim.lr")
    assert str(e.value) == "an override looks like section.field=value, got 'optim.lr'"
    with pytest.raises(ValueError) as e:
        parse_override("a.b=[1")
    assert str(e.value).startswith("cannot parse the value of override 'a.b=[1': ")
    assert len(str(e.value)) > len("cannot parse the value of override 'a.b=[1': ")
    assert e.value.__cause__ is None and e.value.__suppress_context__


# ---- finding and reading a recipe ----------------------------------------------------------------------------------


def test_the_shipped_recipes_are_the_packages_yaml_files_sorted():
    """``recipes_dir`` is the package's ``recipes`` folder; ``list_recipes`` its YAML files by name; none without it."""
    d = Path(diffcurr_fast.__file__).resolve().parent / "recipes"
    assert recipes_dir() == d
    assert list_recipes() == sorted(d.glob("*.yaml")) and d / DEMO_RECIPE in list_recipes()


def test_no_recipes_folder_lists_none(monkeypatch, tmp_path):
    monkeypatch.setattr(recipes, "recipes_dir", lambda: tmp_path / "absent")
    assert list_recipes() == []


def test_a_recipe_is_a_file_else_a_shipped_name(monkeypatch, tmp_path):
    """A path to a file is itself; a bare name, with or without .yaml, is the shipped recipe of that name."""
    monkeypatch.chdir(tmp_path)
    own = _write(tmp_path / "mine.yaml", "optim:\n  lr: 0.5\n")
    assert find_recipe(own) == own and find_recipe("mine.yaml") == Path("mine.yaml")
    assert find_recipe("demo") == recipes_dir() / "demo.yaml"
    assert find_recipe("demo.yaml") == recipes_dir() / "demo.yaml"
    assert find_recipe(Path("demo")) == recipes_dir() / "demo.yaml"


def test_a_shipped_name_ending_yml_is_taken_as_is(monkeypatch, tmp_path):
    """In the recipes folder, ``a.yml`` is found by that name; a bare ``a`` looks for ``a.yaml`` only."""
    shipped = tmp_path / "shipped"
    _write(shipped / "a.yml", "optim:\n  lr: 0.5\n")
    _write(shipped / "b.yaml", "optim:\n  lr: 0.5\n")
    monkeypatch.setattr(recipes, "recipes_dir", lambda: shipped)
    monkeypatch.chdir(tmp_path)
    assert find_recipe("a.yml") == shipped / "a.yml" and find_recipe("b") == shipped / "b.yaml"
    with pytest.raises(FileNotFoundError, match=r"no shipped recipe of that name: b\)$"):
        find_recipe("a")


@pytest.mark.parametrize("name", ["nope", "sub/demo", "demo.yml", "sub/demo.yaml"])
def test_an_unknown_recipe_names_itself_and_the_shipped_ones(name, monkeypatch, tmp_path):
    """Neither a file nor a bare shipped name (a folder in front, or .yml): FileNotFoundError listing the stems."""
    monkeypatch.chdir(tmp_path)
    stems = ", ".join(p.stem for p in sorted(recipes_dir().glob("*.yaml")))
    with pytest.raises(FileNotFoundError) as e:
        find_recipe(name)
    assert str(e.value) == (
        f"recipe {name!r} does not exist (no such file, and no shipped recipe of that name: {stems})"
    )


def test_keys_set_twice_are_listed_with_their_lines_at_any_depth():
    """A mapping's repeated key, its 1-based lines, at every depth and inside lists; the outer level first."""
    text = "a:\n  b: 1\n  b: 2\n  c: 1\nc: 1\nc: 2\nl:\n  - x: 1\n    x: 2\n  - y: 1\n"
    assert duplicate_keys(yaml.compose(text, Loader=yaml.SafeLoader)) == [
        ("c", [5, 6]),
        ("a.b", [2, 3]),
        ("l.0.x", [8, 9]),
    ]
    nested = "a:\n  b:\n    c: 1\n    c: 2\n  b2: 1\n  b2: 3\n"
    assert duplicate_keys(yaml.compose(nested, Loader=yaml.SafeLoader)) == [("a.b2", [5, 6]), ("a.b.c", [3, 4])]
    assert duplicate_keys(yaml.compose("a: 1\nb: [1, 1]\n", Loader=yaml.SafeLoader)) == []
    assert duplicate_keys(None) == []


def test_a_recipe_setting_a_key_twice_is_one_line_naming_the_keys_and_lines(tmp_path):
    p = _write(tmp_path / "r.yaml", "optim:\n  lr: 1\n  lr: 2\ndata:\n  batch_size: 2\n  batch_size: 4\n")
    with pytest.raises(ValueError) as e:
        read_recipe(p)
    assert str(e.value) == (
        f"recipe {str(p)!r} sets a key more than once (only one would count): 'optim.lr' at lines 2, 3; "
        "'data.batch_size' at lines 5, 6; keep one"
    )


def test_malformed_yaml_is_one_line_with_the_line_and_column(tmp_path):
    """The parser's problem at its 1-based line and column, without the exception chain."""
    p = _write(tmp_path / "r.yaml", "optim:\n  lr: [1, 2\n")
    with pytest.raises(ValueError) as e:
        read_recipe(p)
    mark = None
    try:
        yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark, problem = exc.problem_mark, exc.problem
    assert mark is not None
    assert str(e.value) == (
        f"recipe {str(p)!r} is not valid YAML at line {mark.line + 1}, column {mark.column + 1}: {problem}"
    )
    assert e.value.__cause__ is None and e.value.__suppress_context__


def test_an_unreadable_character_is_one_line_naming_the_error_without_a_position(tmp_path):
    """A reader error has no line or problem: the message names the error's type."""
    p = _write(tmp_path / "r.yaml", "optim:\n  lr: \x01\n")
    with pytest.raises(ValueError) as e:
        read_recipe(p)
    assert str(e.value) == f"recipe {str(p)!r} is not valid YAML: ReaderError"


@pytest.mark.parametrize("text", ["", "# nothing\n", "{}\n", "null\n"])
def test_an_empty_recipe_says_so_and_points_to_the_demo(text, tmp_path):
    p = _write(tmp_path / "r.yaml", text)
    with pytest.raises(ValueError) as e:
        read_recipe(p)
    assert str(e.value) == (
        f"recipe {str(p)!r} is empty; give its sections (see `diffcurr-fast train --help-config`), "
        "or run without a recipe for the embedded demo"
    )


@pytest.mark.parametrize("text, kind", [("- 1\n- 2\n", "list"), ("3\n", "int"), ("text\n", "str")])
def test_a_recipe_that_is_not_a_mapping_names_what_it_is(text, kind, tmp_path):
    p = _write(tmp_path / "r.yaml", text)
    with pytest.raises(ValueError) as e:
        read_recipe(p)
    assert str(e.value) == f"recipe {str(p)!r} must be a mapping of sections, got {kind}"


def test_a_recipes_input_paths_are_relative_to_its_folder_and_floats_are_read(tmp_path):
    """Each of data.path, engine.deepspeed_config, model.init_from, terms.repa_encoder: relative -> under the recipe's
    folder; absolute and empty kept; other keys untouched; 1e-4 at any depth is a float."""
    p = _write(
        tmp_path / "sub" / "r.yaml",
        "data:\n  path: imgs\n  dataset: rel\nengine:\n  deepspeed_config: ds.json\nmodel:\n  init_from: /abs/w.pt\n"
        "terms:\n  repa_encoder: enc\noptim:\n  lr: 1e-4\n  betas: [1e-3, 2]\ncheckpoint:\n  run_dir: out\n",
    )
    data = read_recipe(p)
    folder = tmp_path / "sub"
    assert data["data"] == {"path": str(folder / "imgs"), "dataset": "rel"}
    assert data["engine"]["deepspeed_config"] == str(folder / "ds.json")
    assert data["model"]["init_from"] == "/abs/w.pt"
    assert data["terms"]["repa_encoder"] == str(folder / "enc")
    assert data["optim"] == {"lr": 1e-4, "betas": [1e-3, 2]} and isinstance(data["optim"]["lr"], float)
    assert data["checkpoint"]["run_dir"] == "out"
    empty = read_recipe(_write(tmp_path / "e.yaml", "data:\n  path: ''\nmodel: 3\n"))
    assert empty == {"data": {"path": ""}, "model": 3}


def test_a_recipe_records_its_values_under_its_name_and_the_demo_under_demo(tmp_path):
    """``load_config(path)`` labels the recipe's values "recipe NAME"; without a path the demo's are "demo"; the
    overrides come after, as "--set"."""
    p = _write(tmp_path / "sub" / "mine.yaml", "optim:\n  lr: 0.5\n")
    cfg = load_config(p, ["data.batch_size=8"])
    assert cfg.optim.lr == 0.5 and cfg.data.batch_size == 8
    assert cfg.sources()["optim.lr"] == "recipe mine.yaml" and cfg.sources()["data.batch_size"] == "--set"
    demo = load_config(None)
    assert demo.optim.lr == _demo_lr() and demo.sources()["optim.lr"] == "demo"
    assert load_config("demo").sources()["optim.lr"] == "recipe demo"


# ---- a run directory's config.yaml ---------------------------------------------------------------------------------


def test_a_saved_config_loads_under_its_folders_name_with_overrides_on_top(tmp_path):
    cfg = load_config(None, ["data.batch_size=8"])
    saved = _write(tmp_path / "run7" / "config.yaml", config_to_yaml(cfg).replace("lr: 0.", "lr: 0.") + "")
    back = load_run_config(saved, ["optim.lr=0.25"])
    assert back.to_dict() == {**cfg.to_dict(), "optim": {**cfg.to_dict()["optim"], "lr": 0.25}}
    assert back.sources()["data.batch_size"] == "run7/config.yaml" and back.sources()["optim.lr"] == "--set"
    assert load_run_config(str(saved)).to_dict() == cfg.to_dict()


def test_a_saved_config_reads_floats_written_as_text(tmp_path):
    cfg = load_config(None)
    d = cfg.to_dict()
    d["optim"]["lr"] = "1e-4"
    back = load_run_config(_write(tmp_path / "r" / "config.yaml", yaml.safe_dump(d)))
    assert back.optim.lr == 1e-4


def test_a_saved_config_that_is_not_yaml_or_not_a_mapping_is_one_line(tmp_path):
    bad = _write(tmp_path / "r" / "config.yaml", "optim:\n  lr: [1\n")
    with pytest.raises(ValueError) as e:
        load_run_config(bad)
    try:
        yaml.safe_load(bad.read_text())
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0]
    assert str(e.value) == f"{str(bad)!r} is not valid YAML ({first})"
    assert e.value.__cause__ is None and e.value.__suppress_context__
    for text in ("- 1\n", ""):
        lst = _write(tmp_path / "r" / "config.yaml", text)
        with pytest.raises(ValueError) as e:
            load_run_config(lst)
        assert str(e.value) == f"{str(lst)!r} holds no config (a mapping of sections)"


def test_a_saved_config_is_a_record_whose_unused_options_are_not_refused(tmp_path):
    """A config.yaml holds every key, the options of components the run does not use included."""
    d = load_config(None).to_dict()
    d["terms"]["dispersive_weight"] = 0.75  # dispersive is not in terms.use
    back = load_run_config(_write(tmp_path / "r" / "config.yaml", yaml.safe_dump(d, sort_keys=False)))
    assert back.terms.use == [] and back.terms.dispersive_weight == 0.75


# ---- overrides -----------------------------------------------------------------------------------------------------


def test_overrides_apply_in_order_as_one_source_and_are_validated():
    cfg = load_config(None)
    out = apply_overrides(cfg, ["optim.lr=0.5", "data.batch_size=8", "optim.lr=0.25"])
    assert out is cfg and (cfg.optim.lr, cfg.data.batch_size) == (0.25, 8)
    assert cfg.sources()["optim.lr"] == "--set"
    assert apply_overrides(load_config(None), None).optim.lr == _demo_lr()
    with pytest.raises(ValueError):
        apply_overrides(load_config(None), ["optim.lr=-1"])


@pytest.mark.parametrize(
    "raw, want",
    [
        ("2024", "2024"),
        ("on", "on"),
        (" a b ", "a b"),
        ("null", "null"),
        ("'x y'", "x y"),
        ("a=b=c", "a=b=c"),
        ("X #c X", "X #c X"),
    ],
)
def test_a_text_field_takes_the_override_as_written(raw, want):
    """A ``str`` field: the text stripped, not YAML's int, bool or null; a quoted text is YAML's string."""
    assert load_config(None, [f"checkpoint.run_dir={raw}"]).checkpoint.run_dir == want


def test_an_empty_quoted_text_is_the_empty_text_and_a_quote_then_a_comment_is_as_written():
    """``''`` is YAML's empty string; ``'a' # c`` does not end with its opening quote, so it is the text as written."""
    assert load_config(None, ["data.path=''"]).data.path == ""
    assert load_config(None, ["checkpoint.run_dir='a' # c"]).checkpoint.run_dir == "'a' # c"


@dataclass
class NoteOptions(Options):
    """note_on: a test's model option with an optional text."""

    SWITCH = "note_on"
    note_on: bool = option(False, "note: on or off")
    note_text: str | None = option(None, "note: an optional text")
    note_plain: int = 0  # a field without a doc

    def active(self) -> bool:
        return self.note_on


@pytest.mark.parametrize(
    "raw, want", [("2024", "2024"), ("on", "on"), ("null", None), ("~", None), (" 'null' ", "null"), ("x~", "x~")]
)
def test_an_optional_text_field_takes_the_text_but_null_clears_it(raw, want, monkeypatch):
    """A ``str | None`` field: the text as written, except ``null`` and ``~`` (unquoted), which clear it."""
    monkeypatch.setitem(model_registry.OPTIONS, "note", f"{__name__}:NoteOptions")
    cfg = load_config(None, ["model.note_on=true", f"model.note_text={raw}"])
    assert cfg.model.note_text == want


def test_a_number_field_takes_yamls_reading():
    assert load_config(None, ["data.batch_size=8"]).data.batch_size == 8
    assert load_config(None, ["model.fused_adaln=off"]).model.fused_adaln is False


def test_run_dir_is_a_checkpoint_run_dir_override_after_the_others():
    assert run_dir_overrides(["a.b=1"], "out") == ["a.b=1", "checkpoint.run_dir=out"]
    assert run_dir_overrides(["checkpoint.run_dir= out "], "out") == [
        "checkpoint.run_dir= out ",
        "checkpoint.run_dir=out",
    ]
    given = ["a.b=1"]
    got = run_dir_overrides(given, None)
    assert got == ["a.b=1"] and got is not given


def test_a_key_given_twice_is_refused_naming_both():
    with pytest.raises(ValueError) as e:
        run_dir_overrides(["optim.lr=1", "data.x=2", " optim.lr =3"], None)
    assert str(e.value) == (
        "--set 'optim.lr=1' and --set ' optim.lr =3' set optim.lr twice (only one would count); keep one"
    )
    assert run_dir_overrides(["optim.lr=1", "optim.lr2=1"], None) == ["optim.lr=1", "optim.lr2=1"]
    with pytest.raises(ValueError, match=r"set checkpoint.run_dir twice"):  # the key ends at the first "="
        run_dir_overrides(["checkpoint.run_dir=a=b", "checkpoint.run_dir=c"], None)


@pytest.mark.parametrize("run_dir", ["", "  "])
def test_an_empty_run_dir_is_refused(run_dir):
    with pytest.raises(ValueError) as e:
        run_dir_overrides([], run_dir)
    assert str(e.value) == "--run-dir is empty (an unset shell variable?); give the run's directory"


def test_a_run_dir_and_a_set_run_dir_naming_two_folders_are_refused():
    with pytest.raises(ValueError) as e:
        run_dir_overrides(["a.b=1", " checkpoint.run_dir =other"], "out")
    assert str(e.value) == "--run-dir 'out' and --set ' checkpoint.run_dir =other' name two folders; give one of them"
    with pytest.raises(ValueError, match=r"name two folders"):  # the key ends at the first "="
        run_dir_overrides(["checkpoint.run_dir=x=y"], "z")
    assert run_dir_overrides(["checkpoint.run_dir=x=y"], "x=y")[-1] == "checkpoint.run_dir=x=y"


# ---- the YAML written back and --help-config -----------------------------------------------------------------------


def test_the_written_yaml_comments_each_set_field_with_its_source_only(tmp_path):
    """Top-level keys of a section carry "  # source" when a source set them; defaults, list items and the section
    lines carry none; the YAML reads back to the same config."""
    cfg = load_config(None, ["terms.use=[contrastive]", "checkpoint.run_dir=out"])
    text = config_to_yaml(cfg)
    lines = text.splitlines()
    assert text.endswith("\n") and not text.endswith("\n\n")
    assert f"  lr: {_demo_lr()}  # demo" in lines
    assert "  run_dir: out  # --set" in lines
    assert "  use:  # --set" in lines and "  - contrastive" in lines
    assert "  weight_decay: 0.0" in lines and "model:" in lines and "optim:" in lines
    assert "  dataset: digits  # demo" in lines
    assert yaml.safe_load(text) == cfg.to_dict()
    sections = [ln for ln in lines if ln and not ln.startswith(" ")]
    assert sections == [f"{s}:" for s in cfg.to_dict()]


def test_the_written_yaml_keeps_long_values_on_one_line_and_a_colon_in_a_value(tmp_path):
    """A value longer than a line stays on its key's line (no wrapping at spaces); the key is the text before the
    first colon."""
    long = " ".join(["word"] * 40)
    text = config_to_yaml(load_config(None, [f"checkpoint.run_dir={long}"]))
    assert f"  run_dir: {long}  # --set" in text.splitlines()
    text = config_to_yaml(load_config(None, ["checkpoint.run_dir=a:b"]))
    assert "  run_dir: a:b  # --set" in text.splitlines()


def test_help_config_lists_each_key_with_type_default_doc_and_choices():
    """``section:  # doc``, then ``  key: default!r  # type; doc (one of ...)``, and a component's line before its
    options."""
    from diffcurr_fast.runs.config import SECTION_NAMES, section_type

    lines = describe_config().splitlines()
    assert lines[0] == f"model:  # {section_type('model').__doc__}"
    assert [ln.split(":")[0] for ln in lines if not ln.startswith(" ")] == list(SECTION_NAMES)
    assert "  input_size: 8  # int; spatial size of the (latent) images the model sees" in lines
    assert "  attn_backend: 'auto'  # str; attention backend (one of auto, flash_attn, sdpa, math)" in lines
    assert "  patch_size: None  # int | None; patch size (a preset fills it; custom default 2)" in lines
    i = lines.index(
        "  # dtr: The switch ``model.dtr``: Denoising Task Routing with the paper's beta and alpha (``DTRConfig``)."
    )
    assert lines[i + 1].startswith("  dtr: False  # bool; ")
    routing = [ln for ln in lines if ln.startswith("  # routing: ")]
    assert len(routing) == 1
    assert not any(ln.startswith("  # None") for ln in lines)


# ---- model.init_from a diffusers export ----------------------------------------------------------------------------

DIMS = dict(input_size=8, in_channels=1, num_classes=10, patch_size=2, hidden_size=48, depth=3, num_heads=3)


def _export(tmp_path: Path) -> Path:

    from diffcurr_fast.models.diffusers_dit import diffusers_config

    exp = tmp_path / "export"
    exp.mkdir()
    (exp / "config.json").write_text(json.dumps(diffusers_config({**DIMS, "mlp_ratio": 4.0, "learn_sigma": True})))
    return exp


def test_an_exports_dimensions_replace_an_earlier_sources_and_are_recorded(tmp_path):
    """With init_from a --set, the demo's (earlier) dimensions take the export's; each replaced one is recorded under
    the export's source, with the --set's rank, and is no longer a filled value; one that agrees keeps its source."""
    from diffcurr_fast.options import filled, source_of

    exp = _export(tmp_path)
    cfg = load_config(None, [f"model.init_from={exp}", "model.input_size=8"])
    assert {k: getattr(cfg.model, k) for k in DIMS} == DIMS
    by = f"model.init_from {str(exp)!r} (its config.json)"
    rank = source_of(cfg.model, "init_from")[0]
    assert source_of(cfg.model, "depth") == (rank, by) and source_of(cfg.model, "hidden_size") == (rank, by)
    assert source_of(cfg.model, "input_size") == (rank, "--set")
    assert source_of(cfg.model, "in_channels") == source_of(load_config(None).model, "in_channels")  # agrees: kept
    assert not {"depth", "hidden_size", "num_heads"} & filled(cfg.model)


def test_a_recipe_with_init_from_takes_the_exports_dimensions_over_the_custom_defaults(tmp_path):
    """Dimensions the recipe leaves to the custom defaults (filled) take the export's; a later --set of a dimension
    that differs is refused, naming the value, its source, the export and the fix."""
    exp = _export(tmp_path)
    rec = _write(tmp_path / "r.yaml", f"model:\n  init_from: {exp}\n  input_size: 8\n  in_channels: 1\n")
    cfg = load_config(rec)
    assert {k: getattr(cfg.model, k) for k in DIMS} == DIMS
    with pytest.raises(ValueError) as e:
        load_config(rec, ["model.depth=5"])
    assert str(e.value) == (
        f"model.depth=5 (--set) contradicts model.init_from {str(exp)!r}, whose config.json has depth 3; unset it "
        "(model.depth=null) to take the export's value"
    )
    with pytest.raises(ValueError) as e:
        load_config(None, [f"model.init_from={exp}", "model.hidden_size=64"])
    assert str(e.value).startswith("model.hidden_size=64 (--set) contradicts model.init_from ")


def test_without_a_diffusers_export_the_config_is_untouched(tmp_path):
    """No init_from, or a plain weights file: the recipe's dimensions stand."""
    plain = _write(tmp_path / "w.pt", "")
    base = load_config(None)
    assert load_config(None, [f"model.init_from={plain}"]).model.hidden_size == base.model.hidden_size
    assert recipes.take_export_dims(base) is base


def test_help_config_shows_a_field_without_a_doc_with_an_empty_doc(monkeypatch):
    """A component's field declared without ``option`` has no doc: its line ends after the type."""
    monkeypatch.setitem(model_registry.OPTIONS, "note", f"{__name__}:NoteOptions")
    lines = describe_config().splitlines()
    assert "  # note: note_on: a test's model option with an optional text." in lines
    assert "  note_plain: 0  # int; " in lines
