/* fusuma dashboard: plain JavaScript, no library, no build step.
 *
 * The page reads everything from GET /1.0/ui/state and keeps itself current from the
 * server-sent events of GET /1.0/events: every event schedules a re-read (debounced),
 * and a timer re-reads every 2 s for the CPU numbers. Rows are updated in place (keyed
 * by name), so a select a person is using is not rebuilt under them. Writes go to the
 * REST API with the session's CSRF token; a 202 is followed to the end of its operation,
 * and a refusal shows the API's sentence.
 */
"use strict";

(function () {
  const CSRF = (document.querySelector('meta[name="csrf-token"]') || {}).content || "";
  // The role of the token behind this page (the API refuses what it may not do; the
  // page does not offer it: app.css hides the actions by body[data-role]).
  const ROLE = document.body.dataset.role || "admin";
  const POLL_MS = 2000;
  const DEBOUNCE_MS = 150;
  const EVENTS_KEPT = 200;
  const HISTORY_S = 300;

  let state = null;
  let partColour = {};          // partition name -> "pcN"
  let fetching = false;
  let again = false;
  let debounce = null;
  let pollTimer = null;
  let source = null;
  let lastEventId = 0;
  let patches = [];             // lifecycle events applied ahead of the next read
  const busy = new Set();       // "vm:NAME" / "partition:NAME" while this page's action runs

  // -- small helpers ---------------------------------------------------------------
  function $(id) { return document.getElementById(id); }

  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined || v === false) continue;
      if (k === "class") e.className = v;
      else if (k === "text") e.textContent = v;
      else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
      else e.setAttribute(k, v === true ? "" : String(v));
    }
    for (const c of children.flat()) {
      if (c === null || c === undefined || c === false) continue;
      e.append(c instanceof Node ? c : document.createTextNode(String(c)));
    }
    return e;
  }

  function svg(tag, attrs) {
    const e = document.createElementNS("http://www.w3.org/2000/svg", tag);
    for (const [k, v] of Object.entries(attrs || {})) e.setAttribute(k, String(v));
    return e;
  }

  function fill(node, ...children) { node.replaceChildren(...children.flat().filter((c) => c !== null && c !== undefined)); }

  function mib(x) {
    if (x === null || x === undefined) return "–";
    if (x >= 10240) return (x / 1024).toFixed(1) + " GiB";
    return (x >= 100 ? Math.round(x) : x.toFixed(1)) + " MiB";
  }

  function bytes(n) {
    if (n === null || n === undefined) return "–";
    if (n < 1024) return n + " B";
    if (n < 1048576) return (n / 1024).toFixed(1) + " KiB";
    if (n < 1073741824) return (n / 1048576).toFixed(1) + " MiB";
    return (n / 1073741824).toFixed(2) + " GiB";
  }

  function ms(x) {
    if (x === null || x === undefined) return "–";
    return (x < 10 ? x.toFixed(2) : x < 100 ? x.toFixed(1) : Math.round(x)) + " ms";
  }

  function pct(x) { return x === null || x === undefined ? "–" : x.toFixed(1) + " %"; }

  function cpulist(cpus) {
    const s = [...cpus].sort((a, b) => a - b);
    const out = [];
    for (let i = 0; i < s.length; i++) {
      let j = i;
      while (j + 1 < s.length && s[j + 1] === s[j] + 1) j++;
      out.push(j > i ? s[i] + "-" + s[j] : String(s[i]));
      i = j;
    }
    return out.join(",");
  }

  function clock(d) {
    return d.toLocaleTimeString([], { hour12: false, hour: "2-digit", minute: "2-digit", second: "2-digit" });
  }

  function swatch(part) { return el("span", { class: "swatch " + (partColour[part] || ""), "aria-hidden": "true" }); }

  // -- notices -----------------------------------------------------------------------
  function toast(kind, title, text) {
    const close = el("button", { class: "toast-close", type: "button", "aria-label": "dismiss", text: "×" });
    const t = el("div", { class: "toast toast-" + kind, role: kind === "error" ? "alert" : "status" },
      el("div", { class: "toast-body" }, el("span", { class: "toast-title", text: title }), text ? el("span", { class: "toast-text", text }) : null),
      close);
    close.addEventListener("click", () => t.remove());
    $("toasts").append(t);
    while ($("toasts").children.length > 4) $("toasts").firstElementChild.remove();
    if (kind !== "error") setTimeout(() => t.remove(), kind === "ok" ? 10000 : 60000);
    return t;
  }

  function banner(text) {
    const b = $("banner");
    b.textContent = text || "";
    b.classList.toggle("hidden", !text);
  }

  function setLive(mode, text) {
    $("live").dataset.live = mode;
    $("live-text").textContent = text;
  }

  // -- the API -----------------------------------------------------------------------
  async function readJson(resp) {
    const text = await resp.text();
    try { return JSON.parse(text); } catch (e) { return null; }
  }

  function errorSentence(resp, data) {
    if (data && typeof data.error === "string") return data.error;
    return "the daemon answered " + resp.status + " " + (resp.statusText || "") + ".";
  }

  async function call(method, path, body) {
    const headers = { "Accept": "application/json" };
    if (method !== "GET") headers["X-CSRF-Token"] = CSRF;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const resp = await fetch(path, {
      method, headers, body: body === undefined ? undefined : JSON.stringify(body),
      credentials: "same-origin", cache: "no-store",
    });
    if (resp.status === 401 && document.body.dataset.tcp === "1") {
      window.location.assign("/login?error=your+session+ended;+log+in+again");
      throw new Error("logged out");
    }
    return { resp, data: await readJson(resp) };
  }

  // Run one action: follow a 202 to its operation's end; say what happened.
  async function act(key, title, method, path, body, describe) {
    if (key) { busy.add(key); render(); }
    const note = toast("busy", title + "…", "");
    try {
      let r;
      try {
        r = await call(method, path, body);
      } catch (e) {
        if (e.message !== "logged out") toast("error", title + " failed", "the daemon did not answer (" + e.message + ").");
        return;
      }
      if (!r.resp.ok) {
        toast("error", title + " refused", errorSentence(r.resp, r.data));
        return;
      }
      let result = r.data;
      if (r.resp.status === 202 && r.data && r.data.id) {
        let op = r.data;
        while (!["Success", "Failure", "Cancelled"].includes(op.status)) {
          const w = await call("GET", "/1.0/operations/" + encodeURIComponent(op.id) + "/wait?timeout=120");
          if (!w.resp.ok) { toast("error", title + ": cannot follow the operation", errorSentence(w.resp, w.data)); return; }
          op = w.data;
        }
        if (op.status !== "Success") {
          toast("error", title + " failed", op.err || ("the operation ended " + op.status + "."));
          return;
        }
        result = op.result;
      }
      toast("ok", title + ": done", describe ? describe(result) : "");
    } catch (e) {
      if (e.message !== "logged out") toast("error", title + " failed", String(e.message || e));
    } finally {
      note.remove();
      if (key) busy.delete(key);
      refreshSoon(0);
    }
  }

  function moveText(r) {
    if (!r) return "";
    const parts = [r.vm + " moved " + r.from + " → " + r.to + " (" + r.mode + ")",
      "downtime " + ms(r.downtime_ms), bytes(r.bytes_sent) + " sent"];
    if (r.total_ms !== undefined && r.total_ms !== null) parts.push("total " + ms(r.total_ms));
    return parts.join(", ") + ".";
  }

  // -- state ---------------------------------------------------------------------------
  async function refresh() {
    if (fetching) { again = true; return; }
    fetching = true;
    try {
      const r = await call("GET", "/1.0/ui/state");
      if (!r.resp.ok) {
        banner("Cannot read the host's state: " + errorSentence(r.resp, r.data));
      } else {
        state = r.data;
        // Events newer than this read are applied again on top of it.
        patches = patches.filter((ev) => ev.id > state.last_event_id);
        patches.forEach(patch);
        banner("");
        render();
      }
    } catch (e) {
      if (e.message !== "logged out") banner("Cannot reach the fusuma daemon (" + e.message + "); retrying.");
    } finally {
      fetching = false;
      if (again) { again = false; refreshSoon(0); }
    }
  }

  function refreshSoon(delay) {
    if (debounce) return;
    debounce = setTimeout(() => { debounce = null; refresh(); }, delay === undefined ? DEBOUNCE_MS : delay);
  }

  function poll() {
    clearTimeout(pollTimer);
    pollTimer = setTimeout(async () => { await refresh(); poll(); }, POLL_MS);
  }

  // -- rendering -----------------------------------------------------------------------
  function render() {
    if (!state) return;
    partColour = {};
    [...state.partitions].map((p) => p.name).sort().forEach((n, i) => { partColour[n] = "pc" + (i % 8); });
    renderSummary();
    renderCores();
    renderPartitions();
    renderVms();
    renderNetworks();
    renderSharing();
    renderDecisions();
    for (const id of ["partitions", "vms", "networks", "decisions"]) labelCells($(id));
  }

  function renderSummary() {
    const s = state;
    const inParts = s.cores.filter((c) => c.partition).length;
    const given = s.partitions.reduce((a, p) => a + p.memory_mib, 0);
    stat("sum-cores", String(s.host.cores.length), inParts + " in partitions");
    stat("sum-memory", mib(s.host.memory_mib), mib(given) + " given to partitions");
    stat("sum-partitions", String(s.partitions.length), s.partitions.filter((p) => p.state !== "running").length + " with supervisor down");
    const running = s.vms.filter((v) => v.state === "running").length;
    stat("sum-vms", running + " / " + s.vms.length, (s.vms.length - running) + " not running");
    const sv = (s.share && s.share.savings_mib) || {};
    stat("sum-saved", s.share && s.share.savings_mib ? mib((sv.segments || 0) + (sv.ksm || 0)) : "–",
      "segments " + mib(sv.segments || 0) + " · KSM " + (sv.ksm === null || sv.ksm === undefined ? "n/a" : mib(sv.ksm)));
  }

  function stat(id, value, sub) {
    $(id).textContent = value;
    $(id + "-sub").textContent = sub;
  }

  // Phone width: the CSS stacks a row's cells, each under its column's name.
  function labelCells(table) {
    const heads = [...table.tHead.rows[0].cells].map((th) => th.textContent);
    for (const tr of table.tBodies[0].rows) {
      [...tr.cells].forEach((td, i) => { if (td.dataset.label !== heads[i] && heads[i]) td.dataset.label = heads[i]; });
    }
  }

  function renderCores() {
    const box = $("coremap");
    if (!state.cores.length) { fill(box, el("p", { class: "empty", text: "No cores found." })); return; }
    fill(box, state.cores.map((c) => {
      const cls = "core" + (c.partition ? " " + (partColour[c.partition] || "") : "");
      return el("div", { class: cls, "data-core": c.core, "data-partition": c.partition || "" },
        el("span", { class: "core-id", text: "core " + c.core }),
        el("span", { class: "core-part" }, c.partition ? ["partition ", el("b", { text: c.partition })] : "host (no partition)"),
        el("div", { class: "core-vcpus" },
          c.vcpus.length ? c.vcpus.map((x) => el("span", { class: "tag", title: "vCPU " + x, text: x })) : el("span", { class: "sub", text: "idle" }),
          c.lent_to ? el("span", { class: "tag tag-lent", title: "the governor dedicated this core to " + c.lent_to, text: "lent → " + c.lent_to }) : null));
    }));
  }

  // Keyed rows: reuse the <tr> of NAME, rebuild its cells only when their content changed.
  function keyedRows(tbody, items, key, attr, build, cols, emptyText) {
    const keep = new Map();
    for (const tr of tbody.querySelectorAll("tr[" + attr + "]")) keep.set(tr.getAttribute(attr), tr);
    tbody.querySelectorAll("tr.empty-row").forEach((tr) => tr.remove());
    let prev = null;
    for (const item of items) {
      const k = key(item);
      let tr = keep.get(k);
      keep.delete(k);
      if (!tr) { tr = el("tr"); tr.setAttribute(attr, k); }
      build(tr, item);
      if (prev ? prev.nextSibling !== tr : tbody.firstChild !== tr) {
        if (prev) prev.after(tr); else tbody.prepend(tr);
      }
      prev = tr;
    }
    for (const tr of keep.values()) tr.remove();
    if (!items.length) tbody.append(el("tr", { class: "empty-row" }, el("td", { colspan: cols, text: emptyText })));
  }

  // Replace the cells of a row whose signature changed; the actions cell (last) is kept
  // when its own signature did not change, so an open select survives a refresh.
  function setCells(tr, cells, actionsSig, buildActions) {
    const n = cells.length + 1;
    while (tr.children.length < n) tr.append(el("td"));
    while (tr.children.length > n) tr.lastChild.remove();
    cells.forEach((c, i) => {
      const td = tr.children[i];
      const sig = c.sig;
      if (td.dataset.sig !== sig) {
        td.dataset.sig = sig;
        td.className = c.class || "";
        fill(td, el("div", { class: "cell" }, c.content()));
      }
    });
    const at = tr.children[cells.length];
    if (at.dataset.sig !== actionsSig) {
      at.dataset.sig = actionsSig;
      fill(at, buildActions());
    }
  }

  function memoryBar(use, limit) {
    const frac = limit ? Math.min(1, (use || 0) / limit) : 0;
    const b = el("span", { class: "bar-use" + (frac > 0.95 ? " full" : frac > 0.8 ? " high" : "") });
    b.style.width = (frac * 100).toFixed(1) + "%";
    return el("div", { class: "bar", role: "img", "aria-label": "memory use " + Math.round(frac * 100) + " percent" }, b);
  }

  // Guest RAM as admitted (fusuma.capacity): admitted, resident now, reclaimable now.
  function admissionLine(m, overcommit) {
    if (!m) return null;
    const oc = overcommit && overcommit !== 1 ? " · overcommit " + overcommit + "×" : "";
    return el("span", { class: "sub admission", text: "guest RAM admitted " + mib(m.admitted_mib) + " · resident " + mib(m.resident_mib) + " · reclaimable " + mib(m.reclaimable_mib) + oc });
  }

  function vmMemoryLine(m) {
    if (!m) return null;
    const cls = m.class === "burstable" ? "burstable ≥ " + mib(m.floor_mib) : "guaranteed";
    return el("span", { class: "sub admission", text: cls + " · admitted " + mib(m.admitted_mib) + (m.resident_mib === null ? "" : " · resident " + mib(m.resident_mib) + " · reclaimable " + mib(m.reclaimable_mib)) });
  }

  function renderPartitions() {
    const tbody = $("partitions").tBodies[0];
    const names = state.partitions.map((p) => p.name);
    keyedRows(tbody, state.partitions, (p) => p.name, "data-partition", (tr, p) => {
      const vms = state.vms.filter((v) => v.partition === p.name).length;
      const job = p.job ? p.job.kind + " (" + p.job.phase + ")" : "";
      const use = p.memory_usage_mib;
      setCells(tr, [
        { sig: p.name + partColour[p.name] + vms, content: () => [swatch(p.name), el("span", { class: "name", text: p.name }), el("span", { class: "sub", text: vms + " VM" + (vms === 1 ? "" : "s") })] },
        { sig: cpulist(p.cpus), class: "mono", content: () => cpulist(p.cpus) || "–" },
        { sig: use + "/" + p.memory_mib + JSON.stringify(p.memory_admission) + p.memory_overcommit, content: () => [memoryBar(use, p.memory_mib), el("span", { class: "bar-label", text: (use === null ? "–" : mib(use)) + " / " + mib(p.memory_mib) }),
          admissionLine(p.memory_admission, p.memory_overcommit)] },
        { sig: p.state + p.supervisor_pid + job, content: () => [
          el("span", { class: "badge " + (p.state === "running" ? "badge-running" : "badge-down"), text: p.state }),
          el("span", { class: "sub", text: (p.supervisor_pid ? "pid " + p.supervisor_pid : "no supervisor") + (job ? " · " + job : "") })] },
        { sig: String(p.qemu_version) + p.qemu, content: () => [el("span", { text: p.qemu_version || "unknown" }), p.qemu ? el("span", { class: "sub mono", text: p.qemu }) : null] },
      ], [names.join(","), busy.has("partition:" + p.name), p.state, cpulist(p.cpus), p.memory_mib].join("|"),
      () => partitionActions(p, names));
    }, 6, "No partitions yet: create one with `fusuma partition create NAME --cpus 0 --memory 1024`.");
  }

  function partitionActions(p, names) {
    const others = names.filter((n) => n !== p.name);
    const isBusy = busy.has("partition:" + p.name);
    const sel = el("select", { class: "maintain-via", "aria-label": "maintain " + p.name + " via partition" },
      others.length ? others.map((n) => el("option", { value: n, text: "via " + n })) : el("option", { value: "", text: "no other partition" }));
    const maintain = el("button", {
      type: "button", class: "btn act-maintain", disabled: isBusy || !others.length || p.state !== "running",
      title: "restart this partition's hypervisor under its running VMs, parking them in the chosen partition",
      text: "Maintain",
      onclick: () => {
        const via = sel.value;
        act("partition:" + p.name, "Maintain " + p.name + " via " + via, "POST",
          "/1.0/partitions/" + encodeURIComponent(p.name) + "/maintain", { via },
          (r) => {
            if (!r) return "";
            const moves = r.moves || [];
            const worst = moves.length ? "; longest downtime " + ms(Math.max(...moves.map((m) => m.downtime_ms || 0))) : "";
            return p.name + " restarted (supervisor pid " + r.supervisor_pid + ") after " + moves.length + " move(s)" + worst + ".";
          });
      },
    });
    const resize = el("button", { type: "button", class: "btn act-resize", disabled: isBusy, text: "Resize…", onclick: () => openResize(p) });
    return el("div", { class: "actions" }, sel, maintain, el("span", { class: "sep" }), resize);
  }

  let resizing = null;
  function openResize(p) {
    resizing = p;
    $("resize-name").textContent = p.name;
    $("resize-cpus").value = cpulist(p.cpus);
    $("resize-memory").value = String(p.memory_mib);
    $("resize-dialog").showModal();
  }

  function submitResize(ev) {
    ev.preventDefault();
    const p = resizing;
    $("resize-dialog").close();
    if (!p) return;
    const body = {};
    const cpus = $("resize-cpus").value.trim();
    const mem = $("resize-memory").value.trim();
    if (cpus && cpus !== cpulist(p.cpus)) body.cpus = cpus;
    if (mem && Number(mem) !== p.memory_mib) body.memory_mib = Number(mem);
    if (!Object.keys(body).length) { toast("ok", "Resize " + p.name, "nothing changed."); return; }
    act("partition:" + p.name, "Resize " + p.name, "PATCH", "/1.0/partitions/" + encodeURIComponent(p.name), body,
      (r) => r ? p.name + " now has cores " + cpulist(r.cpus) + " and " + mib(r.memory_mib) + "." : "");
  }

  function stateClass(s) {
    if (s === "running") return "badge-running";
    if (s === "stopped") return "badge-stopped";
    if (s === "crashed") return "badge-crashed";
    return "badge-busy";
  }

  function sparkline(points, field, cls, label) {
    const pts = points.filter((p) => typeof p[field] === "number");
    const w = 100, h = 24;
    const s = svg("svg", { class: "spark " + cls, viewBox: "0 0 " + w + " " + h, preserveAspectRatio: "none", role: "img" });
    const title = svg("title");
    s.append(title);
    if (pts.length < 2) { title.textContent = label + ": not enough samples yet"; return s; }
    // The last 5 minutes, or the history there is (the daemon keeps it since it started).
    const end = pts[pts.length - 1].t;
    const start = Math.max(end - HISTORY_S, pts[0].t);
    const span = Math.max(end - start, 1);
    const recent = pts.filter((p) => p.t >= start);
    const vals = recent.map((p) => p[field]);
    const top = Math.max(field === "pss_mib" ? 1 : 100, ...vals);
    const xy = recent.map((p) => [((p.t - start) / span) * w, h - 1 - (p[field] / top) * (h - 2)]);
    if (xy.length < 2) { title.textContent = label + ": not enough samples yet"; return s; }
    const line = xy.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" ");
    s.append(svg("polygon", { class: "spark-area", points: xy[0][0].toFixed(1) + "," + h + " " + line + " " + xy[xy.length - 1][0].toFixed(1) + "," + h }));
    s.append(svg("polyline", { class: "spark-line", points: line }));
    title.textContent = label + " over the last " + Math.round(span / 60 * 10) / 10 + " min: min " + Math.min(...vals).toFixed(1) + ", max " + Math.max(...vals).toFixed(1);
    return s;
  }

  function memSplit(v) {
    const m = v.host_memory;
    if (!m) return null;
    const seg = m.segments_pss_mib || 0;
    return { pss: m.pss_mib, private: Math.max(0, m.pss_mib - seg), segment: seg, ksm: m.ksm_merged_mib || 0 };
  }

  function stackBar(split, scale) {
    const part = (cls, x, name) => {
      const s = el("span", { class: cls, title: name + " " + mib(x) });
      s.style.width = (scale ? (100 * x) / scale : 0).toFixed(2) + "%";
      return s;
    };
    return el("div", { class: "bar", role: "img", "aria-label": "private " + mib(split.private) + ", segments " + mib(split.segment) + ", KSM merged " + mib(split.ksm) },
      part("seg-private", split.private, "private"), part("seg-segment", split.segment, "segments"), part("seg-ksm", split.ksm, "merged by KSM"));
  }

  function qosNote(v) {
    const g = v.governor;
    if (!g) return "";
    const notes = [];
    if (g.dedicated_cores && g.dedicated_cores.length) notes.push("lent core " + g.dedicated_cores.join(","));
    if (g.cap_cpus !== null && g.cap_cpus !== undefined) notes.push("capped " + g.cap_cpus.toFixed(2) + " CPU");
    if (g.short) notes.push("short of CPU");
    if (g.weight !== undefined && v.qos !== "best-effort") notes.push("weight " + g.weight);
    return notes.join(" · ");
  }

  function renderVms() {
    const tbody = $("vms").tBodies[0];
    const names = state.partitions.map((p) => p.name);
    keyedRows(tbody, state.vms, (v) => v.name, "data-vm", (tr, v) => {
      tr.setAttribute("data-partition", v.partition);
      tr.setAttribute("data-state", v.state);
      const pts = (state.samples && state.samples[v.name]) || [];
      const lastT = pts.length ? pts[pts.length - 1].t : 0;
      const load = v.governor && v.governor.load;
      const cpu = v.cpu_pct !== null && v.cpu_pct !== undefined ? v.cpu_pct : load ? load.cpu_pct : null;
      const wait = v.wait_pct !== null && v.wait_pct !== undefined ? v.wait_pct : load ? load.wait_pct : null;
      const live = ["running", "paused", "migrating", "stopping"].includes(v.state);
      const split = memSplit(v);
      const job = v.job ? (v.job.kind === "migrate" ? "moving to " + v.job.peer : v.job.kind) + " (" + v.job.phase + ")" : "";
      const note = qosNote(v);
      setCells(tr, [
        { sig: v.name + v.vcpus + v.memory_mib + v.accel, content: () => [el("span", { class: "name", text: v.name }),
          el("span", { class: "sub", text: v.vcpus + " vCPU · " + v.memory_mib + " MiB · " + v.accel })] },
        { sig: v.state + job + (v.error || ""), class: "state-cell", content: () => [
          el("span", { class: "badge vm-state " + stateClass(v.state), text: v.state }),
          job ? el("span", { class: "sub", text: job }) : null,
          v.error ? el("span", { class: "sub", title: v.error, text: v.error.length > 40 ? v.error.slice(0, 40) + "…" : v.error }) : null] },
        { sig: v.partition + partColour[v.partition], class: "partition-cell", content: () => [swatch(v.partition), el("span", { class: "vm-partition", text: v.partition })] },
        { sig: v.qos + note, content: () => [el("span", { class: v.qos === "guaranteed" ? "qos-guaranteed" : "", text: v.qos }), note ? el("span", { class: "sub", text: note }) : null] },
        { sig: "c" + cpu + lastT + live, content: () => [el("span", { class: "metric", text: live ? pct(cpu) : "–" }), sparkline(pts, "cpu_pct", "cpu", "CPU %")] },
        { sig: "w" + wait + lastT + live, content: () => [el("span", { class: "metric", text: live ? pct(wait) : "–" }), sparkline(pts, "wait_pct", "wait", "vCPU wait %")] },
        { sig: "m" + JSON.stringify(split) + JSON.stringify(v.memory), content: () => split ? [
          el("span", { class: "metric", text: mib(split.pss) }), stackBar(split, split.private + split.segment + split.ksm),
          el("span", { class: "bar-label", text: "priv " + split.private.toFixed(1) + " · seg " + split.segment.toFixed(1) + " · ksm " + split.ksm.toFixed(1) }),
          vmMemoryLine(v.memory)] : [el("span", { class: "muted", text: "–" }), vmMemoryLine(v.memory)] },
        { sig: "s" + v.segments.join(","), content: () => v.segments.length ? v.segments.map((s) => el("span", { class: "tag", text: s })) : el("span", { class: "muted", text: "none" }) },
        { sig: "n" + v.ports.join(",") + JSON.stringify(v.nics || []), content: () => networkCell(v) },
      ], [names.join(","), v.partition, v.state, !!v.job, busy.has("vm:" + v.name)].join("|"), () => vmActions(v, names));
    }, 10, "No VMs yet: create one with `fusuma vm create NAME -p PARTITION --start`.");
  }

  // A VM's network: its NICs on fusuma networks, then its port forwards (without a NIC,
  // QEMU's user-mode network, which a VM has only when it forwards a port).
  function networkCell(v) {
    const nics = v.nics || [];
    const ports = v.ports.map((s) => {
      const parts = s.split(":");
      return el("span", { class: "tag mono", title: "host " + (parts.length > 2 ? parts[0] : "127.0.0.1") + ":" + parts[parts.length - 2] + " → guest port " + parts[parts.length - 1], text: s });
    });
    if (!nics.length && !ports.length) return el("span", { class: "muted", text: "none" });
    return [...nics.map(nicTag), nics.length ? null : el("span", { class: "sub", text: "user-mode" }), ...ports];
  }

  // One NIC: network and address, its MAC and tap (absent from the kernel: marked).
  function nicTag(n) {
    return el("span", { class: "nic" + (n.tap_present ? "" : " nic-absent"), "data-nic": n.network + "/" + n.index,
      title: "MAC " + n.mac + " · tap " + (n.tap || "–") + (n.tap_present ? "" : " (not in the kernel)") },
      el("span", { class: "tag", text: n.network }), " ", el("span", { class: "mono", text: n.ip || n.mac }),
      el("span", { class: "sub mono", text: n.mac + " · " + (n.tap || "–") + (n.tap_present ? "" : " · no tap") }));
  }

  function renderNetworks() {
    const tbody = $("networks").tBodies[0];
    keyedRows(tbody, state.networks || [], (n) => n.name, "data-network", (tr, n) => {
      const nics = n.nics || [];
      const sig = JSON.stringify(n);
      if (tr.dataset.sig === sig) return;
      tr.dataset.sig = sig;
      fill(tr, [
        { sig: n.name + n.gateway, content: () => [el("span", { class: "name", text: n.name }), n.gateway ? el("span", { class: "sub", text: "gateway " + n.gateway }) : null] },
        { sig: n.type + n.nat + n.isolated + n.filtering, content: () => [el("span", { text: n.type }),
          el("span", { class: "sub", text: ["nat", "isolated", "filtering"].filter((f) => n[f]).join(" · ") || "–" })] },
        { sig: n.bridge, class: "mono", content: () => n.bridge },
        { sig: String(n.subnet), class: "mono", content: () => n.subnet || "–" },
        { sig: n.state + n.dnsmasq_pid, content: () => [el("span", { class: "badge " + (n.state === "up" ? "badge-running" : "badge-down"), text: n.state }),
          n.dnsmasq_pid ? el("span", { class: "sub", text: "dnsmasq pid " + n.dnsmasq_pid }) : null] },
        { sig: JSON.stringify(nics), content: () => nics.length ? nics.map((x) => el("span", { class: "nic" + (x.tap_present ? "" : " nic-absent"), "data-nic": x.vm + "/" + x.index },
          el("span", { class: "name", text: x.vm }), " ", el("span", { class: "mono", text: x.ip || x.mac }),
          el("span", { class: "sub mono", text: x.mac + " · " + (x.tap || "–") + (x.tap_present ? "" : " · no tap") }))) : el("span", { class: "muted", text: "no VM" }) },
      ].map((c) => el("td", { class: c.class || "" }, el("div", { class: "cell" }, c.content()))));
    }, 6, "No networks yet: create one with `fusuma network create NAME`, then give VMs a NIC on it (`--nic NAME`).");
  }

  // A button that asks for a second click (within 4 s) before it acts.
  function confirmButton(cls, label, question, disabled, run) {
    let armed = null;
    const b = el("button", { type: "button", class: cls, disabled, text: label });
    b.addEventListener("click", () => {
      if (armed) {
        clearTimeout(armed);
        armed = null;
        b.textContent = label;
        b.classList.remove("armed");
        run();
        return;
      }
      b.textContent = question;
      b.classList.add("armed");
      armed = setTimeout(() => { armed = null; b.textContent = label; b.classList.remove("armed"); }, 4000);
    });
    return b;
  }

  function vmActions(v, names) {
    const isBusy = busy.has("vm:" + v.name) || !!v.job;
    const stopped = v.state === "stopped" || v.state === "crashed";
    const path = "/1.0/vms/" + encodeURIComponent(v.name);
    const startStop = stopped
      ? el("button", { type: "button", class: "btn act-start", disabled: isBusy, text: "Start",
        onclick: () => act("vm:" + v.name, "Start " + v.name, "PUT", path + "/state", { action: "start" }, () => v.name + " is running.") })
      : confirmButton("btn btn-danger act-stop", "Stop", "Stop " + v.name + "?", isBusy || v.state !== "running" && v.state !== "paused",
        () => act("vm:" + v.name, "Stop " + v.name, "PUT", path + "/state", { action: "stop" }, () => v.name + " is stopped."));
    const others = names.filter((n) => n !== v.partition);
    const sel = el("select", { class: "move-to", "aria-label": "move " + v.name + " to partition" },
      others.length ? others.map((n) => el("option", { value: n, text: "to " + n })) : el("option", { value: "", text: "no other partition" }));
    const move = el("button", {
      type: "button", class: "btn btn-primary act-move", disabled: isBusy || v.state !== "running" || !others.length,
      title: "move the running VM to the chosen partition", text: "Move",
      onclick: () => {
        const to = sel.value;
        act("vm:" + v.name, "Move " + v.name + " to " + to, "POST", path + "/move", { partition: to }, moveText);
      },
    });
    return el("div", { class: "actions" }, startStop, el("span", { class: "sep" }), sel, move);
  }

  function renderSharing() {
    const sh = state.share || {};
    const totals = $("share-totals");
    if (sh.error) {
      fill(totals, el("div", { class: "muted", text: "Memory report unavailable: " + sh.error }));
      fill($("share-bars"));
    } else {
      const sv = sh.savings_mib || {};
      fill(totals,
        el("div", {}, "PSS of all VMs ", el("b", { text: mib(sh.totals ? sh.totals.pss_mib : null) })),
        el("div", {}, el("span", { class: "key key-segment" }), " saved by segments ", el("b", { class: "saved-segments", text: mib(sv.segments) })),
        el("div", {}, el("span", { class: "key key-ksm" }), " saved by KSM ", el("b", { class: "saved-ksm", text: sv.ksm === null || sv.ksm === undefined ? "n/a" : mib(sv.ksm) }),
          sv.ksm_vm_profit !== null && sv.ksm_vm_profit !== undefined ? el("span", { class: "muted", text: " (VMs' profit " + mib(sv.ksm_vm_profit) + ")" }) : null),
        Object.keys(sh.bases || {}).length ? el("div", {}, "saved by shared base images ", el("b", { class: "saved-bases", text: mib(sv.bases) }),
          el("span", { class: "muted", text: " (page cache of " + Object.keys(sh.bases).join(", ") + ")" })) : null);
      const rows = (state.vms || []).map((v) => ({ name: v.name, split: memSplit(v) })).filter((r) => r.split);
      const scale = Math.max(1, ...rows.map((r) => r.split.private + r.split.segment + r.split.ksm));
      fill($("share-bars"), rows.length ? rows.map((r) => el("div", { class: "share-row", "data-vm": r.name },
        el("span", { class: "share-name", text: r.name }), stackBar(r.split, scale),
        el("span", { class: "bar-label", text: "private " + mib(r.split.private) + " · segments " + mib(r.split.segment) + " · KSM " + mib(r.split.ksm) }))) :
        el("p", { class: "empty", text: "No running VM." }));
      const segs = Object.entries(sh.segments || {});
      $("segments-wrap").classList.toggle("hidden", !segs.length);
      fill($("segments").tBodies[0], segs.map(([n, s]) => el("tr", {},
        el("td", { class: "name", text: n }), el("td", { text: s.vms }), el("td", { text: mib(s.rss_mib) }),
        el("td", { text: mib(s.pss_mib) }), el("td", { text: mib(s.saved_mib) }))));
    }
    const box = $("ksm-run");
    const ksm = sh.ksm;
    if (!busy.has("ksm")) {
      box.disabled = !ksm || ROLE !== "admin";
      box.checked = !!(ksm && ksm.run === 1);
    }
    $("ksm-state").textContent = ksm ? ksm.state + (ksm.run === 1 ? " (merging)" : "") : "not available on this host";
    $("ksm-risk").textContent = "Risk: " + (state.ksm_risk || "");
  }

  async function toggleKsm() {
    const box = $("ksm-run");
    const run = box.checked;
    busy.add("ksm");
    box.disabled = true;
    try {
      await act(null, (run ? "Turn KSM on" : "Turn KSM off"), "PUT", "/1.0/share/ksm", { run },
        (r) => r ? "KSM is " + r.state + "." : "");
    } finally {
      busy.delete("ksm");
    }
  }

  function numbersText(n) {
    return Object.entries(n || {}).filter(([, x]) => x !== null && x !== undefined)
      .map(([k, x]) => k + " " + (typeof x === "number" ? (Math.round(x * 100) / 100) : x)).join(", ");
  }

  function renderDecisions() {
    const tbody = $("decisions").tBodies[0];
    const ds = state.decisions || [];
    if (!ds.length) {
      fill(tbody, el("tr", { class: "empty-row" }, el("td", { colspan: 5, text: "No decisions yet: the governor changes weights, caps and cores when a guaranteed VM waits for CPU." })));
      return;
    }
    const cell = (cls, ...c) => el("td", { class: cls }, el("div", { class: "cell" }, ...c));
    fill(tbody, ds.map((d) => el("tr", {},
      cell("mono", clock(new Date(d.at * 1000))),
      cell("", swatch(d.partition), d.partition),
      cell("name", d.vm),
      cell("", el("span", { class: "tag", text: d.action })),
      cell("wrap", el("span", { text: d.reason }), el("span", { class: "sub", text: numbersText(d.numbers) })))));
  }

  // -- events --------------------------------------------------------------------------
  function eventText(ev) {
    const md = ev.metadata || {};
    const c = md.context || {};
    const a = md.action || "";
    const obj = (md.source || "").split("/").pop();
    if (ev.type === "lifecycle") {
      if (a === "vm-moved") {
        return { cls: "ev-move", nodes: [obj + " moved " + c.from + " → " + c.to + " (" + c.mode + "): downtime ",
          el("b", { class: "ev-downtime", text: ms(c.downtime_ms) }), ", ", el("b", { class: "ev-bytes", text: bytes(c.bytes_sent) }), " sent",
          c.total_ms !== undefined ? ", total " + ms(c.total_ms) : ""] };
      }
      if (a === "vm-move-failed") return { cls: "ev-failed", nodes: [obj + " move " + c.from + " → " + c.to + " failed: " + (c.error || "")] };
      const where = c.partition ? " (" + c.partition + ")" : "";
      const more = c.error ? ": " + c.error : "";
      return { cls: a.endsWith("crashed") ? "ev-failed" : "", nodes: [a.replace(/^(vm|partition)-/, "$1 ") + " " + obj + where + more] };
    }
    if (ev.type === "governor") {
      return { cls: "", nodes: [(c.partition ? c.partition + " · " : "") + (c.vm || obj) + ": " + a + (c.reason ? " — " + c.reason : "")] };
    }
    if (ev.type === "operation") {
      const st = c.status || "";
      const failed = st === "Failure";
      return { cls: failed ? "ev-failed" : "", nodes: [(c.description || "operation") + ": " + (a === "operation-created" ? "started" : st.toLowerCase()) +
        (failed && c.err ? " — " + c.err : "")] };
    }
    return { cls: "", nodes: [a + " " + (md.source || "")] };
  }

  function wantEvent(ev) {
    if (ev.type !== "operation") return true;
    // Operations: the start and the end, not every progress step.
    const c = (ev.metadata || {}).context || {};
    return ev.metadata.action === "operation-created" || ["Success", "Failure", "Cancelled"].includes(c.status);
  }

  function addEvent(ev) {
    if (!wantEvent(ev)) return;
    const t = eventText(ev);
    const li = el("li", { class: t.cls, "data-event-id": ev.id, "data-action": (ev.metadata || {}).action || "" },
      el("span", { class: "ev-time", title: ev.timestamp, text: clock(new Date(ev.timestamp)) }),
      el("span", { class: "ev-type " + ev.type, text: ev.type }),
      el("span", { class: "ev-text" }, t.nodes));
    const list = $("events");
    list.prepend(li);
    while (list.children.length > EVENTS_KEPT) list.lastElementChild.remove();
    $("events-empty").classList.add("hidden");
  }

  // What a lifecycle event says about a VM, applied at once (the re-read that follows
  // brings the rest: memory, cores, numbers).
  const STATE_OF = { "vm-started": "running", "vm-resumed": "running", "vm-stopped": "stopped",
    "vm-crashed": "crashed", "vm-paused": "paused" };

  function patch(ev) {
    if (!state || ev.type !== "lifecycle") return false;
    const md = ev.metadata || {};
    const c = md.context || {};
    const name = (md.source || "").startsWith("/1.0/vms/") ? md.source.slice(9) : null;
    const v = name && state.vms.find((x) => x.name === name);
    if (!v) return false;
    if (STATE_OF[md.action]) {
      v.state = STATE_OF[md.action];
      if (c.partition) v.partition = c.partition;
      if (v.state === "stopped" || v.state === "crashed") { v.host_memory = null; v.cpu_pct = null; v.wait_pct = null; }
      return true;
    }
    if (md.action === "vm-moved" && c.to) { v.partition = c.to; v.state = "running"; return true; }
    return false;
  }

  function onEvent(msg) {
    let ev;
    try { ev = JSON.parse(msg.data); } catch (e) { return; }
    if (typeof ev.id === "number") {
      if (ev.id <= lastEventId) return;       // replayed after a reconnect
      lastEventId = ev.id;
    }
    addEvent(ev);
    if (state && ev.id > state.last_event_id && patch(ev)) {
      patches.push(ev);
      render();
    }
    refreshSoon();
  }

  function subscribe() {
    // `since` replays what the log holds after that id (this page's reconnects too).
    source = new EventSource(lastEventId >= 0 ? "/1.0/events?since=" + lastEventId : "/1.0/events");
    source.onopen = () => setLive("live", "live");
    for (const type of ["lifecycle", "operation", "governor"]) source.addEventListener(type, onEvent);
    source.addEventListener("overflow", () => { /* the stream ends; onerror reconnects */ });
    source.onerror = () => {
      setLive("down", "reconnecting…");
      source.close();
      setTimeout(subscribe, 2000);
    };
  }

  // -- start ---------------------------------------------------------------------------
  async function start() {
    $("resize-form").addEventListener("submit", submitResize);
    $("resize-cancel").addEventListener("click", () => $("resize-dialog").close());
    $("ksm-run").addEventListener("change", toggleKsm);
    const logout = $("logout");
    if (logout) {
      logout.addEventListener("click", async () => {
        try { await call("POST", "/logout"); } catch (e) { /* going to the login page anyway */ }
        window.location.assign("/login");
      });
    }
    await refresh();
    // The recent history first (up to 100 events back), then live.
    lastEventId = state ? Math.max(0, state.last_event_id - 100) : -1;
    subscribe();
    poll();
  }

  window.fusuma = { refresh: () => refresh(), get state() { return state; } };
  start();
})();
