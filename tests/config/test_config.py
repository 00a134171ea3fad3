"""The experiment config: defaults resolve, and every kind of bad input names its key."""

from pathlib import Path

import pytest
import yaml

from fedpeft.config import ConfigError, dump_config, load_config, parse_config


def test_builtin_default_config_is_the_documented_experiment():
    cfg = load_config(None)
    assert cfg.method.name == "fedlr"
    assert cfg.model.backbone == "bundled-minilm"
    assert cfg.data.source == "wordnet"
    assert cfg.partition.scheme == "dirichlet" and cfg.partition.alpha == 0.5
    assert cfg.partition.num_clients >= 10


def test_the_default_with_another_method_is_named_and_kept_apart():
    cfg = load_config(None, {"method.name": "federa"})
    assert (cfg.name, str(cfg.output_dir)) == ("default-federa", "runs/default-federa")
    cfg = load_config(None, {"method.name": "federa", "name": "mine", "output_dir": "runs/x"})
    assert (cfg.name, str(cfg.output_dir)) == ("mine", "runs/x")
    assert load_config(None, {"method": {"name": "federa"}}).name == "default-federa"
    assert load_config(None, {"method.name": "fedlr"}).name == "default-fedlr"


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ({"trian": {"rounds": 3}}, "trian: unknown key"),
        ({"train": {"rounds": "many"}}, "train.rounds: Input should be a valid integer"),
        ({"train": {"lr": -1}}, "train.lr: Input should be greater than 0"),
        ({"partition": {"alpha": 0}}, "partition.alpha: Input should be greater than 0"),
        ({"partition": {"alpha": -0.3}}, "partition.alpha"),
        ({"partition": {"similarity": 1.5}}, "partition.similarity"),
        (
            {"train": {"clients_per_round": 11}, "partition": {"num_clients": 10}},
            "train.clients_per_round: 11 clients per round but partition.num_clients is 10",
        ),
        ({"data": {"source": "file", "path": "/no/such/file.csv"}}, "data.path: no such file"),
        ({"data": {"source": "file"}}, "data.path is required"),
        ({"data": {"source": "hub"}}, "data.hub_id is required"),
        ({"model": {"backbone": "/no/such/model"}}, "model.backbone: no such directory"),
        ({"method": {"name": "fedlr", "lora": {"r": 0}}}, "method.lora.r"),
        (
            {"method": {"name": "fedap", "adapter": {"bottlenek": 8}}},
            "method.adapter.bottlenek: unknown key",
        ),
        ({"method": {"name": "fedsomething"}}, "method: Input tag 'fedsomething'"),
        ({"partition": {"scheme": "natural"}}, "data.group_column is required"),
    ],
)
def test_invalid_config_fails_naming_the_key(data, fragment):
    with pytest.raises(ConfigError) as err:
        parse_config(data, "exp.yaml")
    assert fragment in str(err.value)
    assert str(err.value).startswith("exp.yaml: ")


def test_yaml_file_errors_name_the_file(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad.yaml:2:1: not valid YAML: "):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_and_round_trip(tmp_path: Path):
    cfg = load_config(None, {"train.rounds": 3, "method.lora.r": 4})
    assert cfg.train.rounds == 3 and cfg.method.lora.r == 4
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


def test_a_dumped_config_read_back_means_the_same(tmp_path: Path):
    """What a silo leaves unset it takes from the top-level data config, and a causal-LM or
    QA file without ``data.label_column`` is one domain: both stay so through a dump
    (``output_dir/config.yaml``, a deployment's experiment, a sweep's variant)."""
    silos = [{"name": "a", "source": "wordnet"}, {"name": "b", "source": "wordnet", "max_length": 32}]
    natural = {"partition": {"scheme": "natural", "num_clients": 2}, "train.clients_per_round": 2}
    cfg = load_config(None, {**natural, "data": {"max_length": 128, "silos": silos}})
    again = parse_config(yaml.safe_load(dump_config(cfg)), "dumped")
    assert [s.resolved(again.data).max_length for s in again.data.silos] == [128, 32]
    (tmp_path / "rows.jsonl").write_text('{"instruction": "say", "output": "so"}\n')
    unnamed = load_config(
        None, {"data": {"task": "causal_lm", "source": "file", "path": str(tmp_path / "rows.jsonl")}}
    )
    assert (
        "label_column"
        not in parse_config(yaml.safe_load(dump_config(unnamed)), "dumped").data.model_fields_set
    )
    named = load_config(None, {"data": {"label_column": "topic"}})
    assert parse_config(yaml.safe_load(dump_config(named)), "dumped").data.label_column == "topic"


def test_the_config_registry_names_the_runtime_registrys_methods_and_classes():
    """fedpeft.config.methods (no torch: what the config is checked by) and the methods
    themselves (fedpeft.methods.REGISTRY) name the same methods, in the same order, with
    the same config classes, each in its method's leaf module."""
    from fedpeft.config.methods import CONFIGS
    from fedpeft.methods import REGISTRY

    assert list(CONFIGS) == list(REGISTRY)
    for name, method in REGISTRY.items():
        assert CONFIGS[name] is method.config_cls, name
        assert method.config_cls.__module__ == f"fedpeft.config.methods.{method.__module__.rsplit('.', 1)[1]}"


def test_importing_the_config_loads_no_method_and_no_torch():
    """The method configs are read from their registry when a config validates, not when
    ``fedpeft.config`` is imported."""
    import json
    import subprocess
    import sys

    code = (
        "import json, sys, fedpeft.config as c\n"
        "loaded = lambda: sorted(m for m in sys.modules if m.startswith('fedpeft.config.methods.'))\n"
        "before = loaded()\n"
        "c.parse_config({'method': {'name': 'hetlora'}})\n"
        "print(json.dumps([before, len(loaded()), 'torch' in sys.modules]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    before, after, torch = json.loads(out)
    assert before == ["fedpeft.config.methods.base", "fedpeft.config.methods.registry"]
    assert after > 30 and not torch  # every method's config module, once validated; never torch


def test_an_unknown_method_is_named_with_the_known_ones():
    with pytest.raises(ConfigError) as err:
        parse_config({"method": {"name": "fedsomething"}}, "exp.yaml")
    assert all(name in str(err.value) for name in ("'fedsomething'", "'fedlr'", "'hetlora'", "'fedsb'"))


@pytest.fixture
def registry_restored():
    """The method config registry as it was, after a test that registers a method."""
    from fedpeft.config.methods import registry

    saved = dict(registry.method_configs())
    yield registry
    registry._registered.clear()
    registry._registered.update(saved)
    registry._options.cache_clear()


def test_a_method_registers_its_config_class_by_decorator(registry_restored):
    from typing import Literal

    from fedpeft.config.methods import MethodConfig, register_method_config

    @register_method_config("mine")
    class MineConfig(MethodConfig):
        name: Literal["mine"] = "mine"
        width: int = 3

    cfg = parse_config({"method": {"name": "mine", "width": 5}})
    assert isinstance(cfg.method, MineConfig) and cfg.method.width == 5
    assert "width: 5" in dump_config(cfg)
    with pytest.raises(ValueError, match="registered already"):
        register_method_config("mine")(type("OtherConfig", (MineConfig,), {}))
    with pytest.raises(TypeError, match="'other'"):
        register_method_config("other")(MineConfig)


def test_a_method_options_dump_and_schema_as_their_class():
    from fedpeft.config import ExperimentConfig
    from fedpeft.config.methods import CONFIGS

    cfg = parse_config({"method": {"name": "hetlora", "ranks": [2, 4]}})
    assert cfg.model_dump(exclude_defaults=True)["method"] == {"ranks": [2, 4]}
    assert cfg.model_dump()["method"]["r_min"] == 2  # the class's own options, not only MethodConfig's
    cfg.method = {"name": "fedap"}  # validated on assignment too
    assert type(cfg.method) is CONFIGS["fedap"]
    schema = ExperimentConfig.model_json_schema()["properties"]["method"]
    assert len(schema["oneOf"]) == len(CONFIGS) and schema["discriminator"]["propertyName"] == "name"


def test_the_default_group_column_has_one_home():
    """data.group_column, else WordNet's part of speech (not for its QA set), else none."""
    from fedpeft.config import DataConfig

    assert DataConfig().group_by == "pos"
    assert DataConfig(group_column="lexname").group_by == "lexname"
    assert DataConfig(task="extractive_qa").group_by is None
    assert DataConfig(source="hub", hub_id="x").group_by is None
    assert parse_config({"partition": {"scheme": "groups"}}).data.group_by == "pos"
    with pytest.raises(ConfigError, match="data.group_column is required"):
        parse_config({"partition": {"scheme": "groups"}, "data": {"task": "extractive_qa"}})
