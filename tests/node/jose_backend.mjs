// A tool backend in Node that accepts only calls toolproxy made: the check of docs/backends.md with `jose`.
//   node jose_backend.mjs <port> <jwks-url> <audience>     (prints {"port": N} once it listens on 127.0.0.1)
// POST /tools/<tool> answers 200 {"tool", "subject", "tenant", "txn"} for a valid Txn-Token, else 401 with
// the reason. Run by tests/walkaround/test_call_tokens.py against a real proxied call.
import { createHash } from "node:crypto";
import { createServer } from "node:http";
import { createRemoteJWKSet, jwtVerify } from "jose";

const [port, jwksUrl, audience] = process.argv.slice(2);
const keys = createRemoteJWKSet(new URL(jwksUrl));
const seen = new Map(); // jti -> exp: each token is taken once (kept until it expires)

// headers: node:http's (lower-case names). The hash is of the raw bytes (the proxy sends the RFC 8785 form;
// JSON.parse would let a body with a duplicate key through); the key and fence headers, when present, say what tctx says.
async function check(token, tool, body, headers) {
  if (!token) throw new Error("missing");
  const { payload } = await jwtVerify(token, keys, {
    audience, typ: "txntoken+jwt", algorithms: ["EdDSA", "ES256"],
    requiredClaims: ["exp", "iat", "txn", "jti", "sub"],
  });
  const ctx = payload.tctx ?? {};
  if (payload.scope !== "tool:call") throw new Error("wrong_scope");
  if (ctx.tool !== tool) throw new Error("wrong_tool");
  if (ctx.args_hash !== createHash("sha256").update(body).digest("hex")) throw new Error("wrong_arguments");
  const fence = ctx.fencing_token == null ? undefined : String(ctx.fencing_token);
  if ((headers["idempotency-key"] !== undefined && headers["idempotency-key"] !== ctx.idempotency_key)
      || (headers["x-fencing-token"] !== undefined && headers["x-fencing-token"] !== fence)) {
    throw new Error("header_mismatch");
  }
  const now = Date.now() / 1000;
  for (const [jti, exp] of seen) if (exp + 5 < now) seen.delete(jti);
  if (seen.has(payload.jti)) throw new Error("replayed");
  seen.set(payload.jti, payload.exp);
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
      const claims = await check(req.headers["txn-token"], match[1], Buffer.concat(chunks), req.headers);
      reply(200, { tool: match[1], subject: claims.sub, tenant: claims.tenant, txn: claims.txn });
    } catch (err) {
      reply(401, { error: { code: "call_token_refused", reason: err.code ?? err.message, applied: false } });
    }
  });
});
server.listen(Number(port), "127.0.0.1", () => console.log(JSON.stringify({ port: server.address().port })));
