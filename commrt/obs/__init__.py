"""Observability: the comms log (comms.py), the trace (trace.py) and the flight recorder
(flight.py, analyze.py), fed by observer.py from the public API's one dispatch point."""
