"""Exceptions raised by gemmtune. Each names what was wrong so the caller can fix it."""


class GemmtuneError(Exception):
    """Base class for gemmtune's own errors."""


class ConfigError(GemmtuneError, ValueError):
    """A config table (or the list of tables) cannot be used: missing file, bad row, bad column."""


class ShapesFileError(GemmtuneError, ValueError):
    """A shapes (untuned) CSV is malformed; the message names file and line."""


class NoShapesError(ShapesFileError):
    """A shape list that holds no shape (a header alone): there is nothing to tune, a usage error."""


class BackendUnavailableError(GemmtuneError, RuntimeError):
    """A backend was asked for explicitly but cannot run on this machine."""


class DeviceError(GemmtuneError, ValueError):
    """A device was named that does not exist here (no GPU, a CPU-only torch build, a bad name)."""


class NotRunnableError(GemmtuneError, NotImplementedError):
    """A GEMM family whose tables load but whose op this build cannot compute (a4w4 without fp4, ...)."""


class EnvVarError(GemmtuneError, ValueError):
    """An environment variable gemmtune reads has a value it cannot use; the message names both."""
