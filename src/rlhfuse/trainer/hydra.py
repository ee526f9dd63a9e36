"""Hydra glue: the structured-config schema, `compose_config` for scripts, DictConfig -> dataclasses once."""

from __future__ import annotations

from collections.abc import Sequence

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from rlhfuse._resources import conf_dir
from rlhfuse.trainer.config import RLHFConfig

SCHEMA_NAME = "rlhfuse_schema"


def register_schema() -> None:
    """Register `RLHFConfig` as the schema `conf/config.yaml` builds on: YAML keys and types are checked."""
    ConfigStore.instance().store(name=SCHEMA_NAME, node=RLHFConfig)


def to_config(cfg: DictConfig) -> RLHFConfig:
    """Convert a composed DictConfig into the typed `RLHFConfig` (library code never sees a DictConfig)."""
    merged = OmegaConf.merge(OmegaConf.structured(RLHFConfig), cfg)
    OmegaConf.resolve(merged)
    config = OmegaConf.to_object(merged)
    assert isinstance(config, RLHFConfig)
    return config


def compose_config(overrides: Sequence[str] = (), config_name: str = "config") -> RLHFConfig:
    """Compose rlhfuse's shipped configuration with command-line style overrides, from a script or a test."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    return to_config(cfg)
