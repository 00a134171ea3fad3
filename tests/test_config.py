"""The experiment config: defaults resolve, and every kind of bad input names its key."""

from pathlib import Path

import pytest

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
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "missing.yaml")


def test_overrides_and_round_trip(tmp_path: Path):
    cfg = load_config(None, {"train.rounds": 3, "method.lora.r": 4})
    assert cfg.train.rounds == 3 and cfg.method.lora.r == 4
    path = tmp_path / "resolved.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(path) == cfg


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
