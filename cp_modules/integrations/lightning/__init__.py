"""Lightning Fabric and Trainer strategies for context-parallel training (dp x pcp x tp)."""

from cp_modules.integrations.lightning._common import SafeCheckpointIO
from cp_modules.integrations.lightning.fabric import CPFabricStrategy
from cp_modules.integrations.lightning.trainer import CPTrainerStrategy

__all__ = ["CPFabricStrategy", "CPTrainerStrategy", "SafeCheckpointIO"]
