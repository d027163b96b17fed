"""``kiln gateway serve``: the HTTP APIs of tools trainers already use (SandboxFusion, kimina-lean-server, SWE-ReX),
served by kiln's stages through one shared ``KilnClient`` — the peers' clients work with a URL change."""
