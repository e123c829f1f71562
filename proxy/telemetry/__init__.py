"""Telemetry: metrics, logs, trace context and the redaction rule they share. Owns: what leaves the
process for people and scrapers. Must never: carry an argument value, a secret or a token."""
