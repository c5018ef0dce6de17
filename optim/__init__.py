from .compressed import CompressedReducer  # noqa: F401  (4-bit gradient reduce-scatter)
from .cpu_adam import CPUAdam, SpeculationStats  # noqa: F401
from .muon import Muon  # noqa: F401  (layer-wise: Muon / AdamW on the whole tensors a rank owns)
