"""What a kiln image declares about itself: the contract between the build stage, which writes it into the image's
labels, and the stages that run the image (exec's sessions and ``run_once`` calls, the builder's revision tests),
which read it back.

An image carries its contract as Docker labels under fixed keys (``LABELS``); images built before the contract had a
version carry the same keys without ``kiln.contract`` and read as version 1. A reader refuses a contract newer than
it knows (a ``ValidationError`` on ``version``, as the envelope's ``schema_version`` is refused): a newer builder's
image may mean something this worker would run wrongly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field, field_validator

CONTRACT_VERSION = 1
# Where an image's test command leaves its reports (JUnit, coverage, a runner's printed output): fixed by the
# contract's version, never read from an image (a repository's Dockerfile could name any path in its labels).
REPORTS_DIR = "/tmp/kiln-reports"


class ImageContract(BaseModel):
    """How to test and lint a session on an image, in what environment, and how to read its reports."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # The image label each field is written under. The builder writes every key, so a repository's own ``LABEL``
    # instructions can never stand in for one.
    LABELS: ClassVar[dict[str, str]] = {"version": "kiln.contract", "test": "kiln.test", "env": "kiln.env",
                                        "system": "kiln.system", "module": "kiln.module", "lint": "kiln.lint"}

    version: int = Field(CONTRACT_VERSION, ge=1, le=CONTRACT_VERSION,
                         description="Version of this contract; a reader refuses newer ones.")
    test: str = Field("", description="Shell command running the image's tests; its reports go to the reports "
                                      "directory. Empty: the image records no test command.")
    env: dict[str, str] = Field(default_factory=dict, description="Environment the test and lint commands need.")
    system: str = Field("", description="Build system that made the image (how its reports are read): "
                                        "'pyproject', 'cargo', 'go', 'agent', …")
    module: str = Field("", description="The Go module path, for Go's test reports; else empty.")
    lint: str = Field("", description="Shell command running the project's linter; empty when none.")

    @field_validator("env", mode="before")
    @classmethod
    def _env_from_its_label(cls, value: object) -> object:
        """The env label holds a JSON object."""
        return json.loads(value) if isinstance(value, str) else value

    @property
    def reports_dir(self) -> str:
        """Where the test command leaves its reports (the same for every image of this contract version)."""
        return REPORTS_DIR

    def to_labels(self) -> dict[str, str]:
        """The labels to build the image with: every key, empty values included."""
        values = {"version": str(self.version), "test": self.test, "env": json.dumps(self.env),
                  "system": self.system, "module": self.module, "lint": self.lint}
        return {self.LABELS[field]: value for field, value in values.items()}

    @classmethod
    def from_labels(cls, labels: Mapping[str, str] | None) -> ImageContract:
        """The contract an image's labels declare (absent keys read as empty; no version is version 1). Raises
        ``pydantic.ValidationError`` for a malformed label or a version newer than ``CONTRACT_VERSION``."""
        return cls.model_validate({field: labels[key] for field, key in cls.LABELS.items()
                                   if labels and labels.get(key)})
