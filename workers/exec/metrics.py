"""The exec stage's Prometheus metrics (served on the worker's /metrics next to the runtime's: ``Stage.registry``)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

registry = CollectorRegistry()
SESSIONS = Gauge("kiln_exec_sessions", "Open sessions on this worker.", registry=registry)
OPENED = Counter("kiln_exec_sessions_opened_total", "Sessions opened, by whether the warm pool served them.",
                 ["warm"], registry=registry)
LATENCY = Histogram("kiln_exec_command_seconds", "Time to run one request, by operation.", ["op"], registry=registry,
                    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10, 60, 600))
TIMEOUTS = Counter("kiln_exec_timeouts_total", "Commands killed at their time limit.", registry=registry)
KILLS = Counter("kiln_exec_killed_processes_total", "Processes killed by host pid after a timeout.",
                registry=registry)
"""Counted by ``SessionManager.run``: what the sweep of a command that ran past its limit killed (the watchdog's
sweep past the limit, the sweep after a command that timed out)."""
HANDOVERS = Counter("kiln_exec_handovers_total", "Sessions handed to the next owner of their partition, and taken "
                    "over from a former one.", ["direction"], registry=registry)
RUNNERS_DISCARDED = Counter("kiln_exec_runners_discarded_total", "Runners discarded because something of a call "
                            "survived its cleanup (replaced in the background).", registry=registry)
REAPED = Counter("kiln_exec_reaped_containers_total", "Session containers removed by the reaper, by why.",
                 ["reason"], registry=registry)
