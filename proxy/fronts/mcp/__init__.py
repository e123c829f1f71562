"""The MCP front: Streamable HTTP sessions, JSON-RPC, the tool list and the relay of an upstream's
progress, logs and input requests. Owns: the MCP protocol at the agent's edge. Must never: decide a
call (the pipeline does) or trust an upstream's description of a tool (the registry does)."""
