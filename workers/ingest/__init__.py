"""The ``ingest`` stage (Saucer over Kafka): its spec, handler and client facade."""
