// The chat page: conversations (localStorage), the model picker, settings, attachments, and the
// streamed answer with its reasoning, rendering and timing.

import { ApiError, listModels, pageInfo, setApiKey, streamChat } from "./api.js";
import { renderMarkdown } from "./markdown.js";
import * as store from "./store.js";

const $ = (id) => document.getElementById(id);
const el = (tag, cls, text) => {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined) e.textContent = text;
  return e;
};

const state = {
  models: [], // /v1/models data
  info: null, // /webui/info: modalities per model, the server's sampling defaults
  data: store.loadChats(), // {chats: [...], current: id}
  settings: store.loadSettings(),
  run: null, // the answer being streamed: {controller, msg, node}
  pending: [], // attachments of the message being written: {kind, name, url (a data: URL), format}
};

// ---------------------------------------------------------------- conversations
function currentChat() {
  return state.data.chats.find((c) => c.id === state.data.current) || null;
}

function newChat() {
  const chat = {
    id: store.newId(),
    title: "New chat",
    messages: [],
    model: null,
    created: Date.now(),
    updated: Date.now(),
  };
  state.data.chats.unshift(chat);
  state.data.current = chat.id;
  return chat;
}

function save() {
  if (!store.saveChats(state.data)) notify("Browser storage is full: older attachments were dropped from saved chats.");
}

function renderChatList() {
  const list = $("chat-list");
  list.replaceChildren();
  for (const chat of state.data.chats) {
    const li = el("li", "chat-entry");
    const open = el("button", "chat-open", chat.title || "New chat");
    open.type = "button";
    if (chat.id === state.data.current) open.setAttribute("aria-current", "true");
    open.addEventListener("click", () => {
      if (state.run) return notify("Stop the current answer before switching chats.");
      state.data.current = chat.id;
      save();
      renderChatList();
      renderChat();
      closeSidebar();
      $("prompt").focus();
    });
    const del = el("button", "chat-delete", "×");
    del.type = "button";
    del.setAttribute("aria-label", `Delete chat: ${chat.title || "New chat"}`);
    del.addEventListener("click", () => {
      if (state.run && chat.id === state.data.current) return notify("Stop the current answer first.");
      state.data.chats = state.data.chats.filter((c) => c !== chat);
      if (state.data.current === chat.id) state.data.current = state.data.chats[0]?.id || null;
      save();
      renderChatList();
      renderChat();
      (list.querySelector(".chat-open") || $("new-chat")).focus();
    });
    li.append(open, del);
    list.append(li);
  }
}

// ---------------------------------------------------------------- messages
function statsText(s) {
  if (!s) return "";
  const parts = [];
  if (s.tps !== null) parts.push(`${s.tps.toFixed(1)} tok/s`);
  if (s.ttft !== null) parts.push(`TTFT ${s.ttft.toFixed(2)} s`);
  if (s.tokens !== null) parts.push(`${s.estimated ? "~" : ""}${s.tokens} token${s.tokens === 1 ? "" : "s"}`);
  if (s.finish === "length") parts.push("hit max tokens");
  if (s.finish === "stopped") parts.push("stopped");
  return parts.join(" · ");
}

function messageNode(m) {
  const user = m.role === "user";
  const art = el("article", `msg ${m.role}`);
  const who = el("h3", "who", user ? "You" : `Assistant${m.model ? " · " + m.model : ""}`);
  art.append(who);
  if (!user) {
    const details = el("details", "reasoning");
    details.append(el("summary", null, "Reasoning"), el("div", "reasoning-body md"));
    details.hidden = !m.reasoning;
    art.append(details);
  }
  const body = el("div", "content md");
  art.append(body);
  if (user && m.attachments && m.attachments.length) {
    const ul = el("ul", "msg-attachments");
    for (const a of m.attachments) {
      const li = el("li");
      if (a.kind === "image" && a.url) {
        const img = el("img");
        img.src = a.url;
        img.alt = a.name;
        li.append(img);
      } else {
        li.textContent = `${a.kind === "audio" ? "Audio" : "Image"}: ${a.name}${a.url ? "" : " (not kept)"}`;
      }
      ul.append(li);
    }
    art.append(ul);
  }
  art.append(el("p", "error", ""), el("p", "stats", ""));
  fillMessage(art, m, true);
  return art;
}

// Bring a message's node up to date; `final`: the text is complete (copy buttons on code).
function fillMessage(node, m, final) {
  const body = node.querySelector(".content");
  if (m.role === "user") {
    body.textContent = m.content; // the user's own words, shown as written
  } else {
    body.innerHTML = renderMarkdown(m.content);
    const details = node.querySelector(".reasoning");
    details.hidden = !m.reasoning;
    if (m.reasoning) {
      node.querySelector(".reasoning-body").innerHTML = renderMarkdown(m.reasoning);
      details.querySelector("summary").textContent = !final && !m.content ? "Reasoning (thinking…)" : "Reasoning";
    }
    if (final) addCopyButtons(body);
  }
  const err = node.querySelector(".error");
  err.textContent = m.error || "";
  err.hidden = !m.error;
  const stats = node.querySelector(".stats");
  stats.textContent = statsText(m.stats);
  stats.hidden = !m.stats;
}

// The clipboard API needs a secure context (https, or localhost); over plain http from another
// machine, copy through a selection instead.
async function copyText(text) {
  try {
    await navigator.clipboard.writeText(text);
    return true;
  } catch {
    const t = el("textarea");
    t.value = text;
    t.setAttribute("readonly", "");
    t.className = "sr-only";
    document.body.append(t);
    t.select();
    const ok = document.execCommand("copy");
    t.remove();
    return ok;
  }
}

function addCopyButtons(root) {
  for (const pre of root.querySelectorAll("pre")) {
    const b = el("button", "copy btn small", "Copy");
    b.type = "button";
    b.setAttribute("aria-label", "Copy code");
    b.addEventListener("click", async () => {
      b.textContent = (await copyText(pre.querySelector("code")?.textContent ?? pre.textContent))
        ? "Copied"
        : "Copy failed";
      setTimeout(() => (b.textContent = "Copy"), 1500);
    });
    const wrap = el("div", "code-block");
    pre.replaceWith(wrap);
    wrap.append(b, pre);
  }
}

function renderChat() {
  const log = $("log");
  const chat = currentChat();
  log.replaceChildren();
  if (!chat || !chat.messages.length) {
    log.append(el("p", "empty", "Ask anything. Answers stream in as the model writes them."));
  } else {
    for (const m of chat.messages) log.append(messageNode(m));
  }
  if (chat && chat.model && state.models.some((x) => x.id === chat.model)) $("model").value = chat.model;
  updateAttachTools();
  log.scrollTop = log.scrollHeight;
}

// ---------------------------------------------------------------- models and server info
function modelLabel(m) {
  const st = m.status && m.status.value;
  return st ? `${m.id} (${st})` : m.id;
}

function selectedModel() {
  const sel = $("model");
  return sel.value || state.models[0]?.id || null;
}

function modalitiesOf(id) {
  const info = state.info;
  if (!info) return ["text"];
  const entry = state.models.find((m) => m.id === id);
  const base = entry && entry.parent ? entry.parent : id; // a LoRA adapter takes what its model takes
  const known = entry && Array.isArray(entry.modalities) ? entry.modalities : info.models?.[base]?.modalities;
  if (Array.isArray(known)) return known;
  // not loaded yet: what the server was started to accept
  return ["text", ...(info.media?.image ? ["image"] : []), ...(info.media?.audio ? ["audio"] : [])];
}

function updateAttachTools() {
  const mods = modalitiesOf(selectedModel());
  $("attach-image").hidden = !mods.includes("image");
  $("attach-audio").hidden = !mods.includes("audio");
}

async function refreshModels() {
  const data = await listModels();
  state.models = Array.isArray(data.data) ? data.data : [];
  const sel = $("model");
  const keep = sel.value || currentChat()?.model || state.settings.model;
  sel.replaceChildren();
  for (const m of state.models) {
    const o = el("option", null, modelLabel(m));
    o.value = m.id;
    sel.append(o);
  }
  if (keep && state.models.some((m) => m.id === keep)) sel.value = keep;
  const several = state.models.length > 1;
  sel.hidden = !several;
  $("model-name").hidden = several;
  $("model-name").textContent = state.models[0]?.id || "no model";
}

async function refreshServer() {
  try {
    await refreshModels();
    state.info = await pageInfo();
    hideKeyForm();
    showDefaults();
    updateAttachTools();
    return true;
  } catch (e) {
    if (e instanceof ApiError && e.status === 401)
      showKeyForm(state.keyTried ? "That key was not accepted. Try again." : null);
    else notify(`Cannot reach the server's API: ${e.message}`);
    return false;
  }
}

// ---------------------------------------------------------------- API key
function showKeyForm(why) {
  $("key-form").hidden = false;
  $("settings-key").hidden = false;
  if (why) $("key-why").textContent = why;
  $("api-key").focus();
}

function hideKeyForm() {
  $("key-form").hidden = true;
}

function useKey(key, remember) {
  setApiKey(key);
  store.saveKey(key, remember);
  $("api-key").value = key;
  $("settings-api-key").value = key;
  state.keyTried = true;
}

// ---------------------------------------------------------------- settings
const FIELDS = [
  ["temperature", "temperature", parseFloat],
  ["top-p", "top_p", parseFloat],
  ["max-tokens", "max_tokens", (v) => parseInt(v, 10)],
];

function showDefaults() {
  const d = state.info?.defaults || {};
  for (const [id, key] of FIELDS) $(id).placeholder = d[key] !== undefined && d[key] !== null ? String(d[key]) : "";
}

function loadSettingsForm() {
  const s = state.settings;
  $("system").value = s.system || "";
  for (const [id, key] of FIELDS) $(id).value = s[key] ?? "";
  $("thinking").checked = s.thinking ?? !!state.info?.defaults?.thinking;
}

function saveSettingsForm() {
  const s = state.settings;
  s.system = $("system").value;
  for (const [id, key, parse] of FIELDS) {
    const v = parse($(id).value);
    s[key] = Number.isFinite(v) ? v : null;
  }
  s.thinking = $("thinking").checked;
  store.saveSettings(s);
  const key = $("settings-api-key").value.trim();
  if (!$("settings-key").hidden) useKey(key, store.keyRemembered());
}

// ---------------------------------------------------------------- attachments
const AUDIO_FORMATS = { wav: "wav", wave: "wav", mp3: "mp3", mpeg: "mp3", flac: "flac", ogg: "ogg" };

function readFile(file) {
  return new Promise((resolve, reject) => {
    const r = new FileReader();
    r.onload = () => resolve(r.result);
    r.onerror = () => reject(r.error);
    r.readAsDataURL(file);
  });
}

async function addFiles(files, kind) {
  for (const f of files) {
    const url = await readFile(f);
    let format = null;
    if (kind === "audio") {
      const ext = (f.name.split(".").pop() || "").toLowerCase();
      format = AUDIO_FORMATS[ext] || AUDIO_FORMATS[(f.type.split("/")[1] || "").replace("x-", "")];
      if (!format) {
        notify(`${f.name}: audio must be WAV, MP3, FLAC or OGG.`);
        continue;
      }
    }
    state.pending.push({ kind, name: f.name, url, format });
  }
  renderPending();
}

function renderPending() {
  const ul = $("attachments");
  ul.replaceChildren();
  state.pending.forEach((a, i) => {
    const li = el("li", "chip");
    if (a.kind === "image") {
      const img = el("img");
      img.src = a.url;
      img.alt = "";
      li.append(img);
    }
    li.append(el("span", null, `${a.kind === "audio" ? "Audio" : "Image"}: ${a.name}`));
    const rm = el("button", "btn small", "×");
    rm.type = "button";
    rm.setAttribute("aria-label", `Remove ${a.name}`);
    rm.addEventListener("click", () => {
      state.pending.splice(i, 1);
      renderPending();
      $("prompt").focus();
    });
    li.append(rm);
    ul.append(li);
  });
  ul.hidden = !state.pending.length;
}

function contentOf(m) {
  const media = (m.attachments || []).filter((a) => a.url);
  if (!media.length) return m.content;
  const parts = m.content ? [{ type: "text", text: m.content }] : [];
  for (const a of media) {
    if (a.kind === "image") parts.push({ type: "image_url", image_url: { url: a.url } });
    else
      parts.push({ type: "input_audio", input_audio: { data: a.url.slice(a.url.indexOf(",") + 1), format: a.format } });
  }
  return parts;
}

// ---------------------------------------------------------------- sending and streaming
function requestBody(chat) {
  const s = state.settings;
  const messages = [];
  if (s.system && s.system.trim()) messages.push({ role: "system", content: s.system });
  for (const m of chat.messages.slice(0, -1)) {
    if (m.role === "assistant" && !m.content) continue; // an answer that failed or was stopped before any text
    messages.push({ role: m.role, content: m.role === "user" ? contentOf(m) : m.content });
  }
  const body = { model: chat.model || undefined, messages, stream: true, stream_options: { include_usage: true } };
  for (const [, key] of FIELDS) if (s[key] !== null && s[key] !== undefined) body[key] = s[key];
  const dflt = !!state.info?.defaults?.thinking;
  if (s.thinking !== undefined && s.thinking !== dflt) body.enable_thinking = s.thinking;
  return body;
}

function setStreaming(on) {
  $("send").hidden = on;
  $("stop").hidden = !on;
  $("log").setAttribute("aria-busy", on ? "true" : "false");
  $("model").disabled = on;
}

async function send() {
  if (state.run) return;
  const text = $("prompt").value.trim();
  if (!text && !state.pending.length) return;
  const chat = currentChat() || newChat();
  chat.model = selectedModel();
  state.settings.model = chat.model;
  store.saveSettings(state.settings);
  if (!chat.messages.length) chat.title = (text || state.pending[0].name).slice(0, 60);
  const user = { role: "user", content: text, attachments: state.pending };
  const msg = { role: "assistant", content: "", reasoning: "", model: chat.model, stats: null, error: null };
  chat.messages.push(user, msg);
  chat.updated = Date.now();
  state.pending = [];
  renderPending();
  $("prompt").value = "";
  autosize();
  save();
  renderChatList();
  renderChat();
  const node = $("log").lastElementChild;
  await stream(chat, msg, node);
}

async function stream(chat, msg, node) {
  const controller = new AbortController();
  state.run = { controller, msg, node };
  const hadFocus = document.activeElement === $("send");
  setStreaming(true);
  if (hadFocus) $("stop").focus();
  announce("Answer started.");
  const t0 = performance.now();
  let tFirst = null;
  let tLast = null;
  let pieces = 0; // chunks carrying text: the token count while usage is not known
  let usage = null;
  let finish = null;
  let frame = 0;
  const paint = () => {
    frame = 0;
    const log = $("log");
    const atBottom = log.scrollHeight - log.scrollTop - log.clientHeight < 80;
    fillMessage(node, msg, false);
    if (atBottom) log.scrollTop = log.scrollHeight;
  };
  try {
    await streamChat(requestBody(chat), controller.signal, (chunk) => {
      if (chunk.usage) usage = chunk.usage;
      for (const c of chunk.choices || []) {
        const d = c.delta || {};
        const add = (d.content || "") + (d.reasoning_content || "");
        if (d.reasoning_content) msg.reasoning += d.reasoning_content;
        if (d.content) msg.content += d.content;
        if (add) {
          const now = performance.now();
          if (tFirst === null) tFirst = now;
          tLast = now;
          pieces += 1;
        }
        if (c.finish_reason) finish = c.finish_reason;
      }
      if (!frame) frame = requestAnimationFrame(paint);
    });
  } catch (e) {
    if (e.name === "AbortError") finish = "stopped";
    else {
      msg.error = e.message;
      if (e instanceof ApiError && e.status === 401) showKeyForm("The server refused the API key. Enter a valid one.");
    }
  } finally {
    if (frame) cancelAnimationFrame(frame);
    const tokens = usage ? usage.completion_tokens : pieces;
    if (tFirst !== null) {
      const span = (tLast - tFirst) / 1000;
      msg.stats = {
        ttft: (tFirst - t0) / 1000,
        tps: tokens > 1 && span > 0 ? (tokens - 1) / span : null,
        tokens,
        estimated: !usage,
        finish,
      };
    } else if (finish === "stopped") {
      msg.stats = { ttft: null, tps: null, tokens: 0, estimated: false, finish };
    }
    state.run = null;
    chat.updated = Date.now();
    save();
    fillMessage(node, msg, true);
    const stopHadFocus = document.activeElement === $("stop");
    setStreaming(false);
    if (stopHadFocus) $("prompt").focus();
    announce(msg.error ? `Error: ${msg.error}` : finish === "stopped" ? "Answer stopped." : "Answer finished.");
    refreshModels().catch(() => {}); // a model may have been loaded for this answer
  }
}

function stop() {
  if (state.run) state.run.controller.abort();
}

// ---------------------------------------------------------------- small UI helpers
let noticeTimer = 0;
function notify(text) {
  const n = $("notice");
  n.textContent = text;
  n.hidden = false;
  clearTimeout(noticeTimer);
  noticeTimer = setTimeout(() => (n.hidden = true), 8000);
}

function announce(text) {
  $("status").textContent = text;
}

function autosize() {
  const t = $("prompt");
  t.style.height = "auto";
  t.style.height = `${t.scrollHeight + 2}px`;
}

function openSidebar() {
  $("sidebar").classList.add("open");
  $("toggle-sidebar").setAttribute("aria-expanded", "true");
  ($("sidebar").querySelector("[aria-current]") || $("new-chat")).focus();
}

function closeSidebar() {
  if (!$("sidebar").classList.contains("open")) return;
  $("sidebar").classList.remove("open");
  $("toggle-sidebar").setAttribute("aria-expanded", "false");
}

// ---------------------------------------------------------------- wiring
function wire() {
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    send();
  });
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      send();
    }
  });
  $("prompt").addEventListener("input", autosize);
  $("stop").addEventListener("click", stop);
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape" || $("settings").open) return;
    if (state.run) {
      e.preventDefault();
      stop();
    } else if ($("sidebar").classList.contains("open")) {
      closeSidebar();
      $("toggle-sidebar").focus();
    }
  });
  $("new-chat").addEventListener("click", () => {
    if (state.run) return notify("Stop the current answer before starting a new chat.");
    const cur = currentChat();
    if (!cur || cur.messages.length) newChat();
    save();
    renderChatList();
    renderChat();
    closeSidebar();
    $("prompt").focus();
  });
  $("toggle-sidebar").addEventListener("click", () =>
    $("sidebar").classList.contains("open") ? closeSidebar() : openSidebar(),
  );
  $("model").addEventListener("change", () => {
    const chat = currentChat();
    if (chat) chat.model = $("model").value;
    state.settings.model = $("model").value;
    store.saveSettings(state.settings);
    save();
    updateAttachTools();
  });
  $("attach-image").addEventListener("click", () => $("image-input").click());
  $("attach-audio").addEventListener("click", () => $("audio-input").click());
  $("image-input").addEventListener("change", (e) =>
    addFiles([...e.target.files], "image").then(() => (e.target.value = "")),
  );
  $("audio-input").addEventListener("change", (e) =>
    addFiles([...e.target.files], "audio").then(() => (e.target.value = "")),
  );
  $("open-settings").addEventListener("click", () => {
    loadSettingsForm();
    $("settings").showModal();
  });
  $("settings-form").addEventListener("submit", (e) => {
    e.preventDefault();
    $("settings").close();
  });
  $("settings").addEventListener("close", () => {
    saveSettingsForm();
    $("open-settings").focus();
    refreshServer();
  });
  $("reset-settings").addEventListener("click", () => {
    for (const [id] of FIELDS) $(id).value = "";
    $("system").value = "";
    $("thinking").checked = !!state.info?.defaults?.thinking;
  });
  $("key-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    useKey($("api-key").value, $("remember-key").checked);
    if (await refreshServer()) {
      announce("API key accepted.");
      $("prompt").focus();
    }
  });
  document.addEventListener("visibilitychange", () => {
    if (!document.hidden && !state.run) refreshModels().catch(() => {});
  });
}

async function main() {
  const key = store.loadKey();
  setApiKey(key);
  $("api-key").value = key;
  $("settings-api-key").value = key;
  $("remember-key").checked = store.keyRemembered();
  if (!currentChat()) state.data.current = state.data.chats[0]?.id || null;
  wire();
  renderPending();
  renderChatList();
  renderChat();
  await refreshServer();
  renderChat();
  document.body.dataset.ready = "true"; // for tests and scripts: the models are listed
}

main();
