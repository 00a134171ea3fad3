"""``data.source: hub``: a Hugging Face dataset (``data.hub_id``, ``data.hub_config``) read
with ``datasets.load_dataset``: its ``data.train_split``, and its ``data.test_split`` as
the test set of its own if given. Extractive QA reads SQuAD's columns."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fedpeft.data.qa import squad_columns
from fedpeft.data.sources.build import Tables
from fedpeft.data.sources.registry import source
from fedpeft.data.sources.tasks import qa_tables, task_tables
from fedpeft.data.types import Columns, DataError

if TYPE_CHECKING:
    from fedpeft.config import DataConfig


@source("hub")
def read(cfg: DataConfig) -> Tables:
    """The configured splits, in the columns of ``data.task``."""
    table, names = load_hub(cfg, cfg.train_split)
    origin = f"{cfg.hub_id}[{cfg.train_split}]"
    test, test_origin = None, ""
    if cfg.test_split:
        test, _ = load_hub(cfg, cfg.test_split)
        test_origin = f"{cfg.hub_id}[{cfg.test_split}]"
    if cfg.task == "extractive_qa":
        table = squad_columns(table, origin)
        test = squad_columns(test, test_origin) if test is not None else None
        return qa_tables(table, origin, test, test_origin, cfg)
    return task_tables(table, origin, test, test_origin, cfg, names)


def load_hub(cfg: DataConfig, split: str) -> tuple[Columns, list[str] | None]:
    """One split of a hub dataset via ``datasets.load_dataset``; class names if it has them."""
    import datasets

    try:
        ds = datasets.load_dataset(cfg.hub_id, cfg.hub_config, split=split)
    except Exception as err:  # network, unknown id, unknown split: all need the id in the message
        raise DataError(f"data.hub_id {cfg.hub_id!r} (split {split!r}) could not be loaded: {err}") from err
    feature = ds.features.get(cfg.label_column)
    feature = getattr(feature, "feature", feature)  # a sequence of class labels (NER tags)
    names = list(feature.names) if hasattr(feature, "names") else None
    return ds.to_dict(), names
