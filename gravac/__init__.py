"""gravac: adaptive gradient compression for distributed PyTorch training (GraVAC)."""

from gravac import compressors
from gravac.gain import compression_gain
from gravac.memory import Memory, NoMemory, ResidualMemory
from gravac.simulation import SimulationResult, simulate

__all__ = [
    "Memory",
    "NoMemory",
    "ResidualMemory",
    "SimulationResult",
    "compression_gain",
    "compressors",
    "simulate",
]

__version__ = "0.1.0"
