"""kiln: execution feedback for RL training of code and proof models, on Kafka.

One import namespace over the project's top-level directories: ``kiln.streams`` (runtime, client, admin),
``kiln.schemas`` (models at every boundary), ``kiln.workers`` (stages) and ``kiln.ingest`` (Saucer). See
docs/architecture.md.
"""
