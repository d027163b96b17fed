"""The RL loop around the stages: the actor (task sources → rollout requests), the trainer service (``rollouts`` →
optimizer steps → in-flight weight updates on ``policy.updates``), the policy trainer and its loss, colocated
training, local and in-process learning runs, their reports, and the ``kiln rl`` commands. Not a stage: it reaches
the stages through Kafka and their client facades, like any trainer."""
