"""``kiln autoscale``: Harmonic's REPL service queue rule per stage, on the stats stream's numbers, through a backend
that starts and stops workers (local processes) or tells Kubernetes the minimum (KEDA's metrics-api scaler)."""
