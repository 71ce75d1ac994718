// The session list: GET /ui/api/sessions, a page at a time, newest first; filters and the page live in the URL.
"use strict";

(() => {
  const { api, el, age, number, withLogin } = Inspector;

  function params() {
    const query = new URLSearchParams(window.location.search);
    return {
      status: query.get("status") || "",
      meta: query.getAll("meta"),
      offset: Math.max(0, parseInt(query.get("offset") || "0", 10) || 0),
      limit: Math.max(1, parseInt(query.get("limit") || "50", 10) || 50),
    };
  }

  function navigate(next) {
    const query = new URLSearchParams();
    if (next.status) query.set("status", next.status);
    for (const m of next.meta) query.append("meta", m);
    if (next.offset) query.set("offset", String(next.offset));
    if (next.limit !== 50) query.set("limit", String(next.limit));
    const search = query.toString();
    window.history.pushState(null, "", search ? `?${search}` : window.location.pathname);
    withLogin(load, showError);
  }

  function fillForm(p) {
    document.getElementById("filter-status").value = p.status;
    document.getElementById("filter-meta").value = p.meta.join(", ");
    document.getElementById("filter-limit").value = String(p.limit);
  }

  function row(session, now) {
    const link = el("a", { href: `/ui/sessions/${encodeURIComponent(session.session_id)}` }, session.session_id);
    const status = el("span", { className: `status ${session.status}` }, session.status + (session.busy ? " · running" : ""));
    return el("tr", { dataset: { session: session.session_id } },
      el("td", {}, link),
      el("td", {}, status),
      el("td", { className: "num" }, number(session.branches)),
      el("td", { className: "num" }, number(session.total_tokens)),
      el("td", { className: "num" }, number(session.turns)),
      el("td", { className: "err" }, session.last_error || ""),
      el("td", { className: "num", title: new Date(session.created_at * 1000).toISOString() }, age(now - session.created_at)),
      el("td", { className: "num" }, `${age(now - session.updated_at)} ago`),
      el("td", { className: "meta" }, session.metadata === "{}" ? "" : session.metadata),
    );
  }

  async function load() {
    document.body.dataset.ready = "0";
    const p = params();
    fillForm(p);
    const query = new URLSearchParams({ offset: String(p.offset), limit: String(p.limit) });
    if (p.status) query.set("status", p.status);
    for (const m of p.meta) query.append("meta", m);
    const page = await api(`/ui/api/sessions?${query}`);
    const now = Date.now() / 1000;
    const rows = document.getElementById("rows");
    rows.replaceChildren(...page.sessions.map((s) => row(s, now)));
    document.getElementById("sessions").hidden = false;
    document.getElementById("empty").hidden = page.sessions.length > 0;
    const first = page.sessions.length ? page.offset + 1 : 0;
    const last = page.offset + page.sessions.length;
    document.getElementById("range").textContent = `${number(first)}–${number(last)} of ${number(page.total)}`;
    document.getElementById("prev").disabled = page.offset === 0;
    document.getElementById("next").disabled = last >= page.total;
    document.getElementById("list-error").textContent = "";
    document.body.dataset.ready = "1";
  }

  function showError(exc) {
    document.getElementById("sessions").hidden = false;
    document.getElementById("list-error").textContent = String(exc.message || exc);
  }

  document.getElementById("filters").addEventListener("submit", (event) => {
    event.preventDefault();
    const meta = document.getElementById("filter-meta").value.split(",").map((s) => s.trim()).filter(Boolean);
    navigate({
      status: document.getElementById("filter-status").value,
      meta,
      offset: 0,
      limit: parseInt(document.getElementById("filter-limit").value, 10),
    });
  });
  document.getElementById("refresh").addEventListener("click", () => withLogin(load, showError));
  document.getElementById("prev").addEventListener("click", () => {
    const p = params();
    navigate({ ...p, offset: Math.max(0, p.offset - p.limit) });
  });
  document.getElementById("next").addEventListener("click", () => {
    const p = params();
    navigate({ ...p, offset: p.offset + p.limit });
  });
  window.addEventListener("popstate", () => withLogin(load, showError));
  withLogin(load, showError);
})();
