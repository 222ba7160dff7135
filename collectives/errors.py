"""The errors a collective can end in and their exit codes (no torch import: the CLI's parser and
``--help`` use these without loading torch)."""
from __future__ import annotations

EXIT_DIVERGENCE = 3
EXIT_TIMEOUT = 4


class DivergenceError(RuntimeError):
    """Ranks issued different collectives or made different decisions."""


class CollectiveTimeoutError(RuntimeError):
    """A collective did not complete in time, a peer died, or the rendezvous was lost; the
    ranks' logs do not show a divergence."""


class StartupError(ValueError):
    """A rank cannot start, or the ranks were started differently (exit code 2, like any
    configuration or input error)."""


class SettingsMismatchError(StartupError):
    """The ranks were started with different settings (``collectives.agreement.agree_settings``)."""


class JobAborted(RuntimeError):
    """Another rank failed and ended the job; carries the line and exit code it reported."""

    def __init__(self, label: str, code: int, message: str) -> None:
        super().__init__(message)
        self.label = label
        self.exit_code = code
