"""The gateway's caps as a deployment sets them: a compile cap names a compiled language and replaces that
language's default only; anything else is refused when the gateway starts."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kiln.integrations.gateway.settings import GatewaySettings


def test_compile_caps_replace_their_languages_defaults_only(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KILN_GATEWAY_MAX_COMPILE_S", '{"go": 600}')
    assert GatewaySettings().max_compile_s == {"cpp": 120.0, "go": 600.0, "rust": 120.0}
    for caps, reason in (('{"java": 10}', "no compiled language ['java']"), ('{"python": 10}', "['python']"),
                         ('{"cpp": 0}', "above 0 s")):
        monkeypatch.setenv("KILN_GATEWAY_MAX_COMPILE_S", caps)
        with pytest.raises(ValidationError, match=reason.replace("[", r"\[").replace("]", r"\]")):
            GatewaySettings()
