"""mmpt: multimodal contrastive pretraining on one DeepSpeed + WebDataset spine."""

from mmpt.config import Config, ConfigError, load_config
from mmpt.methods import list_methods

__version__ = "0.1.0"

__all__ = ["Config", "ConfigError", "list_methods", "load_config", "__version__"]
