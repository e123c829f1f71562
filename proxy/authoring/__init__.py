"""Authoring: the commands people run beside the proxy (the dev stack, policy check / explain /
replay, contract diff, MCP import). Must never: be imported by the serving path."""
