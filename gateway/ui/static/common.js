// Shared by the inspector's pages: the API calls (the cookie rides along; on 401 the login form), DOM building that
// only ever writes text (never HTML: model and tool text is shown as text), number formatting.
"use strict";

const Inspector = (() => {
  class AuthError extends Error {}

  async function api(path, { binary = false } = {}) {
    const response = await fetch(path, { credentials: "same-origin", headers: { accept: binary ? "*/*" : "application/json" } });
    if (response.status === 401) throw new AuthError("the gateway needs its API key");
    if (!response.ok) {
      let message = `${response.status} ${response.statusText}`;
      try {
        const body = await response.json();
        if (body && body.error && body.error.message) message = `${response.status} ${body.error.type}: ${body.error.message}`;
      } catch (_) { /* not JSON */ }
      throw new Error(message);
    }
    return binary ? response.arrayBuffer() : response.json();
  }

  // el("td", {className: "num"}, "12", child): strings become text nodes, never markup.
  function el(tag, props, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(props || {})) {
      if (value === undefined || value === null) continue;
      if (key === "dataset") Object.assign(node.dataset, value);
      else if (key === "on") for (const [event, fn] of Object.entries(value)) node.addEventListener(event, fn);
      else if (key in node) node[key] = value;
      else node.setAttribute(key, String(value));
    }
    for (const child of children) {
      if (child === undefined || child === null || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function setText(id, value) {
    const node = document.getElementById(id);
    if (node) node.textContent = value === undefined || value === null ? "–" : String(value);
    return node;
  }

  function age(seconds) {
    if (!Number.isFinite(seconds)) return "–";
    const s = Math.max(0, seconds);
    if (s < 60) return `${Math.round(s)} s`;
    if (s < 3600) return `${Math.round(s / 60)} min`;
    if (s < 86400) return `${(s / 3600).toFixed(1)} h`;
    return `${(s / 86400).toFixed(1)} d`;
  }

  function number(n) {
    return Number.isFinite(n) ? n.toLocaleString("en-US") : "–";
  }

  // The login form: the key goes once to POST /ui/login in a header; the answer's cookie (HttpOnly) does the rest.
  function showLogin(onDone) {
    const form = document.getElementById("login");
    const error = document.getElementById("login-error");
    form.hidden = false;
    document.getElementById("login-key").focus();
    form.onsubmit = async (event) => {
      event.preventDefault();
      const input = document.getElementById("login-key");
      error.textContent = "";
      const response = await fetch("/ui/login", {
        method: "POST", credentials: "same-origin", headers: { authorization: `Bearer ${input.value.trim()}` },
      });
      input.value = "";
      if (!response.ok) {
        error.textContent = response.status === 401 ? "That key is not accepted." : `Login failed: ${response.status}`;
        return;
      }
      form.hidden = true;
      onDone();
    };
  }

  function setUpLogout() {
    const button = document.getElementById("logout");
    button.hidden = false;
    button.onclick = async () => {
      await fetch("/ui/logout", { method: "POST", credentials: "same-origin" });
      window.location.reload();
    };
  }

  // Runs load(); on a 401 shows the login form and runs it again once logged in.
  async function withLogin(load, showError) {
    try {
      await load();
      setUpLogout();
    } catch (exc) {
      if (exc instanceof AuthError) showLogin(() => withLogin(load, showError));
      else showError(exc);
    }
  }

  return { api, el, setText, age, number, withLogin, AuthError };
})();
