from .compressed import CompressedReducer  # noqa: F401  (4-bit gradient reduce, DESIGN.md section 6)
from .cpu_adam import CPUAdam, SpeculationStats  # noqa: F401
