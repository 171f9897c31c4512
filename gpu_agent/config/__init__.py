"""The agent's configuration: a `version: v1` YAML file validated with pydantic."""
from gpu_agent.config.loader import DEFAULT_CONFIG_PATH, LoadedConfig, load_config
from gpu_agent.config.schema import AgentConfig

__all__ = ["AgentConfig", "DEFAULT_CONFIG_PATH", "LoadedConfig", "load_config"]
