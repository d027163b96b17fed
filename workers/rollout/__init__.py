"""The rollouts stage: prompt groups → samples from inference servers (multi-turn episodes with exec tool calls) →
rewards from kiln's verifiers. The loop around it (actor, trainer, loss, learning runs) is ``kiln.rl``."""
