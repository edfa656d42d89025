"""The typed API of both custom resources (torch-free)."""

from gem.api.types import (  # noqa: F401
    API_VERSION,
    GROUP,
    KINDS,
    VERSION,
    GEMTraining,
    GEMTrainingSpec,
    JobStatus,
    LoopFMDistill,
    LoopFMDistillSpec,
    Phase,
    parse_object,
)
from gem.api.validation import runnable_field_problems, runnable_problems  # noqa: F401
