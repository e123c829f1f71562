// A tool backend in Node that accepts only calls toolproxy made: the check of docs/backends.md with `jose`.
//   node jose_backend.mjs <port> <jwks-url> <audience>     (prints {"port": N} once it listens on 127.0.0.1)
// POST /tools/<tool> answers 200 {"tool", "subject", "tenant", "txn"} for a valid Txn-Token, else 401 with
// the reason. Run by tests/walkaround/test_call_tokens.py against a real proxied call.
import { createHash } from "node:crypto";
import { createServer } from "node:http";
import { createRemoteJWKSet, jwtVerify } from "jose";

const [port, jwksUrl, audience] = process.argv.slice(2);
const keys = createRemoteJWKSet(new URL(jwksUrl));
const seen = new Map(); // txn -> idempotency key (null: none); a real backend keeps this until exp

// RFC 8785: sorted keys (UTF-16 order, as JS sorts), ECMAScript number text, JSON.stringify's strings.
function canonical(value) {
  if (Array.isArray(value)) return `[${value.map(canonical).join(",")}]`;
  if (value !== null && typeof value === "object") {
    return `{${Object.keys(value).sort().map((k) => `${JSON.stringify(k)}:${canonical(value[k])}`).join(",")}}`;
  }
  return JSON.stringify(value);
}

async function check(token, tool, body) {
  if (!token) throw new Error("missing");
  const { payload } = await jwtVerify(token, keys, {
    audience, typ: "txntoken+jwt", algorithms: ["EdDSA", "ES256"], requiredClaims: ["exp", "iat", "txn", "sub"],
  });
  const ctx = payload.tctx ?? {};
  if (payload.scope !== "tool:call") throw new Error("wrong_scope");
  if (ctx.tool !== tool) throw new Error("wrong_tool");
  const hash = createHash("sha256").update(canonical(JSON.parse(body))).digest("hex");
  if (ctx.args_hash !== hash) throw new Error("wrong_arguments");
  const key = ctx.idempotency_key ?? null;
  if (seen.has(payload.txn) && (seen.get(payload.txn) === null || seen.get(payload.txn) !== key)) {
    throw new Error("replayed");
  }
  seen.set(payload.txn, key);
  return payload;
}

const server = createServer((req, res) => {
  const chunks = [];
  req.on("data", (c) => chunks.push(c));
  req.on("end", async () => {
    const match = /^\/tools\/([A-Za-z0-9_]+)$/.exec(req.url ?? "");
    const reply = (status, doc) => { res.writeHead(status, { "content-type": "application/json" }); res.end(JSON.stringify(doc)); };
    try {
      if (req.method !== "POST" || !match) throw new Error("wrong_tool");
      const claims = await check(req.headers["txn-token"], match[1], Buffer.concat(chunks).toString("utf8"));
      reply(200, { tool: match[1], subject: claims.sub, tenant: claims.tenant, txn: claims.txn });
    } catch (err) {
      reply(401, { error: { code: "call_token_refused", reason: err.code ?? err.message, applied: false } });
    }
  });
});
server.listen(Number(port), "127.0.0.1", () => console.log(JSON.stringify({ port: server.address().port })));
