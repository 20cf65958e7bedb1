"""gravac: adaptive gradient compression for distributed PyTorch training (GraVAC)."""

from gravac import amp, compressors
from gravac.comm import CollectiveError, StepTimeoutError
from gravac.config import GravacConfig
from gravac.control import policies
from gravac.gain import compression_gain
from gravac.launch import init_restartable_group, release_group
from gravac.memory import Memory, NoMemory, ResidualMemory
from gravac.monitor import StepRecord, TensorBoardMonitor
from gravac.optimizer import GravacOptimizer, broadcast_parameters
from gravac.simulation import SimulationResult, simulate

__all__ = [
    "CollectiveError",
    "GravacConfig",
    "GravacOptimizer",
    "Memory",
    "NoMemory",
    "ResidualMemory",
    "SimulationResult",
    "StepRecord",
    "StepTimeoutError",
    "TensorBoardMonitor",
    "amp",
    "broadcast_parameters",
    "compression_gain",
    "compressors",
    "init_restartable_group",
    "policies",
    "release_group",
    "simulate",
]

__version__ = "0.1.0"
