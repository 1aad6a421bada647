"""Errors a user can act on. Each carries one paragraph that names the culprit.

The CLI prints `str(error)` and exits with status 2 for any `DappleError`; anything else is an
internal error and prints a traceback only under `--debug`.
"""

from __future__ import annotations


class DappleError(Exception):
    """Base of every error meant for the user: the message is the whole explanation."""


class ParseError(DappleError):
    """Text that is not valid IR or pipeline syntax (`file:line:column: ...`)."""


class VerifyError(DappleError):
    """IR that parses but breaks an invariant; the message reprints the neighbouring IR."""


class PassError(DappleError):
    """A pass that failed: names the pass and the ones that ran before it."""


class PassOptionError(DappleError):
    """An unknown pass or option, or an option value of the wrong type."""


class CaptureError(DappleError):
    """A model that could not be captured, or a model spec that does not resolve."""


class ClusterError(DappleError):
    """A malformed or inconsistent cluster spec (names the field)."""


class PlanError(DappleError):
    """No plan fits, or a planning request that cannot be met."""


class ScheduleError(DappleError):
    """A schedule request that cannot be met (names why)."""


class RuntimeFailure(DappleError):
    """A run that failed on some rank (names the rank and its error)."""
