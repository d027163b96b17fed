"""The operator's view: the status page (``kiln status serve``), ``kiln status``, ``kiln tail`` and ``kiln dlq``."""
