"""The experiment config: one typed, validated YAML document.

Everything an experiment needs (data, partition, model, method, training schedule,
evaluation, output) is declared with pydantic, one leaf module per section (``data``,
``model``, ``train``, ``server``, ``comm``, ``privacy``, ``evaluation``, ``deploy``,
``output``), put together in :mod:`~fedpeft.config.experiment` and read and written by
:mod:`~fedpeft.config.io`, its secrets (credentials in a URI, a token) redacted by
:mod:`~fedpeft.config.secrets`. Unknown keys, wrong types and impossible values fail *before*
any training, with an error that names the key, e.g.
``train.clients_per_round: 12 clients per round but partition.num_clients is 10``.

Method options live in one module per method (``fedpeft.config.methods.<name>``), each
registering its class (:func:`~fedpeft.config.methods.registry.register_method_config`);
the ``method`` block is validated by that registry, read when a config is validated, not
when this package is imported. Nothing here imports torch, nor another fedpeft package.
"""

from fedpeft.config.comm import CodecConfig, CommConfig
from fedpeft.config.common import ConfigError, Strict
from fedpeft.config.data import DataConfig, PartitionConfig, SiloConfig
from fedpeft.config.deploy import DeployConfig
from fedpeft.config.evaluation import EvalConfig, GenerationConfig
from fedpeft.config.experiment import ExperimentConfig
from fedpeft.config.io import builtin_configs, dump_config, load_config, parse_config, set_dotted
from fedpeft.config.methods.registry import method_config_union
from fedpeft.config.model import ModelConfig
from fedpeft.config.output import CheckpointConfig, ExportConfig, LogConfig
from fedpeft.config.privacy import PrivacyConfig
from fedpeft.config.secrets import REDACTED, public_config, scrub
from fedpeft.config.server import FaultsConfig, ServerConfig
from fedpeft.config.train import TrainConfig

__all__ = [
    "CheckpointConfig",
    "CodecConfig",
    "CommConfig",
    "ConfigError",
    "DataConfig",
    "DeployConfig",
    "EvalConfig",
    "ExperimentConfig",
    "ExportConfig",
    "FaultsConfig",
    "GenerationConfig",
    "LogConfig",
    "ModelConfig",
    "PartitionConfig",
    "PrivacyConfig",
    "REDACTED",
    "ServerConfig",
    "SiloConfig",
    "Strict",
    "TrainConfig",
    "builtin_configs",
    "dump_config",
    "load_config",
    "method_config_union",
    "parse_config",
    "public_config",
    "scrub",
    "set_dotted",
]
