"""The running process: what one toolproxy process opens once, watches and closes (``runtime``), the
registry reload without a restart (``registry_reload``), readiness and the scrape-time gauges (``health``)
and draining on SIGTERM (``drain``). Must never: serve HTTP (the fronts above do, holding the runtime this
wing opens) or hold a stage's rules."""
