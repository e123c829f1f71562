"""The egress guard: the default-deny nftables rules the chart's init container loads into the pod's network
namespace before any other container starts (``egress_rules``; README.md beside it). A deployable of its own:
it runs once, as root with NET_ADMIN, and imports nothing of the proxy but the setting error. Must never: be
imported by the serving path."""
