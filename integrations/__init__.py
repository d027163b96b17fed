"""kiln in the shapes other tools expect: the HTTP gateway (SandboxFusion, kimina-lean-server, SWE-ReX), the trainer
adapters (verl, AReaL, OpenRLHF, prime-rl, TRL) and the demo. None is a stage: each drives the stages through their
client facades, like any trainer."""
