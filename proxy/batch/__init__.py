"""Batches: one model turn of many calls, planned as a DAG (``plan``), run within the limits
(``scheduler``) and merged in plan order (``merge``). Must never: run a call outside the pipeline."""
