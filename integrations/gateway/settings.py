"""``KILN_GATEWAY_*``: the gateway process's settings."""

from __future__ import annotations

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from kiln.integrations.gateway.languages import COMPILE_CAPS


class GatewaySettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="KILN_GATEWAY_", extra="ignore")

    host: str = Field("127.0.0.1", description="Bind address.")
    port: int = Field(8500, description="Port of every API (SandboxFusion, kimina, SWE-ReX, /health, /metrics).")
    api_key: str = Field("", description="When set, every API route needs it (X-API-Key, or Authorization: "
                         "Bearer — what the peers' clients send — or Basic with it as the password: SandboxFusion's "
                         "endpoint http://kiln:KEY@GATEWAY:8500); empty = loopback trust.")
    toolchain_image: str = Field("kiln/toolchain:latest", description="Image of SandboxFusion run_code sessions.")
    max_timeout_s: float = Field(60.0, gt=0, description="Cap on run_code run timeouts; a request over it is "
                                 "refused.")
    max_compile_s: dict[str, float] = Field(default_factory=lambda: dict(COMPILE_CAPS), description="Caps on "
                                            "run_code compile timeouts by language (JSON, over the defaults: "
                                            "cpp 120, rust 120, go 300); a request over its language's is refused.")
    max_submit_cases: int = Field(512, ge=1, description="Cap on the test cases of one SandboxFusion /submit; a "
                                  "problem with more is refused.")
    max_submit_output_bytes: int = Field(64 << 20, ge=1 << 20, description="Cap on what one SandboxFusion "
                                         "/submit's cases may print together (stdout and stderr): each case's "
                                         "streams get an equal share of it, at least that case's expected output "
                                         "and 4 KiB more, at most KILN_GATEWAY_MAX_OUTPUT_BYTES; a case printing "
                                         "past its share fails.")
    max_memory_mb: int = Field(4096, ge=32, description="Cap on run_code memory_limit_MB.")
    max_output_bytes: int = Field(512 << 10, ge=1024, description="Per stream (stdout, stderr) of a run_code step.")
    exec_output_bytes: int = Field(4 << 20, ge=1024, description="Output one exec command of the gateway may return "
                                   "(at most the exec workers' own cap).")
    max_command_s: float = Field(1800.0, gt=0, description="Cap on SWE-ReX command timeouts (also their default).")
    swerex_idle_s: float = Field(1800.0, gt=0, description="A SWE-ReX runtime's session closes after this idle.")
    lean_timeout_s: float = Field(300.0, gt=0, description="Cap on kimina check timeouts.")
    openrlhf_group_size: int = Field(0, ge=0, description="OpenRLHF's --n_samples_per_prompt: the samples of a "
                                     "prompt, whose mean a sample kiln could not judge gets (0: unknown, it waits "
                                     "KILN_VERIFY_GROUP_WAIT_S for its group).")

    @field_validator("max_compile_s")
    @classmethod
    def _compile_caps(cls, caps: dict[str, float]) -> dict[str, float]:
        """Given caps replace the defaults of their languages only; each must be a compiled language's, above 0."""
        unknown = sorted(set(caps) - set(COMPILE_CAPS))
        if unknown:
            raise ValueError(f"no compiled language {unknown} (compiled: {sorted(COMPILE_CAPS)})")
        if any(cap <= 0 for cap in caps.values()):
            raise ValueError("a compile cap must be above 0 s")
        return {**COMPILE_CAPS, **caps}
