"""The optional dependency groups (pyproject.toml's extras) and the error that names the one a feature needs.

``pip install kiln`` is the core a trainer needs: the Kafka client, the models, compression, the ``kiln`` command.
Everything else comes with an extra, and reaching for it without the extra is a ``MissingExtra`` that says which
``pip install`` brings it, never a bare ``ModuleNotFoundError``.
"""

from __future__ import annotations

from kiln.streams.errors import MissingExtra

EXTRA_OF_MODULE = {
    "boto3": "s3", "botocore": "s3",
    "docker": "worker", "fastapi": "worker", "starlette": "worker", "uvicorn": "worker", "multipart": "worker",
    "httpx": "worker", "yaml": "worker",
    "faust": "ops", "aiokafka": "ops",
    "torch": "rl", "safetensors": "rl", "numpy": "rl", "matplotlib": "rl", "transformers": "rl", "trl": "rl",
}
"""Top-level module -> the extra that installs it."""


def missing_extra(error: ModuleNotFoundError, feature: str) -> MissingExtra:
    """``MissingExtra`` for ``feature`` when ``error`` is a module one of kiln's extras brings; any other missing module
    is a bug and is raised as it is."""
    module = (error.name or "").split(".")[0]
    extra = EXTRA_OF_MODULE.get(module)
    if extra is None:
        raise error
    return MissingExtra(f"{feature} needs {module}, which the core install leaves out: pip install 'kiln[{extra}]'")
