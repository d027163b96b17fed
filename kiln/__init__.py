"""kiln: execution feedback for RL training of code and proof models, on Kafka.

One import namespace over the project's top-level directories: ``kiln.streams`` (runtime, client, admin),
``kiln.schemas`` (models at every boundary), ``kiln.workers`` (stages), ``kiln.ingest`` (Saucer), ``kiln.rl`` (the RL
loop around the stages) and ``kiln.integrations`` (the gateway, trainer adapters, the demo). See docs/architecture.md.
"""
