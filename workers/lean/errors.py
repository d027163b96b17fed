"""Failures of a REPL process (not of Lean: Lean errors are results). The runtime reads the base class.

ReplError
├── ReplCrashed         (transient) the process exited mid-request; a retry gets a fresh process
├── ReplProtocolError   (transient) it wrote something that is not a reply; it is killed and replaced
│   └── ReplOutOfStep   (transient) a reply out of step with the fence after it (written by the code being checked,
│                       or a reply gone missing); it was not used, the process is killed and replaced
├── ReplTimeout         (routine: an error result) the request ran past its time limit; the process tree was killed
└── ReplMemoryExceeded  (routine: an error result) the process grew past the memory bound; it was killed
"""

from __future__ import annotations

from kiln.streams.errors import JobError, RoutineJobError, TransientJobError


class ReplError(JobError):
    """A REPL process failed; it has been killed and will be replaced."""


class ReplCrashed(ReplError, TransientJobError):
    pass


class ReplProtocolError(ReplError, TransientJobError):
    pass


class ReplOutOfStep(ReplProtocolError):
    pass


class ReplTimeout(ReplError, RoutineJobError):
    pass


class ReplMemoryExceeded(ReplError, RoutineJobError):
    pass
