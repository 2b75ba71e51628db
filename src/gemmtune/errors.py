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


class MissingExtraError(GemmtuneError, ImportError):
    """An optional dependency is not installed; the message names the gemmtune extra that brings it."""


# The optional packages of pyproject.toml's extras, by top-level module name.
EXTRA_OF_MODULE = {"transformers": "models", "triton": "triton", "nvmath": "blaslt"}


def missing_extra(exc: ImportError, what: str) -> MissingExtraError | None:
    """The MissingExtraError for `what` when exc is the import of an extra's package failing, else None."""
    top = (getattr(exc, "name", None) or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(top)
    if not isinstance(exc, ModuleNotFoundError) or extra is None:
        return None
    return MissingExtraError(f"{what} needs {top}, which is not installed: pip install 'gemmtune[{extra}]'")


class OutputFileError(GemmtuneError, ValueError):
    """A file cannot be written as asked: an input of the same command, a file of another kind, a folder that
    is missing or not writable, no regular file; the message names the path(s)."""


class ReadOnlyPathError(OutputFileError):
    """The folder a file goes to is not writable, the file is read-only, or its lock file cannot be created."""
