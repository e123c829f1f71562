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

  // An id or key, whole on one line: it scrolls inside its cell when longer (focusable, so a keyboard can
  // scroll it too), never breaks in the middle.
  function keyText(value) {
    return el("span", {className: "key", tabIndex: 0, title: String(value)}, value);
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

  // Absolute local time with the relative time beside it.
  function stamp(value) {
    const date = when(value);
    if (!date) return el("span", null, "—");
    return el("time", {dateTime: date.toISOString(), title: date.toISOString()},
              date.toLocaleString(), el("span", {className: "muted"}, " (" + age(value) + ")"));
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

  // A row the user is working in: focus inside it, or a field holding something typed or chosen.
  function busy(row) {
    if (row.contains(document.activeElement)) return true;
    for (const field of row.querySelectorAll("input, textarea, select")) {
      if (field.value !== "") return true;
    }
    return false;
  }

  // Update a table in place, keyed by id: new rows are inserted, gone rows removed, and a row the user
  // is working in is never rebuilt (nor moved), so typed text and focus survive every refresh.
  // Each cell carries its column's name, which the narrow-screen layout (cards) shows beside the value.
  function labelled(table, render) {
    const names = Array.from(table.tHead.rows[0].cells).map((th) => th.textContent);
    return (item) => {
      const row = render(item);
      Array.from(row.cells).forEach((cell, i) => { cell.dataset.label = names[i] || ""; });
      return row;
    };
  }

  function fill(tableId, rows, plainRender, keyOf) {
    const body = $(tableId).tBodies[0];
    const render = labelled($(tableId), plainRender);
    if (!keyOf) {
      body.replaceChildren(...rows.map(render));
    } else {
      const existing = new Map();
      for (const row of Array.from(body.rows)) existing.set(row.dataset.rowKey, row);
      const wanted = new Set(rows.map((item) => String(keyOf(item))));
      for (const [key, row] of existing) if (!wanted.has(key)) row.remove();
      let cursor = body.firstElementChild;
      for (const item of rows) {
        const key = String(keyOf(item));
        const old = existing.get(key);
        if (old && wanted.has(key) && busy(old)) {
          if (old === cursor) cursor = cursor.nextElementSibling;
          continue;  // left exactly where it is
        }
        const fresh = render(item);
        fresh.dataset.rowKey = key;
        if (old) {
          if (old === cursor) cursor = cursor.nextElementSibling;
          old.replaceWith(fresh);
          if (fresh.nextElementSibling !== cursor) body.insertBefore(fresh, cursor);
        } else {
          body.insertBefore(fresh, cursor);
        }
      }
    }
    $(tableId + "-empty").hidden = rows.length > 0;
    const count = $(tableId + "-count");
    if (count) count.textContent = "(" + rows.length + ")";
  }

  // -- the pending queue: filters, search, paging ------------------------------------------------------
  const PAGE_SIZE = 25;
  let pending = {approvals: [], total: null, limit: null};
  let pageIndex = 0;

  function choices(selectId, values) {
    const select = $(selectId);
    const current = select.value;
    const wanted = Array.from(new Set(values)).sort();
    const have = Array.from(select.options).slice(1).map((o) => o.value);
    if (have.join("\n") === wanted.join("\n")) return;
    select.replaceChildren(select.options[0], ...wanted.map((v) => el("option", {value: v}, v)));
    select.value = wanted.includes(current) ? current : "";
  }

  function matches(a) {
    const tool = $("filter-tool").value, tenant = $("filter-tenant").value, risk = $("filter-risk").value;
    const needle = $("filter-search").value.trim().toLowerCase();
    if ((tool && a.tool !== tool) || (tenant && a.tenant !== tenant) || (risk && a.risk !== risk)) return false;
    if (!needle) return true;
    const haystack = [a.id, a.subject, a.tenant, a.agent, a.tool, a.risk, JSON.stringify(a.arguments),
                      a.caller_key, a.request_id, a.call_id, a.operation_key,
                      (a.reasons || []).join(" "), (a.resources || []).join(" ")].join(" ").toLowerCase();
    return haystack.includes(needle);
  }

  function showPending() {
    const all = pending.approvals;
    const ids = new Set(all.map((a) => a.id));
    for (const id of Array.from(related.keys())) if (!ids.has(id)) related.delete(id);
    choices("filter-tool", all.map((a) => a.tool));
    choices("filter-tenant", all.map((a) => a.tenant));
    choices("filter-risk", all.map((a) => a.risk));
    const shown = all.filter(matches);
    const pages = Math.max(1, Math.ceil(shown.length / PAGE_SIZE));
    pageIndex = Math.min(pageIndex, pages - 1);
    const first = pageIndex * PAGE_SIZE;
    fill("approvals", shown.slice(first, first + PAGE_SIZE), approvalRow, (a) => a.id);
    const total = typeof pending.total === "number" ? pending.total : null;
    const capped = pending.limit !== null && all.length >= pending.limit;
    $("approvals-count").textContent = "(" + (total !== null ? total : all.length + (capped ? "+" : "")) + ")";
    document.title = "(" + (total !== null ? total : all.length) + ") toolproxy console";
    let text = shown.length
      ? (first + 1) + "–" + Math.min(first + PAGE_SIZE, shown.length) + " of " + shown.length +
        (shown.length !== all.length ? " matching" : "") + ", page " + (pageIndex + 1) + " of " + pages
      : "none matching";
    if (total !== null && total > all.length) {
      text += ". Listing " + all.length + " of " + total + " pending (the API lists at most " + pending.limit + ")";
    } else if (capped) {
      text += ". Listing the first " + all.length + " pending (the API lists at most " + pending.limit + ")";
    }
    $("approvals-paging").textContent = text + ".";
    $("page-prev").disabled = pageIndex === 0;
    $("page-next").disabled = pageIndex >= pages - 1;
  }

  function who(record) {
    return el("div", null, el("div", null, record.subject || "—"),
              el("div", {className: "muted"}, "tenant " + (record.tenant || "—")),
              record.agent ? el("div", {className: "muted"}, "agent " + record.agent) : null);
  }

  function code(value) {
    return el("pre", null, pretty(value));
  }

  // The contract's approval_view: an amount with its unit and currency, beside the raw argument.
  function money(a) {
    const view = a.view || {};
    const lines = [];
    for (const name of Object.keys(view)) {
      const value = (a.arguments || {})[name];
      if (typeof value !== "number") continue;
      const {unit, currency} = view[name];
      const major = unit === "cents" ? value / 100 : value;
      let text;
      try {
        text = new Intl.NumberFormat(undefined, {style: "currency", currency: currency, currencyDisplay: "code"})
          .format(major);
      } catch (e) {
        text = major.toFixed(2) + " " + currency;
      }
      lines.push(el("div", {className: "money"}, name + ": " + text +
                    (unit === "cents" ? " (" + value + " cents)" : "")));
    }
    return lines;
  }

  // The agent's own key (its Idempotency-Key, X-Run-Id or tool-call id) first, the operation key (a hash of it,
  // what the backend and the audit log see) shortened beside it, then the request and call ids.
  const KEY_SOURCES = {idempotency_key: "Idempotency-Key", run_id: "X-Run-Id", retry_id: "tool-call id"};

  function origin(a) {
    const lines = [el("div", {className: "muted"}, keyText(a.id))];
    if (a.caller_key) {
      lines.push(el("div", {className: "agent-key"}, "key " + a.caller_key,
                    el("span", {className: "muted"}, " (" + (KEY_SOURCES[a.caller_key_source] || "key") + ")")));
    }
    if (a.operation_key) {
      lines.push(el("div", {className: "muted", title: a.operation_key},
                    "operation " + a.operation_key.slice(0, 15) + "\u2026"));
    }
    if (a.request_id || a.call_id) {
      lines.push(el("div", {className: "muted"}, "request ", keyText(a.request_id || "—"),
                    " · call ", keyText(a.call_id || "—")));
    }
    return lines;
  }

  // The sensitive fields the contract lets an approver read (approver_may_read): shown here, never logged.
  function revealed(a) {
    if (!a.revealed) return null;
    return el("div", {className: "revealed"},
      el("div", {className: "revealed-title"}, "Shown to approvers only:"),
      ...Object.keys(a.revealed).map((name) => el("div", null, el("strong", null, name + ": "), pretty(a.revealed[name]))));
  }

  // -- the related read: the contract's read beside a pending approval, run by the proxy as this approver ----
  const RELATED_MAX_AGE_MS = 60000;
  const RELATED_IN_FLIGHT = 3;
  const related = new Map();  // approval id -> {at, result} | {loading: true}
  const relatedQueue = [];
  let relatedRunning = 0;

  function relatedCell(a) {
    const cell = el("td", {className: "related"});
    cell.append(...relatedContent(a));
    return cell;
  }

  function relatedContent(a) {
    if (!a.related_read) return [el("span", {className: "muted"}, "—")];
    const read = a.related_read;
    const title = el("div", {className: "muted"}, read.tool + " " + read.version + " " + JSON.stringify(read.arguments));
    const entry = related.get(a.id);
    // Read again after a minute, except after a denial: asked once per approval and page (no denial every minute
    // in the security team's panels for an approver the policy does not let read).
    const denied = entry && entry.result && entry.result.permitted === false;
    if (!entry || (!entry.loading && !denied && Date.now() - entry.at > RELATED_MAX_AGE_MS)) askRelated(a.id);
    if (!entry || !entry.result) return [title, el("div", {className: "muted related-loading"}, "reading\u2026")];
    const r = entry.result;
    if (r.permitted === false) {
      return [title, el("div", {className: "not-permitted"}, "Not permitted: the policy does not let you read this (" +
                        (r.error ? r.error.code : "forbidden") + ").")];
    }
    if (r.error) {
      return [title, el("div", {className: "not-permitted"}, "Could not read: " + r.error.message + " (" + r.error.code + ")")];
    }
    return [title, fields(r.data),
            el("div", {className: "muted"}, "read ", stamp(r.read_at_ms), " as " + r.subject)];
  }

  // A flat answer (an order) as name/value lines; anything else as JSON.
  function fields(data) {
    if (!data || typeof data !== "object" || Array.isArray(data) || Object.keys(data).length > 30) return code(data);
    const list = el("dl", {className: "fields"});
    for (const [name, value] of Object.entries(data)) {
      list.append(el("dt", null, name), el("dd", null, value !== null && typeof value === "object" ? code(value)
                                                                                                     : pretty(value)));
    }
    return list;
  }

  function askRelated(id) {
    if (related.has(id) && related.get(id).loading) return;
    related.set(id, {...(related.get(id) || {}), loading: true});
    relatedQueue.push(id);
    pumpRelated();
  }

  function pumpRelated() {
    while (relatedRunning < RELATED_IN_FLIGHT && relatedQueue.length) {
      const id = relatedQueue.shift();
      relatedRunning += 1;
      fetchRelated(id).finally(() => { relatedRunning -= 1; pumpRelated(); });
    }
  }

  async function fetchRelated(id) {
    let result;
    try {
      result = await api("GET", "/v1/approvals/" + encodeURIComponent(id) + "/related");
    } catch (e) {
      result = {status: 0, body: null};
    }
    const previous = related.get(id) || {};
    if (result.status === 200 && result.body) {
      related.set(id, {at: Date.now(), result: result.body});
    } else if (result.status === 0 || result.status === 429 || result.status >= 500) {
      // asked again on the next refresh; whatever was read before stays on screen meanwhile
      related.set(id, {at: 0, result: previous.result || {permitted: true, error: {
        code: result.body && result.body.error ? result.body.error.code : "unavailable",
        message: "the admin API did not answer; retrying"}}});
    } else {
      related.set(id, {at: Date.now(), result: {permitted: result.status !== 403, error: {
        code: result.body && result.body.error ? result.body.error.code : "HTTP " + result.status,
        message: errorText(result)}}});
    }
    const row = document.querySelector('#approvals tr[data-approval-id="' + CSS.escape(id) + '"]');
    const cell = row && row.querySelector("td.related");
    const approval = pending.approvals.find((x) => x.id === id);
    if (cell && approval) cell.replaceChildren(...relatedContent(approval));
  }

  // -- approvals ---------------------------------------------------------------------------------
  function approvalRow(a) {
    const fieldId = "reason-" + a.id;
    const label = el("label", {htmlFor: fieldId}, "Reason for " + a.tool + " ", keyText(a.id));
    const reason = el("input", {type: "text", id: fieldId, placeholder: "reason", maxLength: 500,
                                className: "reason"});
    const approve = el("button", {type: "button", className: "approve"}, "Approve");
    const deny = el("button", {type: "button", className: "deny"}, "Deny");
    approve.setAttribute("aria-label", "Approve " + a.tool + " " + a.id);
    deny.setAttribute("aria-label", "Deny " + a.tool + " " + a.id);
    approve.addEventListener("click", () => {
      // An approval without a reason is asked about once: the second press is the answer.
      if (!reason.value.trim() && approve.dataset.confirm !== "1") {
        approve.dataset.confirm = "1";
        approve.textContent = "Approve without a reason?";
        status("No reason given for " + a.id + ": type one, or press \u201cApprove without a reason?\u201d to " +
               "approve anyway.", "error");
        return;
      }
      decide(a.id, "approve", reason.value);
    });
    reason.addEventListener("input", () => {
      delete approve.dataset.confirm;
      approve.textContent = "Approve";
    });
    deny.addEventListener("click", () => decide(a.id, "deny", reason.value));
    const row = el("tr", null,
      el("td", null, stamp(a.created_at_ms), ...origin(a)),
      el("td", null, who(a)),
      el("td", null, a.tool + " " + a.tool_version),
      el("td", null, ...money(a), revealed(a), code(a.arguments),
         el("div", {className: "muted"}, (a.resources || []).join(", "))),
      relatedCell(a),
      el("td", {className: "risk"}, a.risk),
      el("td", null, el("ul", null, ...(a.reasons || []).map((r) => el("li", null, r)))),
      el("td", null, stamp(a.expires_at_ms)),
      el("td", {className: "actions"}, label, reason, approve, deny));
    row.dataset.approvalId = a.id;
    return row;
  }

  function decidedRow(a) {
    const row = el("tr", null,
      el("td", null, stamp(a.decided_at_ms), ...origin(a)),
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
      // Off the pending list now: the refresh below fills the pending and decided lists as each answer
      // comes, and a decided approval must never be shown as pending beside its decision meanwhile.
      const left = pending.approvals.filter((a) => a.id !== id);
      if (left.length !== pending.approvals.length) {
        pending = {...pending, approvals: left, total: typeof pending.total === "number" ? pending.total - 1 : null};
        showPending();
      }
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
    return el("td", null, keyText(t.idempotency_key),
              el("div", {className: "muted"}, "call " + (t.call_id || "—") + " · request " + (t.request_id || "—")));
  }

  // No outcome is preset: the person settling it must choose what they found.
  function outcomeField(id, choices) {
    return el("select", {className: "outcome", id: id},
      el("option", {value: "", selected: true}, "choose what you found"),
      ...choices.map(([value, text]) => el("option", {value: value}, text)));
  }

  // The resolution form of one operation: a takeover's, and a freeze's (resolving it lifts the freeze).
  function resolveForm(kind, key, tool) {
    const base = (kind + "-" + key).replace(/[^A-Za-z0-9_-]/g, "_");
    const outcome = outcomeField(base + "-outcome", [["committed", "it happened (committed)"],
      ["not_applied", "it did not happen (not_applied)"], ["rejected", "the target refused it (rejected)"]]);
    const note = el("textarea", {className: "evidence", id: base + "-evidence",
                                 placeholder: "what you checked (required)", rows: 2, maxLength: 2000});
    const result = el("textarea", {className: "result", id: base + "-result", rows: 2,
                                   placeholder: "result as JSON (optional, committed only)"});
    const button = el("button", {type: "button", className: "resolve"}, "Resolve");
    button.addEventListener("click", () => resolve(key, outcome.value, note.value, result.value));
    button.setAttribute("aria-label", "Resolve " + tool + " " + key);
    return el("td", {className: "actions"}, el("label", {htmlFor: outcome.id}, "Outcome of " + tool), outcome,
              el("label", {htmlFor: note.id}, "Evidence"), note, el("label", {htmlFor: result.id}, "Result"), result,
              button);
  }

  function freezeRow(f) {
    const row = el("tr", null, el("td", null, Math.round(f.age_s) + " s"), el("td", null, f.resource),
      el("td", null, f.tenant || "—"),
      el("td", null, keyText(f.operation), el("div", {className: "muted"}, f.state || "gone")),
      el("td", null, f.tool || "—"),
      resolveForm("freeze-" + f.resource, f.operation, f.tool || "operation"));
    row.dataset.key = f.operation;
    return row;
  }

  function takeoverRow(t) {
    const row = el("tr", null,
      el("td", null, stamp(t.takeover_at), el("div", {className: "muted"}, "unknown " + age(t.unknown_since)),
         traceLine(t.trace_id)),
      operationCell(t),
      el("td", null, t.tool + " " + t.tool_version),
      el("td", null, who(t)),
      el("td", null, code(t.target)),
      el("td", null, evidence(t)),
      resolveForm("takeover", t.idempotency_key, t.tool));
    row.dataset.key = t.idempotency_key;
    return row;
  }

  async function resolve(key, outcome, note, resultText) {
    if (!outcome) {
      status("Could not resolve " + key + ": outcome: choose what you found.", "error");
      return;
    }
    if (!note.trim()) {
      status("Could not resolve " + key + ": evidence: say what you checked (required).", "error");
      return;
    }
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
    const base = "call-" + (u.request_id + "-" + u.call_id).replace(/[^A-Za-z0-9_-]/g, "_");
    const outcome = outcomeField(base + "-outcome", [["committed", "it happened (committed)"],
      ["not_applied", "it did not happen (not_applied)"]]);
    const note = el("textarea", {className: "evidence", id: base + "-evidence",
                                 placeholder: "what you checked (required)", rows: 2, maxLength: 2000});
    const button = el("button", {type: "button", className: "settle"}, "Settle");
    button.setAttribute("aria-label", "Settle call " + u.call_id);
    button.addEventListener("click", async () => {
      if (!outcome.value || !note.value.trim()) {
        status("Could not settle call " + u.call_id + ": " + (outcome.value ? "evidence: say what you checked"
          : "outcome: choose what you found") + ".", "error");
        return;
      }
      const result = await api("POST", "/v1/unknown-calls/settle",
                               {request_id: u.request_id, call_id: u.call_id, outcome: outcome.value,
                                evidence: note.value});
      status(result.status === 200 ? "Settled call " + u.call_id + "." : "Could not settle: " + errorText(result),
             result.status === 200 ? "ok" : "error");
      await refresh();
    });
    return el("tr", null, el("td", null, age(u.since).replace(" ago", "")),
              el("td", null, el("div", null, "call " + u.call_id), el("div", {className: "muted"}, "request " + u.request_id)),
              el("td", null, u.tool), el("td", null, u.tenant),
              el("td", {className: "actions"}, el("label", {htmlFor: outcome.id}, "Outcome of call " + u.call_id),
                 outcome, el("label", {htmlFor: note.id}, "Evidence"), note, button));
  }

  function denialRow(d) {
    return el("tr", null, el("td", null, d.tool), el("td", null, d.reason),
              el("td", null, el("ul", null, ...d.examples.map((r) => el("li", null, r)))),
              el("td", {className: "count"}, d.count), el("td", null, stamp(d.last_at_ms)));
  }

  function recentDenialRow(d) {
    return el("tr", null, el("td", null, stamp(d.at_ms)), el("td", null, who(d)),
              el("td", null, d.tool + (d.tool_version ? " " + d.tool_version : "")),
              el("td", null, el("ul", null, ...(d.reasons || []).map((r) => el("li", null, r)))),
              el("td", null, keyText(d.request_id || "—"),
                 el("div", {className: "muted"}, "call " + (d.call_id || "—")), traceLine(d.trace_id)));
  }

  // The call's trace id (docs/observability.md#traces): what to look up in the trace backend.
  function traceLine(traceId) {
    return traceId ? el("div", {className: "muted trace"}, "trace ", el("code", null, traceId)) : null;
  }

  function lockRow(l) {
    return el("tr", null, el("td", null, l.resource), el("td", null, l.tenant || "—"), el("td", null, l.mode),
              el("td", null, l.tool || "—"),
              el("td", null, el("div", null, l.operation || "—"),
                 el("div", {className: "muted"}, "request " + (l.request_id || "—"))),
              el("td", {className: "count"}, l.fencing_token === null ? "—" : String(l.fencing_token)),
              el("td", {className: "count"}, Math.max(0, Math.round(l.lease_remaining_ms / 100) / 10) + " s"));
  }

  // -- pinned MCP tools (docs/mcp.md#pinned-upstream-tools) ------------------------------------------
  function pinRow(p) {
    const what = p.state === "drifted"
      ? el("td", null, el("div", null, p.summary || p.kind), el("pre", {className: "diff"}, p.diff || ""))
      : el("td", {className: "muted"}, p.state === "verified" ? "matches its pins" : "not checked yet");
    return el("tr", {className: "pin-" + p.state},
              el("td", null, el("div", null, p.tool + " " + p.version),
                 el("div", {className: "muted"}, p.backend + " / " + (p.upstream_tool || "—"))),
              el("td", null, p.state), what, el("td", null, p.since || "—"));
  }

  // -- the token ------------------------------------------------------------------------------------
  // The console reads the token's own expiry (the JWT's "exp" claim) only to name it and warn; the admin
  // API is what checks it.
  function claims(value) {
    const parts = String(value || "").split(".");
    if (parts.length !== 3) return null;
    try {
      const text = atob(parts[1].replace(/-/g, "+").replace(/_/g, "/"));
      const parsed = JSON.parse(text);
      return parsed && typeof parsed === "object" ? parsed : null;
    } catch (e) {
      return null;
    }
  }

  function expiresAt(value) {
    const c = claims(value);
    return c && typeof c.exp === "number" ? new Date(c.exp * 1000) : null;
  }

  function isExpired(value) {
    const at = expiresAt(value);
    return at !== null && at.getTime() <= Date.now();
  }

  // "Bearer eyJ..." pasted whole, quotes and whitespace around it: keep the token only.
  function cleanToken(raw) {
    let value = String(raw || "").trim().replace(/^["']|["']$/g, "").trim();
    if (/^bearer\s+/i.test(value)) value = value.replace(/^bearer\s+/i, "").trim();
    return value;
  }

  const WARN_BEFORE_MS = 5 * 60 * 1000;

  function expiryNotice() {
    const line = $("expiry");
    const at = expiresAt(token());
    if (!at) { line.hidden = true; line.textContent = ""; return; }
    const left = at.getTime() - Date.now();
    if (left <= 0) {
      line.hidden = false;
      line.textContent = "Your token expired at " + at.toLocaleTimeString() + ".";
    } else if (left <= WARN_BEFORE_MS) {
      line.hidden = false;
      line.textContent = "Your token expires at " + at.toLocaleTimeString() + " (" + age(at.getTime()) +
        "): get a new one before then.";
    } else {
      line.hidden = true;
      line.textContent = "";
    }
  }

  function refusal(result, candidate) {
    if (isExpired(candidate)) {
      return "Your token expired at " + expiresAt(candidate).toLocaleString() + ". Sign in with a new one.";
    }
    return errorText(result);
  }

  // -- loading -----------------------------------------------------------------------------------------
  const BACKOFF_MS = [2000, 4000, 8000, 16000, 30000];
  let failures = 0;

  class SignedOut extends Error {}
  class Unreachable extends Error {}

  async function load(path, apply) {
    let result;
    try {
      result = await api("GET", path);
    } catch (e) {
      throw new Unreachable(e.message);  // the network, not the token
    }
    if (result.status === 401) throw new SignedOut(refusal(result, token()));
    if (result.status >= 500 || result.status === 0) throw new Unreachable(errorText(result));
    if (result.status !== 200) {
      status("Could not load " + path + ": " + errorText(result), "error");
      return;
    }
    apply(result.body);
  }

  function schedule(delay) {
    if (timer !== null) clearTimeout(timer);
    timer = setTimeout(() => { timer = null; refresh(); }, delay);
  }

  async function refresh() {
    if (!token()) return;
    const jobs = [load("/v1/denials", (b) => {
      fill("denials", b.by_tool_and_reason, denialRow);
      const counted = typeof b.counted === "number" ? b.counted : b.by_tool_and_reason.length;
      fill("denials-recent", b.recent || [], recentDenialRow);
      $("denials-kept").textContent = "Counted over " + counted + (counted === 1 ? " denial" : " denials") +
        (counted >= b.kept ? " (only the latest " + b.kept + " are kept)." : ".");
    })];
    if (roles.includes("approver")) {
      jobs.push(load("/v1/approvals", (b) => {
        pending = {approvals: b.approvals, total: b.total === undefined ? null : b.total,
                   limit: typeof b.limit === "number" ? b.limit : null};
        showPending();
      }));
      jobs.push(load("/v1/approvals/decided", (b) => fill("decided", b.approvals, decidedRow, (a) => a.id)));
    }
    if (roles.includes("operator")) {
      jobs.push(load("/v1/takeovers", (b) => fill("takeovers", b.takeovers, takeoverRow,
                                                   (t) => t.idempotency_key)));
      jobs.push(load("/v1/unknown-operations", (b) => fill("unknown-operations", b.unknown_operations,
                                                                unknownOperationRow)));
      jobs.push(load("/v1/unknown-calls", (b) => fill("unknown-calls", b.unknown_calls, unknownCallRow,
                                                       (u) => u.request_id + " " + u.call_id)));
      jobs.push(load("/v1/locks", (b) => {
        fill("locks", b.locks, lockRow);
        $("locks-hint").textContent = "A crashed proxy's locks free themselves when their lease (" +
          b.lease_ms / 1000 + " s) runs out" + (b.truncated ? "; only the first locks are shown." : ".");
      }));
      jobs.push(load("/v1/freezes", (b) => {
        fill("freezes", b.freezes, freezeRow, (f) => f.operation + " " + f.resource);
        $("freezes-hint").textContent = b.frozen_resources + (b.frozen_resources === 1 ? " resource" : " resources") +
          " frozen; no write runs there until its operation is resolved" +
          (b.truncated ? "; only the oldest freezes are shown." : ".");
      }));
      jobs.push(load("/v1/pins", (b) => fill("pins", b.pins, pinRow)));  // pinned MCP tools
    }
    const outcomes = await Promise.allSettled(jobs);
    const failed = outcomes.filter((o) => o.status === "rejected").map((o) => o.reason);
    const signedOut = failed.find((e) => e instanceof SignedOut);
    if (signedOut) {
      signOut("Signed out: " + signedOut.message);  // only a 401 ends the session
      return;
    }
    expiryNotice();
    if (failed.length) {
      const delay = BACKOFF_MS[Math.min(failures, BACKOFF_MS.length - 1)];
      failures += 1;
      $("connection").hidden = false;
      $("connection").textContent = "Connection lost, retrying in " + Math.round(delay / 1000) + " s (" +
        failed[0].message + "). What you see is from " + ($("updated").textContent || "before") + ".";
      document.body.dataset.retrying = String(failures);
      schedule(delay);
      return;
    }
    failures = 0;
    $("connection").hidden = true;
    $("connection").textContent = "";
    delete document.body.dataset.retrying;
    const now = new Date();
    $("updated").textContent = now.toLocaleTimeString();
    $("updated").dateTime = now.toISOString();
    document.body.dataset.loaded = String(Date.now());
    schedule(REFRESH_MS);
  }

  async function signIn(candidate) {
    sessionStorage.setItem(TOKEN_KEY, candidate);
    let result;
    try {
      result = await api("GET", "/v1/whoami");
    } catch (e) {
      status("Cannot reach the admin API (" + e.message + "); try again.", "error");
      return;
    }
    if (result.status !== 200) {
      signOut("This token cannot open the console: " + refusal(result, candidate));
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
    failures = 0;
    await refresh();
  }

  function signOut(message) {
    sessionStorage.removeItem(TOKEN_KEY);
    roles = [];
    failures = 0;
    if (timer !== null) { clearTimeout(timer); timer = null; }
    $("who").hidden = true;
    $("panels").hidden = true;
    $("sign-in").hidden = false;
    $("connection").hidden = true;
    $("expiry").hidden = true;
    for (const table of document.querySelectorAll("#panels tbody")) table.replaceChildren();
    pending = {approvals: [], total: null, limit: null};
    related.clear();
    relatedQueue.length = 0;
    document.title = "toolproxy console";
    status(message || "", message ? "error" : "");
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      const field = $("token");
      const candidate = cleanToken(field.value);
      field.value = "";
      if (candidate) signIn(candidate);
    });
    $("sign-out").addEventListener("click", () => signOut(""));
    $("refresh").addEventListener("click", () => refresh());
    for (const id of ["filter-tool", "filter-tenant", "filter-risk"]) {
      $(id).addEventListener("change", () => { pageIndex = 0; showPending(); });
    }
    $("filter-search").addEventListener("input", () => { pageIndex = 0; showPending(); });
    $("page-prev").addEventListener("click", () => { pageIndex = Math.max(0, pageIndex - 1); showPending(); });
    $("page-next").addEventListener("click", () => { pageIndex += 1; showPending(); });
    if (token()) signIn(token());
  });
})();
