"""Policy: the authorize stage, its OPA client, approvals, decision and denial records, OPA's control
plane. Owns: every question asked of OPA and every human approval. Must never: allow on an error."""
