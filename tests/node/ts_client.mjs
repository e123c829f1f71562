// A TypeScript-SDK MCP client driven from pytest: connect, list, call, report.
//
//   node ts_client.mjs URL PLAN_JSON
//   PLAN_JSON: {"headers": {...}, "calls": [{"name": ..., "arguments": {...}}, ...]}
//
// Prints one JSON document: the negotiated version, the listed tools, and per
// call either {"ok": true, "result": CallToolResult} or {"ok": false, "error":
// {name, code, message}} when the SDK threw (what an application would see).
// Tools are listed first, as applications do: the SDK then validates every
// structuredContent against the tool's outputSchema.
import { Client } from "@modelcontextprotocol/sdk/client/index.js";
import { StreamableHTTPClientTransport } from "@modelcontextprotocol/sdk/client/streamableHttp.js";

const [url, planJson] = process.argv.slice(2);
const plan = JSON.parse(planJson);
const transport = new StreamableHTTPClientTransport(new URL(url), {
  requestInit: { headers: plan.headers ?? {} },
});
const client = new Client({ name: "toolproxy-ts-test", version: "1.0.0" });
await client.connect(transport);
const out = { protocolVersion: transport.protocolVersion ?? null, tools: [], calls: [] };
let cursor;
do {
  const page = await client.listTools(cursor ? { cursor } : undefined);
  out.tools.push(...page.tools);
  cursor = page.nextCursor;
} while (cursor);
for (const call of plan.calls ?? []) {
  try {
    const result = await client.callTool({ name: call.name, arguments: call.arguments ?? {} });
    out.calls.push({ ok: true, result });
  } catch (error) {
    out.calls.push({ ok: false, error: { name: error?.constructor?.name, code: error?.code ?? null,
                                         message: String(error?.message ?? error) } });
  }
}
await client.close();
process.stdout.write(JSON.stringify(out));
