"""A verdict's version: what decided it, as a short digest a trainer can log and ``kiln verify rescore`` can compare.

The version of a verifier on a task digests three things: the verifier's source (the file of the module that
defines its class: for a built-in, e.g. ``kiln/workers/verifiers/exact.py``; for a ``kiln.verifiers`` plugin, its
own module's file), the task's ``check`` as canonical JSON (sorted keys, no spaces), and the images the check names
(``check["image"]``, ``check["images"]``) as given. A tag (``kiln/toolchain:latest``) is mutable: a rebuilt image
under the same tag keeps the version; name images by digest (``repo@sha256:…``) where that matters. A change to any
of the three changes the version, so two verdicts with one version were decided by the same code on the same check.
Code a verifier calls outside its own module (a shared helper, an exec stage's supervisor) is not in the digest.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from typing import Any

from kiln.schemas.rl import RolloutTask

_SOURCES: dict[type, str] = {}


def source_digest(verifier: object) -> str:
    """sha256 of the source file of the module defining ``verifier``'s class (its name when it has no file)."""
    cls = type(verifier)
    if cls not in _SOURCES:
        module = inspect.getmodule(cls)
        path = getattr(module, "__file__", None)
        try:
            data = open(path, "rb").read() if path else cls.__qualname__.encode()  # noqa: SIM115
        except OSError:
            data = f"{cls.__module__}.{cls.__qualname__}".encode()
        _SOURCES[cls] = hashlib.sha256(data).hexdigest()
    return _SOURCES[cls]


def images_of(check: dict[str, Any]) -> list[str]:
    """The image references a check names, as given (a tag, or a ``@sha256:`` digest)."""
    found: list[str] = []
    image = check.get("image")
    if isinstance(image, str):
        found.append(image)
    images = check.get("images")
    if isinstance(images, list):
        found.extend(i for i in images if isinstance(i, str))
    return sorted(set(found))


def verifier_version(verifier: object, task: RolloutTask) -> str:
    """16 hex digits over the verifier's source, the task's check (canonical JSON) and the images it names."""
    material = json.dumps({"source": source_digest(verifier), "check": task.check, "images": images_of(task.check)},
                          sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(material.encode()).hexdigest()[:16]
