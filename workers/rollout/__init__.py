"""The rollouts stage (prompt groups → samples → rewards from kiln's verifiers) and the learning loop's pieces: task
sources, the policy-gradient loss, and the trainer."""
