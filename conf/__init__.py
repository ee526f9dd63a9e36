"""rlhfuse's Hydra configuration, installed as the package `rlhfuse.conf` so that a script's
`@hydra.main(config_path="pkg://rlhfuse.conf", config_name="config")` finds it (Hydra's `pkg://` search path
needs a package). Importing it registers the schema `config.yaml` builds on. See docs/configuration.md."""

from rlhfuse.trainer.hydra import register_schema

register_schema()
