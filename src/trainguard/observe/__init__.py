"""Events, report, metrics."""
