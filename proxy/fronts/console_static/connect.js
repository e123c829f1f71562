// toolproxy "connect your accounts" page. Served by the admin listener under a CSP without inline script.
// The user's identity token lives in this tab's sessionStorage only and travels in the Authorization header;
// every value from the API is written with textContent. Connecting sends the browser to the service's own
// authorization page (the URL the API answers with), which brings it back to /connect/callback.
"use strict";

(function () {
  const TOKEN_KEY = "toolproxy-user-token";
  const $ = (id) => document.getElementById(id);

  function status(message) {
    $("status").textContent = message || "";
  }

  async function api(method, path) {
    const response = await fetch(path, {
      method, headers: {Authorization: "Bearer " + sessionStorage.getItem(TOKEN_KEY)}, cache: "no-store"});
    const body = await response.json().catch(() => ({}));
    if (!response.ok) throw new Error((body.error && body.error.message) || ("HTTP " + response.status));
    return body;
  }

  function cell(text) {
    const td = document.createElement("td");
    td.textContent = text;
    return td;
  }

  function button(label, action) {
    const td = document.createElement("td");
    const b = document.createElement("button");
    b.type = "button";
    b.textContent = label;
    b.addEventListener("click", action);
    td.append(b);
    return td;
  }

  async function connect(name) {
    try {
      const body = await api("POST", "/v1/connections/" + encodeURIComponent(name) + "/start");
      window.location.assign(body.authorization_url);
    } catch (error) {
      status("Could not start: " + error.message);
    }
  }

  async function disconnect(name) {
    try {
      await api("DELETE", "/v1/connections/" + encodeURIComponent(name));
      await load();
    } catch (error) {
      status("Could not disconnect: " + error.message);
    }
  }

  async function load() {
    const body = await api("GET", "/v1/connections");
    const rows = $("rows");
    rows.replaceChildren();
    for (const row of body.connections) {
      const tr = document.createElement("tr");
      tr.append(cell(row.credential), cell(row.connected ? "connected" : "not connected"),
                row.connected ? button("Disconnect", () => disconnect(row.credential))
                              : button("Connect", () => connect(row.credential)));
      rows.append(tr);
    }
    status("Signed in as " + body.subject + " (" + body.tenant + ")");
    $("sign-in").hidden = true;
    $("list").hidden = false;
  }

  document.addEventListener("DOMContentLoaded", () => {
    $("sign-in-form").addEventListener("submit", (event) => {
      event.preventDefault();
      sessionStorage.setItem(TOKEN_KEY, $("token").value);
      $("token").value = "";
      load().catch((error) => status(error.message));
    });
    if (sessionStorage.getItem(TOKEN_KEY)) load().catch((error) => status(error.message));
  });
})();
