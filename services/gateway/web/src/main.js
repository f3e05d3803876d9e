// The chat page. What the page shows is what the conversation service stores: a turn's user
// message and reply are appended by the gateway (conversation_id on the completion), a regenerate
// or an edit first drops the stored messages it replaces (keep_messages), and the generation
// settings live in the conversation's metadata. The API key stays in this browser's localStorage.
import "./style.css";
import { Api, ApiError, describeError, sseEvents } from "./api.js";
import { copyText, renderInto } from "./markdown.js";

const KEY_ITEM = "llmserve.apiKey";
const CONVERSATION_ITEM = "llmserve.conversation";
const DEFAULTS = { temperature: "0.7", max_tokens: "512", system_prompt: "" };
const TITLE_CHARS = 60;

const $ = (id) => document.getElementById(id);
const state = {
  api: new Api(localStorage.getItem(KEY_ITEM) || ""),
  conversation: null,    // the open conversation (id, title, model, metadata); null: a new chat
  busy: false,           // a turn (a send, regenerate or edit) is under way; one at a time
  streaming: null,       // the AbortController of the reply being streamed
  lastSystem: "",        // the system prompt the stored history already holds
  countdown: null,
};

// ---- status line -----------------------------------------------------------------------------

function status(text, { error = false, retryS = null } = {}) {
  clearInterval(state.countdown);
  const box = $("status");
  box.className = error ? "error" : "";
  box.setAttribute("role", error ? "alert" : "status");
  box.replaceChildren();
  if (!text) return;
  const message = document.createElement("span");
  message.textContent = text;
  box.append(message);
  if (retryS == null) return;
  const clock = document.createElement("span");
  clock.className = "retry";
  box.append(" ", clock);
  const until = Date.now() + retryS * 1000;
  const tick = () => {
    const left = Math.ceil((until - Date.now()) / 1000);
    if (left > 0) { clock.textContent = `Retry in ${left} s.`; return; }
    clearInterval(state.countdown);
    clock.textContent = "You can retry now: press Enter.";
  };
  tick();
  state.countdown = setInterval(tick, 250);
}

const showError = (error) => {
  const { text, retry } = describeError(error, $("model").value);
  status(text, { error: true, retryS: retry ?? null });
};

// ---- settings --------------------------------------------------------------------------------

function settingsFromPage() {
  return { temperature: $("temperature").value, max_tokens: $("max-tokens").value,
           system_prompt: $("system-prompt").value };
}

function showSettings(metadata) {
  const s = { ...DEFAULTS, ...metadata };
  $("temperature").value = s.temperature;
  $("max-tokens").value = s.max_tokens;
  $("system-prompt").value = s.system_prompt;
}

/** The sampling fields of a request, or throws with what is wrong. */
function sampling() {
  const temperature = Number($("temperature").value);
  const maxTokens = Number($("max-tokens").value);
  if (!(temperature >= 0 && temperature <= 2)) throw new Error("Temperature must be between 0 and 2.");
  if (!(Number.isInteger(maxTokens) && maxTokens >= 1)) throw new Error("Max tokens must be a whole number of at least 1.");
  return { temperature, max_completion_tokens: maxTokens };
}

async function saveSettings() {
  if (!state.conversation) return;
  try {
    state.conversation = await state.api.json(`/v1/conversations/${state.conversation.id}`, {
      method: "POST", body: { model: $("model").value, metadata: settingsFromPage() } });
  } catch (e) { showError(e); }
}

// ---- messages --------------------------------------------------------------------------------

const messageArticles = () => [...$("messages").querySelectorAll("article.message")];
const nearBottom = (box) => box.scrollHeight - box.scrollTop - box.clientHeight < 48;

/** Keeps the reader's place: follows the bottom only if the reader was there. */
function keepingScroll(change) {
  const box = $("messages");
  const follow = nearBottom(box);
  change();
  if (follow) box.scrollTop = box.scrollHeight;
}

function addMessage(role, content, { partial = false } = {}) {
  const article = document.createElement("article");
  article.className = `message ${role}`;
  article.setAttribute("aria-label", role === "user" ? "You" : "Assistant");
  const body = document.createElement("div");
  body.className = "body";
  const meta = document.createElement("footer");
  meta.className = "meta";
  const stats = document.createElement("span");
  stats.className = "stats";
  const stopped = document.createElement("span");
  stopped.className = "stopped";
  stopped.textContent = "Stopped: partial answer";
  const actions = document.createElement("span");
  actions.className = "actions";
  if (role === "user") {
    actions.append(button("Edit", "edit", "Edit and resend this message", () => startEdit(article)));
  } else {
    actions.append(button("Copy", "copy", "Copy this answer", (e) => copyText(article.text, e.currentTarget)),
                   button("Regenerate", "regenerate", "Regenerate this answer", () => exclusive(regenerate)));
  }
  meta.append(stopped, stats, actions);
  article.append(body, meta);
  setText(article, content);
  article.classList.toggle("partial", partial);
  $("empty").hidden = true;
  $("messages").append(article);
  return article;
}

function button(text, className, label, onClick) {
  const b = document.createElement("button");
  b.type = "button";
  b.className = className;
  b.textContent = text;
  b.setAttribute("aria-label", label);
  b.addEventListener("click", onClick);
  return b;
}

function setText(article, text) {
  article.text = text;
  const body = article.querySelector(".body");
  if (article.classList.contains("user")) body.textContent = text;
  else renderInto(body, text);
}

function clearMessages() {
  for (const article of messageArticles()) article.remove();
  $("empty").hidden = false;
}

function setBusy(busy) {
  $("send").disabled = busy;
  $("stop").disabled = !busy;
  document.body.classList.toggle("busy", busy);
}

// ---- conversations ---------------------------------------------------------------------------

/** A title from the first message: its first line, cut at a word near TITLE_CHARS. */
function titleFrom(text) {
  const line = text.trim().split("\n")[0].replace(/\s+/g, " ");
  if (line.length <= TITLE_CHARS) return line;
  const cut = line.slice(0, TITLE_CHARS);
  const space = cut.lastIndexOf(" ");
  return (space > TITLE_CHARS / 2 ? cut.slice(0, space) : cut) + "…";
}

const displayTitle = (c) => c.title || `Untitled · ${new Date(c.created_at * 1000).toLocaleString()}`;

async function loadModels() {
  const models = (await state.api.json("/v1/models")).data;
  $("model").replaceChildren(...models.map((m) => new Option(m.id, m.id)));
}

async function loadConversations() {
  const list = (await state.api.json("/v1/conversations?limit=100")).data;
  const current = state.conversation && state.conversation.id;
  $("conversations").replaceChildren(...list.map((c) => {
    const li = document.createElement("li");
    li.dataset.id = c.id;
    const open = button(displayTitle(c), "open", "", () => openConversation(c.id));
    open.removeAttribute("aria-label");
    open.title = displayTitle(c);
    if (c.id === current) {
      li.className = "current";
      open.setAttribute("aria-current", "page");
    }
    li.append(open, button("✎", "rename", `Rename “${displayTitle(c)}”`, () => startRename(li, c)),
              button("×", "delete", `Delete “${displayTitle(c)}”`, () => deleteConversation(c)));
    return li;
  }));
}

function showConversation(conversation) {
  state.conversation = conversation;
  localStorage.setItem(CONVERSATION_ITEM, conversation.id);
  $("conversation-title").textContent = displayTitle(conversation);
  document.title = `${displayTitle(conversation)} · llmserve chat`;
}

async function openConversation(id) {
  if (state.busy) return;
  closeDrawer();
  status("");
  let conversation;
  try {
    conversation = await state.api.json(`/v1/conversations/${encodeURIComponent(id)}`);
  } catch (e) {
    if (e instanceof ApiError && e.status === 404) { newChat(); await loadConversations(); return; }
    throw e;
  }
  showConversation(conversation);
  if (conversation.model && [...$("model").options].some((o) => o.value === conversation.model)) {
    $("model").value = conversation.model;
  }
  showSettings(conversation.metadata);
  clearMessages();
  state.lastSystem = "";
  for (const m of conversation.messages) {
    if (m.role === "system") state.lastSystem = m.content;
    else addMessage(m.role, m.content, { partial: m.partial });
  }
  refreshActions();
  $("messages").scrollTop = $("messages").scrollHeight;
  await loadConversations();
  $("prompt").focus();
}

function newChat() {
  if (state.busy) return;
  closeDrawer();
  state.conversation = null;
  state.lastSystem = "";
  localStorage.removeItem(CONVERSATION_ITEM);
  clearMessages();
  showSettings({});
  $("conversation-title").textContent = "New chat";
  document.title = "llmserve chat";
  for (const li of $("conversations").children) {
    li.classList.remove("current");
    li.querySelector(".open").removeAttribute("aria-current");
  }
  status("");
  $("prompt").focus();
}

function startRename(li, conversation) {
  const input = document.createElement("input");
  input.className = "rename-input";
  input.value = conversation.title;
  input.setAttribute("aria-label", "New title");
  let done = false;
  const finish = async (save) => {
    if (done) return;
    done = true;
    const title = input.value.trim();
    if (save && title && title !== conversation.title) {
      try {
        const updated = await state.api.json(`/v1/conversations/${conversation.id}`, { method: "POST", body: { title } });
        if (state.conversation && state.conversation.id === updated.id) showConversation(updated);
      } catch (e) { showError(e); }
    }
    await loadConversations();
  };
  input.addEventListener("keydown", (e) => {
    if (e.key === "Enter") { e.preventDefault(); finish(true); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); finish(false); }
  });
  input.addEventListener("blur", () => finish(true));
  li.replaceChildren(input);
  input.focus();
  input.select();
}

async function deleteConversation(conversation) {
  if (!confirm(`Delete “${displayTitle(conversation)}”? This cannot be undone.`)) return;
  try {
    await state.api.call(`/v1/conversations/${conversation.id}`, { method: "DELETE" });
  } catch (e) { showError(e); return; }
  if (state.conversation && state.conversation.id === conversation.id) newChat();
  await loadConversations();
}

// ---- a turn ----------------------------------------------------------------------------------

async function ensureConversation(text) {
  if (!state.conversation) {
    showConversation(await state.api.json("/v1/conversations", { method: "POST", body: {
      title: titleFrom(text), model: $("model").value, metadata: settingsFromPage() } }));
  } else if (!state.conversation.title) {
    showConversation(await state.api.json(`/v1/conversations/${state.conversation.id}`, {
      method: "POST", body: { title: titleFrom(text) } }));
  }
}

/** Runs one turn at a time: a second Enter while a turn starts does nothing. */
async function exclusive(work) {
  if (state.busy) return;
  state.busy = true;
  try { await work(); } finally { state.busy = false; }
}

async function send(text) {
  let params;
  try { params = sampling(); } catch (e) { status(e.message, { error: true }); return; }
  status("");
  const user = addMessage("user", text);
  try {
    const isNew = !state.conversation;
    await ensureConversation(text);
    if (isNew) await loadConversations();
  } catch (e) {
    user.remove();
    restorePrompt(text);
    showError(e);
    return;
  }
  await streamReply(user, text, params);
}

function restorePrompt(text) {
  if (!$("prompt").value.trim()) $("prompt").value = text;
  if (!messageArticles().length) $("empty").hidden = false;
  $("prompt").focus();
}

/** Streams the reply to `user` (its text), with TTFT and tokens/s; a failure before any token
 *  takes the turn back (nothing was stored) and returns its text to the message box. */
async function streamReply(user, text, params) {
  const reply = addMessage("assistant", "");
  reply.setAttribute("aria-busy", "true");
  $("messages").scrollTop = $("messages").scrollHeight;
  refreshActions();
  const abort = new AbortController();
  state.streaming = abort;
  setBusy(true);
  const system = $("system-prompt").value.trim();
  const messages = system && system !== state.lastSystem ? [{ role: "system", content: system }] : [];
  messages.push({ role: "user", content: text });
  const started = performance.now();
  let first = null, last = null, pieces = 0, usage = null, content = "", pending = false;
  const paint = () => {
    pending = false;
    keepingScroll(() => setText(reply, content));
  };
  try {
    const response = await state.api.call("/v1/chat/completions", { method: "POST", signal: abort.signal, body: {
      model: $("model").value, stream: true, stream_options: { include_usage: true }, ...params,
      conversation_id: state.conversation.id, messages } });
    for await (const chunk of sseEvents(response.body)) {
      if (chunk.error) throw new ApiError(500, chunk, null);
      if (chunk.usage) usage = chunk.usage;
      for (const choice of chunk.choices) {
        if (!choice.delta || !choice.delta.content) continue;
        last = performance.now();
        first ??= last;
        pieces += 1;
        content += choice.delta.content;
        if (!pending) { pending = true; requestAnimationFrame(paint); }
      }
    }
    state.lastSystem = system || state.lastSystem;
  } catch (e) {
    if (first !== null) {
      reply.classList.add("partial");
      state.lastSystem = system || state.lastSystem;
      if (e.name !== "AbortError") showError(e);
    } else if (e.name === "AbortError") {
      reply.remove();           // stopped before the first token: the message is kept, no reply
      state.lastSystem = system || state.lastSystem;
    } else {
      reply.remove();
      user.remove();
      restorePrompt(text);
      showError(e);
    }
  } finally {
    state.streaming = null;
    setBusy(false);
    if (reply.isConnected) {
      paint();
      reply.setAttribute("aria-busy", "false");
      showStats(reply, started, first, last, usage ? usage.completion_tokens : pieces);
    }
    refreshActions();
    $("prompt").focus();
  }
}

function showStats(reply, started, first, last, tokens) {
  if (first === null) return;
  const ttft = `TTFT ${((first - started) / 1000).toFixed(2)} s`;
  const seconds = (last - first) / 1000;
  const rate = tokens > 1 && seconds > 0 ? `${((tokens - 1) / seconds).toFixed(1)} tokens/s` : "– tokens/s";
  reply.querySelector(".stats").textContent = `${ttft} · ${rate} · ${tokens} tokens`;
}

/** Regenerate on the last answer only; edits while nothing streams. */
function refreshActions() {
  const articles = messageArticles();
  articles.forEach((a, i) => {
    const regenerate = a.querySelector(".regenerate");
    if (regenerate) regenerate.hidden = i !== articles.length - 1;
  });
}

/** The stored messages the page shows (system messages aside), once the store holds as many as
 *  the page (a stopped reply is stored just after the stream ends). */
async function storedShown() {
  const shown = messageArticles().length;
  for (let attempt = 0; ; attempt++) {
    const conversation = await state.api.json(`/v1/conversations/${state.conversation.id}`);
    const messages = conversation.messages;
    if (messages.filter((m) => m.role !== "system").length >= shown || attempt >= 20) return messages;
    await new Promise((r) => setTimeout(r, 150));
  }
}

/** Drops the stored messages from the index-th shown one on; returns that message. */
async function truncateAt(index) {
  const messages = await storedShown();
  const target = messages.filter((m) => m.role !== "system")[index];
  if (!target) throw new Error("the conversation changed elsewhere; reopen it");
  await state.api.json(`/v1/conversations/${state.conversation.id}`, { method: "POST", body: { keep_messages: target.seq } });
  const system = messages.filter((m) => m.role === "system" && m.seq < target.seq).pop();
  state.lastSystem = system ? system.content : "";
  return target;
}

async function regenerate() {
  const articles = messageArticles();
  const userIndex = articles.findLastIndex((a) => a.classList.contains("user"));
  if (userIndex < 0) return;
  let params;
  try { params = sampling(); } catch (e) { status(e.message, { error: true }); return; }
  status("");
  const user = articles[userIndex];
  try {
    await truncateAt(userIndex);
  } catch (e) { showError(e); return; }
  for (const a of articles.slice(userIndex + 1)) a.remove();
  await streamReply(user, user.text, params);
}

function startEdit(article) {
  if (state.busy || article.classList.contains("editing")) return;
  const body = article.querySelector(".body");
  const editor = document.createElement("form");
  editor.className = "editor";
  const area = document.createElement("textarea");
  area.value = article.text;
  area.setAttribute("aria-label", "Edit your message");
  const save = document.createElement("button");
  save.type = "submit";
  save.textContent = "Send";
  const cancel = button("Cancel", "cancel", "Cancel editing", () => stop());
  editor.append(area, save, cancel);
  article.classList.add("editing");
  body.hidden = true;
  article.insertBefore(editor, body);
  area.focus();
  const stop = () => { editor.remove(); body.hidden = false; article.classList.remove("editing"); };
  area.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) { e.preventDefault(); editor.requestSubmit(); }
    if (e.key === "Escape") { e.preventDefault(); e.stopPropagation(); stop(); }
  });
  editor.addEventListener("submit", (e) => {
    e.preventDefault();
    const text = area.value;
    if (!text.trim()) return;
    exclusive(async () => {
      const index = messageArticles().indexOf(article);
      try {
        await truncateAt(index);
      } catch (err) { showError(err); return; }
      for (const a of messageArticles().slice(index)) a.remove();
      await send(text);
    });
  });
}

// ---- the narrow layout's drawer --------------------------------------------------------------

function closeDrawer() {
  if (!document.body.classList.contains("drawer-open")) return;
  document.body.classList.remove("drawer-open");
  $("menu").setAttribute("aria-expanded", "false");
  $("scrim").hidden = true;
  if ($("sidebar").contains(document.activeElement)) $("menu").focus();
}

function openDrawer() {
  document.body.classList.add("drawer-open");
  $("menu").setAttribute("aria-expanded", "true");
  $("scrim").hidden = false;
  $("new-conversation").focus();
}

// ---- start -----------------------------------------------------------------------------------

/** Local mode (make run) tells the page its development key; production never does. */
async function devKey() {
  try {
    const config = await (await fetch("/chat/config")).json();
    return config.dev_api_key || "";
  } catch (_) { return ""; }
}

async function start() {
  if (!state.api.key) {
    const key = await devKey();
    if (key) { state.api.key = key; localStorage.setItem(KEY_ITEM, key); }
  }
  $("api-key").value = state.api.key;
  if (!state.api.key) {
    status("Enter an API key to start.");
    $("api-key").focus();
    return;
  }
  try {
    await loadModels();
    await loadConversations();
    const saved = localStorage.getItem(CONVERSATION_ITEM);
    if (saved) await openConversation(saved); else newChat();
    status("");
  } catch (e) { showError(e); }
  $("prompt").focus();
}

function wire() {
  $("key-form").addEventListener("submit", (e) => {
    e.preventDefault();
    state.api.key = $("api-key").value.trim();
    localStorage.setItem(KEY_ITEM, state.api.key);
    start();
  });
  $("new-conversation").addEventListener("click", newChat);
  $("stop").addEventListener("click", () => state.streaming && state.streaming.abort());
  $("menu").addEventListener("click", () => {
    if (document.body.classList.contains("drawer-open")) closeDrawer(); else openDrawer();
  });
  $("scrim").addEventListener("click", closeDrawer);
  $("settings-toggle").addEventListener("click", () => {
    const open = $("settings").hidden;
    $("settings").hidden = !open;
    $("settings-toggle").setAttribute("aria-expanded", String(open));
  });
  for (const id of ["temperature", "max-tokens", "system-prompt", "model"]) $(id).addEventListener("change", saveSettings);
  $("composer").addEventListener("submit", (e) => {
    e.preventDefault();
    const text = $("prompt").value;
    if (!text.trim() || state.busy) return;
    $("prompt").value = "";
    autosize();
    exclusive(() => send(text));
  });
  const autosize = () => {
    const prompt = $("prompt");
    prompt.style.height = "auto";
    prompt.style.height = `${Math.min(prompt.scrollHeight, 240)}px`;
  };
  $("prompt").addEventListener("input", autosize);
  $("prompt").addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      $("composer").requestSubmit();
    }
  });
  document.addEventListener("keydown", (e) => {
    if (e.key !== "Escape") return;
    if (state.streaming) state.streaming.abort();
    else if (document.body.classList.contains("drawer-open")) closeDrawer();
  });
}

wire();
start();
