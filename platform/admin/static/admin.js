// loramux admin dashboard: live refresh of <main> and the actions (POST with the CSRF token).
"use strict";
const csrf = document.querySelector('meta[name="csrf-token"]').content;
const flash = document.getElementById("flash");

async function refresh() {
  const r = await fetch(location.href, {credentials: "same-origin", cache: "no-store"});
  if (r.redirected || !r.ok) { location.reload(); return; }
  const doc = new DOMParser().parseFromString(await r.text(), "text/html");
  const engine = document.getElementById("engine");
  const chosen = engine ? engine.value : "";
  document.getElementById("main").innerHTML = doc.getElementById("main").innerHTML;
  if (document.getElementById("engine")) document.getElementById("engine").value = chosen;
  document.body.dataset.refreshed = String(Date.now());
}

async function post(path) {
  const r = await fetch(path, {method: "POST", credentials: "same-origin",
                               headers: {"X-CSRF-Token": csrf}});
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-rollback]");
  if (!b) return;
  const label = b.dataset.tenant + "/" + b.dataset.rollback;
  flash.className = ""; flash.textContent = "rollback " + label + " …";
  try {
    const res = await post("/admin/releases/" + encodeURIComponent(b.dataset.tenant) + "/" +
                           encodeURIComponent(b.dataset.rollback) + "/rollback");
    flash.textContent = "rollback " + label + ": live split now " + res.split;
  } catch (err) {
    flash.className = "bad"; flash.textContent = "rollback " + label + " failed: " + err.message;
  }
  refresh();
});

document.addEventListener("click", async (ev) => {
  const b = ev.target.closest("button[data-act]");
  if (!b) return;
  const engine = (document.getElementById("engine") || {}).value || "";
  const path = "/admin/adapters/" + b.dataset.key.split("/").map(encodeURIComponent).join("/") +
               "/" + b.dataset.act + (engine ? "?engine=" + encodeURIComponent(engine) : "");
  flash.className = ""; flash.textContent = b.dataset.act + " " + b.dataset.key + " …";
  try {
    const res = await post(path);
    flash.textContent = res.action + " " + res.key + ": " + (res.done ? "done" : "no change") +
                        (res.detail ? " — " + res.detail : "");
  } catch (err) {
    flash.className = "bad"; flash.textContent = b.dataset.act + " failed: " + err.message;
  }
  refresh();
});

document.getElementById("logout").onclick = async () => {
  await post("/admin/logout").catch(() => {});
  location.href = "/admin/login";
};

setInterval(() => { if (document.getElementById("live").checked) refresh().catch(() => {}); }, 2000);
