"""The builder→exec contract an image carries in its labels: written and read back whole, readable from images built
before it had a version, refused when a newer builder wrote it."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.schemas.images import CONTRACT_VERSION, REPORTS_DIR, ImageContract

CONTRACT = ImageContract(test=f"mkdir -p {REPORTS_DIR} && cd /work || exit $?; pytest", env={"PY": "/opt/venv/bin"},
                         system="pyproject", module="example.com/calc", lint="ruff check .")


def test_a_contract_round_trips_through_its_labels() -> None:
    labels = CONTRACT.to_labels()
    assert set(labels) == set(ImageContract.LABELS.values())
    assert ImageContract.from_labels(labels) == CONTRACT
    assert ImageContract.from_labels(ImageContract().to_labels()) == ImageContract()
    assert CONTRACT.reports_dir == REPORTS_DIR


def test_every_key_is_written_so_an_image_cannot_supply_its_own() -> None:
    """A repository's Dockerfile ``LABEL`` under a contract key is overwritten, even for an empty field."""
    forged = {key: "forged" for key in ImageContract.LABELS.values()}
    built = {**forged, **ImageContract(system="agent", test="sh run-tests.sh").to_labels()}
    assert ImageContract.from_labels(built) == ImageContract(system="agent", test="sh run-tests.sh")


def test_an_image_built_before_the_version_label_reads_as_version_one() -> None:
    """The labels the builder wrote before the contract was a model: the same keys, no ``kiln.contract``."""
    before = {"kiln.repository": "demo/calc", "kiln.commit": "c0ffee", "kiln.rules": "11", "kiln.system": "pyproject",
              "kiln.test": "mkdir -p /tmp/kiln-reports && pytest", "kiln.lint": "", "kiln.env": "{}",
              "kiln.module": ""}
    contract = ImageContract.from_labels(before)
    assert contract == ImageContract(version=1, test=before["kiln.test"], system="pyproject")
    assert ImageContract.from_labels(None) == ImageContract.from_labels({}) == ImageContract()


def test_a_newer_contract_is_refused() -> None:
    newer = {**CONTRACT.to_labels(), ImageContract.LABELS["version"]: str(CONTRACT_VERSION + 1)}
    with pytest.raises(ValidationError) as refused:
        ImageContract.from_labels(newer)
    assert [e["loc"] for e in refused.value.errors()] == [("version",)]
    with pytest.raises(ValidationError, match="env"):
        ImageContract.from_labels({ImageContract.LABELS["env"]: "not json"})
