"""Fronts: the HTTP faces of the proxy (agent and ops listeners, the admin API and console, the OpenAI
shape, MCP in ``fronts.mcp``) and the edge they share (ingress limits, error answers, probes).

Owns: translating HTTP into one request value and one envelope back. Must never: hold a business rule
(those live in the stages, the pipeline and the batch machinery below).
"""
