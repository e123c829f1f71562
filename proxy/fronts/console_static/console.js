// toolproxy operator console. Served by the admin listener under a CSP without inline script.
// Every value from the admin API is written with textContent (tool arguments are attacker-controlled);
// the admin token lives in this tab's sessionStorage only and travels in the Authorization header.
"use strict";

(function () {
  const TOKEN_KEY = "toolproxy-admin-token";
  const REFRESH_MS = 10000;
  let roles = [];
  let timer = null;

  const $ = (id) => document.getElementById(id);

  // el("td", {className: "x"}, "text", otherNode): text children become text nodes, never markup.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    Object.assign(node, props || {});
    for (const child of children) {
      if (child === null || child === undefined) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function pretty(value) {
    if (value === null || value === undefined) return "—";
    return typeof value === "string" ? value : JSON.stringify(value, null, 1);
  }

  function when(value) {
    if (value === null || value === undefined) return null;
    const date = new Date(value);  // epoch milliseconds or an ISO 8601 string
    return isNaN(date) ? null : date;
  }

  function age(value) {
    const date = when(value);
    if (!date) return "—";
    let s = Math.round((Date.now() - date.getTime()) / 1000);
    const future = s < 0;
    s = Math.abs(s);
    const text = s < 90 ? s + " s" : s < 5400 ? Math.round(s / 60) + " min" : Math.round(s / 3600) + " h";
    return future ? "in " + text : text + " ago";
  }

  function stamp(value) {
    const date = when(value);
    return el("span", {title: date ? date.toISOString() : ""}, age(value));
  }

  function status(message, kind) {
    const line = $("status");
    line.textContent = message || "";
    line.className = kind || "";
  }

  function token() {
    return sessionStorage.getItem(TOKEN_KEY);
  }

  async function api(method, path, body) {
    const headers = {"Authorization": "Bearer " + token(), "Accept": "application/json"};
    const init = {method: method, headers: headers, credentials: "omit", cache: "no-store", redirect: "error"};
    if (body !== undefined) {
      headers["Content-Type"] = "application/json";
      init.body = JSON.stringify(body);
    }
    const response = await fetch(path, init);
    let payload = null;
    try { payload = await response.json(); } catch (e) { payload = null; }
    return {status: response.status, body: payload};
  }

  function errorText(result) {
    const error = result.body && result.body.error;
    return error ? error.message + " (" + error.code + ")" : "HTTP " + result.status;
  }

  function fill(tableId, rows, render) {
    const body = $(tableId).tBodies[0];
    body.replaceChildren(...rows.map(render));
    $(tableId + "-empty").hidden = rows.length > 0;
  }

  function who(record) {
    return el("div", null, el("div", null, record.subject || "—"),
              el("div", {className: "muted"}, "tenant " + (record.tenant || "—")),
              record.agent ? el("div", {className: "muted"}, "agent " + record.agent) : null);
  }

  function code(value) {
    return el("pre", null, pretty(value));
  }

  // -- approvals ---------------------------------------------------------------------------------
  function approvalRow(a) {
    const reason = el("input", {type: "text", placeholder: "reason (optional)", maxLength: 500,
                                className: "reason"});
    const approve = el("button", {type: "button", className: "approve"}, "Approve");
    const deny = el("button", {type: "button", className: "deny"}, "Deny");
    approve.addEventListener("click", () => decide(a.id, "approve", reason.value));
    deny.addEventListener("click", () => decide(a.id, "deny", reason.value));
    const row = el("tr", null,
      el("td", null, stamp(a.created_at_ms), el("div", {className: "muted"}, a.id)),
      el("td", null, who(a)),
      el("td", null, a.tool + " " + a.tool_version),
      el("td", null, code(a.arguments), el("div", {className: "muted"}, (a.resources || []).join(", "))),
      el("td", {className: "risk"}, a.risk),
      el("td", null, el("ul", null, ...(a.reasons || []).map((r) => el("li", null, r)))),
      el("td", null, stamp(a.expires_at_ms)),
      el("td", {className: "actions"}, reason, approve, deny));
    row.dataset.approvalId = a.id;
    return row;
  }

  function decidedRow(a) {
    const row = el("tr", null,
      el("td", null, stamp(a.decided_at_ms), el("div", {className: "muted"}, a.id)),
      el("td", {className: "state-" + a.status}, a.status),
      el("td", null, a.approver || "—"),
      el("td", null, a.decision_reason || "—"),
      el("td", null, who(a)),
      el("td", null, a.tool + " " + a.tool_version),
      el("td", null, code(a.arguments)));
    row.dataset.approvalId = a.id;
    return row;
  }

  async function decide(id, action, reason) {
    const body = reason.trim() ? {reason: reason.trim()} : undefined;
    const result = await api("POST", "/v1/approvals/" + encodeURIComponent(id) + "/" + action, body);
    if (result.status === 200) {
      status((action === "approve" ? "Approved " : "Denied ") + id + ".", "ok");
    } else {
      status("Could not " + action + " " + id + ": " + errorText(result), "error");
    }
    await refresh();
  }

  // -- operations needing a person ------------------------------------------------------------------
  function evidence(t) {
    return el("div", null,
      el("div", null, "original error: " + (t.original_error || "—")),
      el("div", null, "executions " + t.attempts.executions + ", status queries " + t.attempts.reconciliations),
      code(t.last_evidence));
  }

  function operationCell(t) {
    return el("td", null, el("div", {className: "key"}, t.idempotency_key),
              el("div", {className: "muted"}, "call " + (t.call_id || "—") + " · request " + (t.request_id || "—")));
  }

  function takeoverRow(t) {
    const outcome = el("select", {className: "outcome"},
      el("option", {value: "committed"}, "it happened (committed)"),
      el("option", {value: "not_applied"}, "it did not happen (not_applied)"),
      el("option", {value: "rejected"}, "the target refused it (rejected)"));
    const note = el("textarea", {className: "evidence", placeholder: "what you checked (required)", rows: 2,
                                 maxLength: 2000});
    const result = el("textarea", {className: "result", rows: 2,
                                   placeholder: "result as JSON (optional, committed only)"});
    const button = el("button", {type: "button", className: "resolve"}, "Resolve");
    button.addEventListener("click", () => resolve(t.idempotency_key, outcome.value, note.value, result.value));
    const row = el("tr", null,
      el("td", null, stamp(t.takeover_at), el("div", {className: "muted"}, "unknown " + age(t.unknown_since))),
      operationCell(t),
      el("td", null, t.tool + " " + t.tool_version),
      el("td", null, who(t)),
      el("td", null, code(t.target)),
      el("td", null, evidence(t)),
      el("td", {className: "actions"}, outcome, note, result, button));
    row.dataset.key = t.idempotency_key;
    return row;
  }

  async function resolve(key, outcome, note, resultText) {
    const body = {outcome: outcome, evidence: note};
    if (resultText.trim()) {
      try { body.result = JSON.parse(resultText); } catch (e) {
        status("The result is not valid JSON.", "error");
        return;
      }
    }
    const result = await api("POST", "/v1/operations/" + encodeURIComponent(key) + "/resolve", body);
    if (result.status === 200) {
      status("Resolved " + key + " as " + outcome + ".", "ok");
    } else {
      status("Could not resolve " + key + ": " + errorText(result), "error");
    }
    await refresh();
  }

  function unknownOperationRow(t) {
    return el("tr", null, el("td", null, age(t.unknown_since).replace(" ago", "")), operationCell(t),
              el("td", null, t.tool + " " + t.tool_version), el("td", null, who(t)),
              el("td", null, "executions " + t.attempts.executions + ", status queries " + t.attempts.reconciliations),
              el("td", null, code(t.last_evidence)));
  }

  function unknownCallRow(u) {
    const outcome = el("select", {className: "outcome"},
      el("option", {value: "committed"}, "it happened (committed)"),
      el("option", {value: "not_applied"}, "it did not happen (not_applied)"));
    const note = el("textarea", {className: "evidence", placeholder: "what you checked (required)", rows: 2,
                                 maxLength: 2000});
    const button = el("button", {type: "button", className: "settle"}, "Settle");
    button.addEventListener("click", async () => {
      const result = await api("POST", "/v1/unknown-calls/settle",
                               {request_id: u.request_id, call_id: u.call_id, outcome: outcome.value,
                                evidence: note.value});
      status(result.status === 200 ? "Settled call " + u.call_id + "." : "Could not settle: " + errorText(result),
             result.status === 200 ? "ok" : "error");
      await refresh();
    });
    return el("tr", null, el("td", null, age(u.since).replace(" ago", "")),
              el("td", null, el("div", null, "call " + u.call_id), el("div", {className: "muted"}, "request " + u.request_id)),
              el("td", null, u.tool), el("td", null, u.tenant), el("td", {className: "actions"}, outcome, note, button));
  }

  function denialRow(d) {
    return el("tr", null, el("td", null, d.tool), el("td", null, d.reason),
              el("td", null, el("ul", null, ...d.examples.map((r) => el("li", null, r)))),
              el("td", {className: "count"}, d.count), el("td", null, stamp(d.last_at_ms)));
  }

  function lockRow(l) {
    return el("tr", null, el("td", null, l.resource), el("td", null, l.tenant || "—"), el("td", null, l.mode),
              el("td", null, l.tool || "—"),
              el("td", null, el("div", null, l.operation || "—"),
                 el("div", {className: "muted"}, "request " + (l.request_id || "—"))),
              el("td", {className: "count"}, l.fencing_token === null ? "—" : String(l.fencing_token)),
              el("td", {className: "count"}, Math.max(0, Math.round(l.lease_remaining_ms / 100) / 10) + " s"));
  }

  // -- loading -----------------------------------------------------------------------------------------
  async function load(path, apply) {
    const result = await api("GET", path);
    if (result.status === 401) throw new Error(errorText(result));
    if (result.status !== 200) {
      status("Could not load " + path + ": " + errorText(result), "error");
      return;
    }
    apply(result.body);
  }

  async function refresh() {
    if (!token()) return;
    try {
      const jobs = [load("/v1/denials", (b) => {
        fill("denials", b.by_tool_and_reason, denialRow);
        $("denials-kept").textContent = "Counted over the latest " + b.kept + " denials of the fleet.";
      })];
      if (roles.includes("approver")) {
        jobs.push(load("/v1/approvals", (b) => fill("approvals", b.approvals, approvalRow)));
        jobs.push(load("/v1/approvals/decided", (b) => fill("decided", b.approvals, decidedRow)));
      }
      if (roles.includes("operator")) {
        jobs.push(load("/v1/takeovers", (b) => fill("takeovers", b.takeovers, takeoverRow)));
        jobs.push(load("/v1/unknown-operations", (b) => fill("unknown-operations", b.unknown_operations,
                                                                  unknownOperationRow)));
        jobs.push(load("/v1/unknown-calls", (b) => fill("unknown-calls", b.unknown_calls, unknownCallRow)));
        jobs.push(load("/v1/locks", (b) => {
          fill("locks", b.locks, lockRow);
          $("locks-hint").textContent = "A crashed proxy's locks free themselves when their lease (" +
            b.lease_ms / 1000 + " s) runs out" + (b.truncated ? "; only the first locks are shown." : ".");
        }));
      }
      await Promise.all(jobs);
      document.body.dataset.loaded = String(Date.now());
    } catch (e) {
      signOut("Signed out: " + e.message);
    }
  }

  async function signIn(candidate) {
    sessionStorage.setItem(TOKEN_KEY, candidate);
    const result = await api("GET", "/v1/whoami");
    if (result.status !== 200) {
      signOut("This token cannot open the console: " + errorText(result));
      return;
    }
    roles = result.body.roles;
    $("who-text").textContent = "Signed in as " + result.body.subject + " (" + roles.join(", ") + "; " +
      (result.body.tenant ? "tenant " + result.body.tenant : "all tenants") + ")";
    $("who").hidden = false;
    $("sign-in").hidden = true;
    $("panels").hidden = false;
    for (const panel of document.querySelectorAll("section[data-role]")) {
      panel.hidden = !(panel.dataset.role === "any" || roles.includes(panel.dataset.role));
    }
    status("", "");
    await refresh();
    if (timer === null) {
      timer = setInterval(() => {
        const active = document.activeElement;
        if (active && ["INPUT", "TEXTAREA", "SELECT"].includes(active.tagName)) return;
        refresh();
      }, REFRESH_MS);
    }
  }

  function signOut(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    roles = [];
    if (timer !== null) { clearInterval(timer); timer = null; }
    $("who").hidden = true;
    $("panels").hidden = true;
    $("sign-in").hidden = false;
    for (const table of document.querySelectorAll("#panels tbody")) table.replaceChildren();
    status(message || "", message ? "error" : "");
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const field = $("token");
      const candidate = field.value.trim();
      field.value = "";
      if (candidate) signIn(candidate);
    });
    $("sign-out").addEventListener("click", () => signOut(""));
    $("refresh").addEventListener("click", () => refresh());
    if (token()) signIn(token());
  });
})();
