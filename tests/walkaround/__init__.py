"""Walk-around tests: the agent container tries to reach what the proxy guards without the proxy."""
