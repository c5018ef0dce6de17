"""Who is calling: the one place that reads the Python stack.

Some facts torch hands no hook: the options of torch's full-state-dict helpers, the ``strict`` of a
``load_state_dict`` (every module's own load is told ``strict=True``), or that an error arises inside
``register_parametrization``, transformers' ``generate`` or ``save_pretrained``, where the message should name that
habit's fix.  They are read from the callers' frames, only on paths that are not per-op (a state dict, a load, a
refusal being raised).
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Callable, Optional


def caller_frame(match: Callable[[FrameType], bool], limit: Optional[int] = None) -> Optional[FrameType]:
    """The nearest frame above the caller that ``match`` accepts, looking at most ``limit`` frames up."""
    frame, seen = sys._getframe(1), 0
    while frame is not None and (limit is None or seen < limit):
        if match(frame):
            return frame
        frame, seen = frame.f_back, seen + 1
    return None


def inside(function: str, file_part: str, limit: Optional[int] = None) -> bool:
    """Whether a function named ``function`` from a file whose path holds ``file_part`` is on the stack."""
    return caller_frame(lambda f: f.f_code.co_name == function and file_part in f.f_code.co_filename,
                        limit) is not None
