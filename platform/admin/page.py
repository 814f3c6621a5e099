"""The admin dashboard: one static HTML page. The admin key is typed into the page,
kept in ``sessionStorage`` and sent as ``Authorization: Bearer`` to the JSON API."""

ADMIN_PAGE = """<!doctype html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>loramux admin</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
  body { font: 14px/1.4 system-ui, sans-serif; margin: 1.5rem; color: #222; }
  h1 { font-size: 1.3rem; margin: 0 0 1rem; }
  table { border-collapse: collapse; width: 100%; margin-top: 1rem; }
  th, td { border-bottom: 1px solid #ddd; padding: .35rem .5rem; text-align: left; }
  th { background: #f4f4f4; }
  code { font-size: 12px; }
  .tier { padding: .1rem .4rem; border-radius: .3rem; color: #fff; font-size: 12px; }
  .gpu, .device { background: #2a7d2a; } .cpu { background: #b07a00; }
  .disk { background: #777; } .store { background: #999; }
  .err { color: #b00020; } #stats span { margin-right: 1.2rem; }
  button { margin-right: .25rem; }
</style>
</head>
<body>
<h1>loramux &mdash; adapter residency</h1>
<form id="login">
  <label>Admin key <input id="key" type="password" size="50" autocomplete="off"></label>
  <button type="submit">Connect</button>
  <span id="status"></span>
</form>
<div id="stats"></div>
<table>
  <thead><tr><th>adapter</th><th>tenant</th><th>tier</th><th>slot</th><th>pinned</th>
  <th>in use</th><th>rank</th><th>load time</th><th>actions</th></tr></thead>
  <tbody id="rows"></tbody>
</table>
<script>
const $ = (id) => document.getElementById(id);
let key = sessionStorage.getItem("loramux-admin-key") || "";
$("key").value = key;

async function api(method, path) {
  const r = await fetch(path, {method, headers: {"Authorization": "Bearer " + key}});
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error((body.error && body.error.message) || r.statusText);
  return body;
}

function cell(text) { const td = document.createElement("td"); td.textContent = text; return td; }

async function refresh() {
  if (!key) return;
  try {
    const data = await api("GET", "/admin/adapters");
    $("status").textContent = "";
    const e = data.engine;
    $("stats").innerHTML = "";
    for (const [k, v] of Object.entries({running: e.running, waiting: e.waiting,
        "KV cache": (100 * e.kv_cache_usage).toFixed(1) + "%", slots: e.max_loras,
        evictions: e.evictions})) {
      const s = document.createElement("span"); s.textContent = k + ": " + v; $("stats").appendChild(s);
    }
    const rows = $("rows"); rows.innerHTML = "";
    for (const a of data.data) {
      const tr = document.createElement("tr");
      const name = document.createElement("td");
      name.innerHTML = "<b></b><br><code></code>";
      name.querySelector("b").textContent = a.adapter || a.key;
      name.querySelector("code").textContent = a.key;
      tr.appendChild(name);
      tr.appendChild(cell(a.tenant || (a.source === "static" ? "(all)" : "")));
      const tier = document.createElement("td");
      const badge = document.createElement("span");
      badge.className = "tier " + a.tier; badge.textContent = a.tier; tier.appendChild(badge);
      if (a.loading) tier.appendChild(document.createTextNode(" loading"));
      if (a.error) { const er = document.createElement("div"); er.className = "err"; er.textContent = a.error; tier.appendChild(er); }
      tr.appendChild(tier);
      tr.appendChild(cell(a.slot === null || a.slot === undefined ? "" : a.slot));
      tr.appendChild(cell(a.pinned ? "yes" : ""));
      tr.appendChild(cell(a.in_use ? "yes" : ""));
      tr.appendChild(cell(a.rank ?? ""));
      tr.appendChild(cell(a.load_seconds == null ? "" : (1000 * a.load_seconds).toFixed(1) + " ms"));
      const act = document.createElement("td");
      for (const action of ["evict", "pin", "unpin", "warm"]) {
        const b = document.createElement("button");
        b.textContent = action;
        b.onclick = async () => {
          try { await api("POST", "/admin/adapters/" + a.key.split("/").map(encodeURIComponent).join("/") + "/" + action); }
          catch (err) { $("status").textContent = action + ": " + err.message; }
          refresh();
        };
        act.appendChild(b);
      }
      tr.appendChild(act);
      rows.appendChild(tr);
    }
  } catch (err) {
    $("status").textContent = err.message;
  }
}

$("login").onsubmit = (ev) => {
  ev.preventDefault();
  key = $("key").value.trim();
  sessionStorage.setItem("loramux-admin-key", key);
  refresh();
};
refresh();
setInterval(refresh, 3000);
</script>
</body>
</html>
"""
