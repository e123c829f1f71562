"""AgentDojo's prompt-injection benchmark replayed through the proxy (``python -m bench.injection``).

world.py runs in AgentDojo's own venv (.tools/agentdojo-venv) and never imports the proxy; registry.py and
run.py run in the proxy's .venv and never import AgentDojo. docs/injection-benchmark.md has the method.
"""
