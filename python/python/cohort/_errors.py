"""The exceptions of the Cohort client: one class per kind of error of the
Rust core (``cohort_mobile::Error``), all under :class:`CohortError`.

Each also derives from the built-in exception a Python programmer would
catch for it (``ConnectionError`` for an unreachable coordinator,
``PermissionError`` for refused credentials, ``ValueError`` for a bad
argument or update), so existing handlers keep working.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "CohortError",
    "InvalidArgumentError",
    "PausedError",
    "UnreachableError",
    "UnauthorizedError",
    "TaskNotFoundError",
    "RejectedError",
    "ProtocolError",
    "InvalidUpdateError",
    "StorageError",
    "InternalError",
    "PolicyError",
]


class CohortError(Exception):
    """Base class of every error the Cohort client raises."""


class InvalidArgumentError(CohortError, ValueError):
    """A bad argument: an empty server URL, task or token, a storage
    directory that holds another task's enrollment, a policy that does not
    parse, a CA certificate that is not PEM."""


class PausedError(CohortError):
    """The client is paused (``Client.pause``; call ``Client.resume``), or
    was paused or left (``Client.leave``) while a round ran."""


class UnreachableError(CohortError, ConnectionError):
    """The coordinator did not answer (or answered 5xx) on each of the
    client's ``max_attempts`` tries (8 by default, with 22.6 s of waits
    between them), or answered that it is unavailable for a minute."""


class UnauthorizedError(CohortError, PermissionError):
    """The coordinator refused the enrollment token or the credential."""


class TaskNotFoundError(CohortError, LookupError):
    """The task does not exist on this coordinator."""


class RejectedError(CohortError):
    """The coordinator refused a request. ``status`` is the HTTP status and
    ``code`` the machine-readable error code of its reply (for example
    ``excluded`` for a client the coordinator found cheating). A refusal
    that is not the coordinator's (a proxy's ``403`` page) has code
    ``unknown`` and the start of its page in the message."""

    status: int = 0
    code: str = ""


class ProtocolError(CohortError):
    """The coordinator answered something that is not its API (a web page
    where the API should be: check the server URL)."""


class InvalidUpdateError(CohortError, ValueError):
    """The update does not fit the round: a wrong number of values, a
    metric out of range or unknown, examples out of range."""


class StorageError(CohortError, OSError):
    """The state directory could not be read or written."""


class InternalError(CohortError):
    """A bug in the client; please report it with the message."""


class PolicyError(CohortError):
    """The task, or a round, is below the client's policy, or changed since
    enrollment: the client stopped before it revealed anything. ``rule``
    names the policy rule that refused it (for example ``min_threshold``).
    """

    rule: Optional[str] = None
